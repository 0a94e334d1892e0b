"""This host's local-recovery copies of changelog files (Flink's local recovery, one level up).

With local recovery on, every uploaded changelog file is also written, under the same uuid name, to
``<local_recovery_dir>/jid_<job>/taskowned/`` (dstl.changelog.upload.uploader). A host keeps one
*root* directory (`default_root`, or ``$DSTL_LOCAL_RECOVERY_DIR``) shared by every process of the
user, and each process writes below its own *owner* directory in it, ``owner-<pid>-<random>``:

* a restore anywhere on the host finds the copies of every owner (`LocalCopies`), so a subtask that
  moves to another Python worker or executor of the same host reads its files from the local disk;
* the process that wrote copies removes those no checkpoint it still serves references (`prune`);
* the copies of a process that died (a lost executor takes its Python workers with it) are removed
  by the next process that starts, by the owner pid in the directory name, the way download caches
  are swept (dstl.changelog.upload.service.runtime.sweep_download_caches with `OWNER_PREFIX`).

A copy is used only if it exists and decodes to the handle's logical length (a compressed file's
CRCs or checksums are all checked on the way); anything else is read from the base path instead.
"""
from __future__ import annotations

import logging
import os
import tempfile
import uuid
from typing import Dict, Iterable, List, Optional

log = logging.getLogger(__name__)

#: the executors' environment variable naming the host's root directory ("off" disables local recovery)
ENV = "DSTL_LOCAL_RECOVERY_DIR"
#: an owner directory's name: OWNER_PREFIX + "<pid>-<random>"
OWNER_PREFIX = "owner-"
_OFF = ("off", "none", "false", "0", "no")


def default_root() -> str:
    """``<temp dir>/dstl-local-recovery-<uid>``: every process of this user on this host shares it."""
    return os.path.join(tempfile.gettempdir(), f"dstl-local-recovery-{os.getuid()}")


def configured_root(environ: Optional[Dict[str, str]] = None) -> Optional[str]:
    """The root from ``$DSTL_LOCAL_RECOVERY_DIR`` (its default when unset), None when it says off."""
    value = (os.environ if environ is None else environ).get(ENV, "").strip()
    if value.lower() in _OFF:
        return None
    return os.path.abspath(value) if value else default_root()


def ensure_root(root: str) -> str:
    """Create `root` (mode 0700) if needed; refuse one that belongs to another user."""
    os.makedirs(root, mode=0o700, exist_ok=True)
    st = os.stat(root)
    if st.st_uid != os.getuid():
        raise PermissionError(f"local-recovery directory {root} belongs to uid {st.st_uid}, not to this user")
    if st.st_mode & 0o077:
        os.chmod(root, 0o700)
    return root


def new_owner_dir(root: str) -> str:
    """A fresh owner directory for this process below `root` (the pid first, for the sweep)."""
    path = os.path.join(root, f"{OWNER_PREFIX}{os.getpid()}-{uuid.uuid4().hex[:8]}")
    os.makedirs(path, mode=0o700)
    return path


def _taskowned(directory: str, job_id: str) -> str:
    return os.path.join(directory, f"jid_{job_id}", "taskowned")


class LocalCopies:
    """Finds local copies of a job's changelog files: in `directory` (a storage's own
    local-recovery directory) and, with `root`, in every owner directory below the host's root.

    Counts what restores read (`hits`: files read from a copy, `misses`: read from the base path,
    `rejected`: a copy that was there but short, unreadable or corrupt)."""

    def __init__(self, job_id: str, *, directory: Optional[str] = None, root: Optional[str] = None):
        self.job_id = job_id
        self.directory = directory
        self.root = root
        self.enabled = True
        self.hits = 0
        self.misses = 0
        self.rejected = 0
        #: names of the files read from copies since the caller last cleared it (a restore's suspects)
        self.read: List[str] = []

    def directories(self) -> List[str]:
        """The ``taskowned`` directories that exist now (own first)."""
        out: List[str] = []
        if self.directory:
            out.append(_taskowned(self.directory, self.job_id))
        if self.root:
            try:
                names = sorted(os.listdir(self.root))
            except OSError:
                names = []
            for name in names:
                if name.startswith(OWNER_PREFIX):
                    d = _taskowned(os.path.join(self.root, name), self.job_id)
                    if d not in out:
                        out.append(d)
        return [d for d in out if os.path.isdir(d)]

    def index(self) -> Dict[str, str]:
        """File name -> path of a copy, over every directory (one listing each)."""
        found: Dict[str, str] = {}
        if not self.enabled:
            return found
        for d in self.directories():
            try:
                names = os.listdir(d)
            except OSError:
                continue
            for name in names:
                found.setdefault(name, os.path.join(d, name))
        return found

    def discard(self, names: Iterable[str]) -> int:
        """Delete the copies named `names` wherever they are (a copy found corrupt); returns how many."""
        wanted = set(names)
        return sum(_remove(os.path.join(d, name)) for d in self.directories() for name in wanted)

    def counters(self) -> Dict[str, int]:
        return {"hits": self.hits, "misses": self.misses, "rejected": self.rejected}

    def __repr__(self) -> str:
        return f"LocalCopies({self.job_id}, directory={self.directory!r}, root={self.root!r})"


def source_of(before: Dict[str, int], after: Dict[str, int]) -> str:
    """Where a restore read its files, from the `LocalCopies.counters()` around it: "local",
    "local+dfs" (some files had no usable copy) or "dfs"."""
    hits = after["hits"] - before["hits"]
    misses = after["misses"] - before["misses"]
    if hits and misses:
        return "local+dfs"
    return "local" if hits else "dfs"


def prune(directory: str, job_id: str, keep: Iterable[str]) -> int:
    """Delete this owner's copies of `job_id` whose names are not in `keep` (the files the
    checkpoints it still serves reference); returns how many."""
    d = _taskowned(directory, job_id)
    keep = set(keep)
    try:
        names = os.listdir(d)
    except OSError:
        return 0
    return sum(_remove(os.path.join(d, name)) for name in names if name not in keep)


def _remove(path: str) -> bool:
    """Delete one copy; False if it was not there or could not be deleted (logged: best effort)."""
    try:
        os.remove(path)
        return True
    except FileNotFoundError:
        return False
    except OSError as exc:
        log.warning("could not delete the local copy %s: %s", path, exc)
        return False


def file_names(snapshots: Iterable) -> List[str]:
    """The file names (uuid basenames) every handle of `snapshots` (KeyedStateSnapshot-like) reads."""
    out: Dict[str, None] = {}
    for snap in snapshots:
        if snap is None:
            continue
        for h in snap.handles():
            for stream, _ in getattr(h, "handles_and_offsets", ()):
                out.setdefault(os.path.basename(stream.path.rstrip("/")), None)
    return list(out)


__all__ = ["ENV", "OWNER_PREFIX", "LocalCopies", "default_root", "configured_root", "ensure_root",
           "new_owner_dir", "prune", "file_names", "source_of"]
