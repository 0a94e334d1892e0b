"""Where a host's upload service lives: the per-user runtime directory, one sub-directory per service.

A service is identified by its base path and the options that shape its files and batches (two jobs
with different compression must not share files), hashed into a short key. Its directory holds:

* `lock`      flock guarding start-up and shutdown (two racing writers start one service)
* `sock`      the Unix socket clients connect to (multiprocessing.connection, `authkey`)
* `authkey`   32 random bytes, mode 0600
* `pid`       the service's pid and instance id (for tests and operators)
* `config.json` the options the service was started with
* `journal/`  the registry's append-only journal and its snapshot
* `service.log` stderr of the service and its children
* `tmp/`      the service's temporary files (multiprocessing's `pymp-*` forkserver directory)

A Unix socket's path is limited to 108 bytes on Linux and 104 on macOS. Where the socket or the
forkserver's listener below a service directory would be longer (a long `TMPDIR` or
`DSTL_RUNTIME_DIR`), both are reached through a short symbolic link to the runtime directory,
`/tmp/dstl-sock-<uid>/<16 hex>` (or below `$XDG_RUNTIME_DIR`; `socket_root`): the files stay in the
service directory, only their spelling is short.

Nothing is left behind (docs/service.md): a service that exits with an empty journal removes its
directory, and a client that starts sweeps the directories of services that died (`sweep_stale`),
except those whose journal still holds unconfirmed work: the next service for that configuration
replays it.
"""
from __future__ import annotations

import contextlib
import fcntl
import hashlib
import json
import os
import secrets
import shutil
import sys
import tempfile
from dataclasses import dataclass
from typing import Iterator, Optional

# Bumped whenever client and service messages change: other versions get a service of their own.
PROTOCOL_VERSION = 3

# Options that do not change what the service does (client-side only) are left out of the key.
_CLIENT_ONLY = {"upload_mode", "cache_idle_timeout_ms", "preemptive_persist_threshold", "base_path"}


def runtime_root() -> str:
    """`$DSTL_RUNTIME_DIR`, else `$XDG_RUNTIME_DIR/dstl`, else `<tmp>/dstl-<uid>` (created 0700)."""
    root = os.environ.get("DSTL_RUNTIME_DIR")
    if not root:
        xdg = os.environ.get("XDG_RUNTIME_DIR")
        root = os.path.join(xdg, "dstl") if xdg else os.path.join(tempfile.gettempdir(), f"dstl-{os.getuid()}")
    os.makedirs(root, mode=0o700, exist_ok=True)
    st = os.stat(root)
    if st.st_uid != os.getuid():
        raise PermissionError(f"runtime directory {root} belongs to uid {st.st_uid}, not to this user")
    return root


def normalize_base_path(base_path: str) -> str:
    """Local paths become absolute (two spellings of one directory share a service)."""
    if "://" in base_path and not base_path.startswith("file://"):
        return base_path.rstrip("/")
    path = base_path[len("file://"):] if base_path.startswith("file://") else base_path
    return os.path.realpath(os.path.abspath(path))


def service_fingerprint(config) -> dict:
    """The options a service is built from (what the key hashes)."""
    fields = {k: v for k, v in _config_fields(config).items() if k not in _CLIENT_ONLY}
    fields["base_path"] = normalize_base_path(config.base_path)
    # other credentials, another service; only a digest of them takes part (never the values)
    fs_options = fields.pop("fs_options", None) or {}
    if fs_options:
        blob = json.dumps(fs_options, sort_keys=True, default=repr).encode()
        fields["fs_options"] = hashlib.sha256(b"dstl-fs-options\0" + blob).hexdigest()
    fields["protocol"] = PROTOCOL_VERSION
    return fields


def _config_fields(config) -> dict:
    import dataclasses

    return {f.name: getattr(config, f.name) for f in dataclasses.fields(config)}


def service_key(config) -> str:
    """16 hex digits naming the service of `config` on this host."""
    blob = json.dumps(service_fingerprint(config), sort_keys=True, default=str).encode()
    return hashlib.sha256(blob).hexdigest()[:16]


# sun_path holds 108 bytes on Linux, 104 on macOS and the BSDs, the terminating NUL included
SUN_PATH_MAX = 108 if sys.platform.startswith("linux") else 104
# the longest socket path below a runtime root: "/<16 hex>/tmp/pymp-xxxxxxxx/listener-xxxxxxxx"
# (multiprocessing's forkserver listener in the service's temporary directory)
SOCKET_TAIL = len("/0123456789abcdef/tmp/pymp-12345678/listener-12345678")
LINK_DIR_PREFIX = "dstl-sock-"


def _fits(root: str) -> bool:
    return len(os.fsencode(root)) + SOCKET_TAIL < SUN_PATH_MAX


def _link_bases() -> list:
    bases = []
    xdg = os.environ.get("XDG_RUNTIME_DIR")
    if xdg:
        bases.append(xdg)
    bases.append("/tmp")
    return bases


def socket_root(root: str) -> str:
    """`root` spelled short enough for every socket below it: `root` itself when it fits, else a
    symbolic link to it, `<base>/dstl-sock-<uid>/<16 hex of root>`, in the first base of
    `$XDG_RUNTIME_DIR` and /tmp where one can be kept (a directory of this user's, mode 0700).
    Raises OSError, one line naming the path, the limit and the variable to set, if none can."""
    if _fits(root):
        return root
    name = hashlib.sha256(os.fsencode(root)).hexdigest()[:16]
    tried = []
    for base in _link_bases():
        link_dir = os.path.join(base, f"{LINK_DIR_PREFIX}{os.getuid()}")
        link = os.path.join(link_dir, name)
        tried.append(link_dir)
        if not _fits(link):
            continue
        try:
            _ensure_link(link_dir, link, root)
        except OSError as exc:
            _log().debug("no socket link in %s: %s", link_dir, exc)
            continue
        return link
    longest = len(os.fsencode(root)) + SOCKET_TAIL
    raise OSError(f"the upload service's sockets below {root} would be {longest} bytes long, over the "
                  f"{SUN_PATH_MAX - 1}-byte limit of a Unix socket path, and no short link to it could be made "
                  f"in {' or '.join(tried)}; set DSTL_RUNTIME_DIR to a directory of at most "
                  f"{SUN_PATH_MAX - 1 - SOCKET_TAIL} characters")


def _ensure_link(link_dir: str, link: str, target: str) -> None:
    """`link` -> `target`, in `link_dir` (made 0700; refused unless it is this user's own directory)."""
    os.makedirs(link_dir, mode=0o700, exist_ok=True)
    st = os.lstat(link_dir)
    import stat as _stat

    if not _stat.S_ISDIR(st.st_mode) or st.st_uid != os.getuid() or st.st_mode & 0o077:
        raise PermissionError(f"{link_dir} is not a directory of this user's with mode 0700")
    try:
        if os.readlink(link) == target:
            return
    except FileNotFoundError:
        pass
    tmp = f"{link}.{os.getpid()}.{secrets.token_hex(3)}"
    os.symlink(target, tmp)
    os.replace(tmp, link)  # atomic: a racing client sees the old link or the new one


def sweep_socket_links() -> int:
    """Remove this user's socket links whose runtime directory is gone; returns how many."""
    removed = 0
    for base in _link_bases():
        link_dir = os.path.join(base, f"{LINK_DIR_PREFIX}{os.getuid()}")
        try:
            names = os.listdir(link_dir)
        except OSError:
            continue
        for name in names:
            link = os.path.join(link_dir, name)
            if os.path.islink(link) and not os.path.exists(link):
                try:
                    os.unlink(link)
                    removed += 1
                except OSError:
                    pass
    return removed


@dataclass(frozen=True)
class ServicePaths:
    """The files of one service directory."""

    directory: str

    @classmethod
    def for_config(cls, config) -> "ServicePaths":
        d = os.path.join(runtime_root(), service_key(config))
        os.makedirs(d, mode=0o700, exist_ok=True)
        paths = cls(d)
        paths.socket_directory  # noqa: B018  (fails early, with the fix, where no short spelling exists)
        return paths

    @property
    def socket_directory(self) -> str:
        """This directory as spelled for its sockets: itself, or through the short link to its
        runtime root (`socket_root`; made or mended on the way)."""
        parent, name = os.path.split(self.directory)
        return os.path.join(socket_root(parent), name)

    @property
    def lock(self) -> str:
        return os.path.join(self.directory, "lock")

    @property
    def socket(self) -> str:
        """The socket clients connect to (short enough to bind: see `socket_directory`)."""
        return os.path.join(self.socket_directory, "sock")

    @property
    def authkey_file(self) -> str:
        return os.path.join(self.directory, "authkey")

    @property
    def pid_file(self) -> str:
        return os.path.join(self.directory, "pid")

    @property
    def config_file(self) -> str:
        return os.path.join(self.directory, "config.json")

    @property
    def journal_dir(self) -> str:
        return os.path.join(self.directory, "journal")

    @property
    def log_file(self) -> str:
        return os.path.join(self.directory, "service.log")

    @property
    def tmp_dir(self) -> str:
        """TMPDIR of the service and its children (their temporary files go with the directory)."""
        return os.path.join(self.directory, "tmp")

    @property
    def socket_tmp_dir(self) -> str:
        """`tmp_dir` spelled for sockets: multiprocessing's temporary directory (its forkserver
        listener) is made below this one."""
        return os.path.join(self.socket_directory, "tmp")

    def authkey(self, create: bool = False) -> bytes:
        """The shared secret of this service directory (created once, 0600)."""
        if create and not os.path.exists(self.authkey_file):
            tmp = f"{self.authkey_file}.{os.getpid()}.tmp"
            fd = os.open(tmp, os.O_WRONLY | os.O_CREAT | os.O_TRUNC, 0o600)
            try:
                os.write(fd, secrets.token_bytes(32))
            finally:
                os.close(fd)
            os.replace(tmp, self.authkey_file)
        with open(self.authkey_file, "rb") as f:
            return f.read()

    def read_pid(self) -> Optional[int]:
        """The pid the running (or last) service wrote, or None."""
        try:
            with open(self.pid_file) as f:
                return int(f.read().split()[0])
        except (OSError, ValueError, IndexError):
            return None


@contextlib.contextmanager
def file_lock(path: str, timeout_s: Optional[float] = None) -> Iterator[None]:
    """An exclusive flock on `path` (released on exit, and by the kernel if the holder dies).

    Held only once `path` still names the locked file: a lock file whose directory was removed
    while this waited for it excludes nobody (the next opener makes a new one), so it is dropped
    and `path` opened again (FileNotFoundError if its directory is gone)."""
    import time

    deadline = None if timeout_s is None else time.monotonic() + timeout_s
    while True:
        fd = os.open(path, os.O_RDWR | os.O_CREAT, 0o600)
        try:
            while True:
                try:
                    fcntl.flock(fd, fcntl.LOCK_EX | (0 if deadline is None else fcntl.LOCK_NB))
                    break
                except BlockingIOError:
                    if time.monotonic() >= deadline:
                        raise TimeoutError(f"could not lock {path} within {timeout_s} s") from None
                    time.sleep(0.01)
            if _names(path, fd):
                break
        except BaseException:
            os.close(fd)
            raise
        os.close(fd)
    try:
        yield
    finally:
        os.close(fd)  # closing the descriptor drops the lock


def _names(path: str, fd: int) -> bool:
    """Whether `path` is the file open as `fd`."""
    try:
        st = os.stat(path)
    except FileNotFoundError:
        return False
    held = os.fstat(fd)
    return (st.st_dev, st.st_ino) == (held.st_dev, held.st_ino)


TRASH_PREFIX = ".removed-"  # a service directory being deleted (see _remove_dir)


def _trash_name(name: str) -> str:
    """What `_remove_dir` renames directory `name` to: the prefix, the name, the remover's pid."""
    return f"{TRASH_PREFIX}{name}.{os.getpid()}.{secrets.token_hex(3)}"


def _trash_remover(name: str) -> Optional[int]:
    """The pid of the process removing the directory `name`, if `name` is a `_trash_name`."""
    if not name.startswith(TRASH_PREFIX):
        return None
    pid = name.rsplit(".", 2)[-2]
    return int(pid) if pid.isdigit() else -1  # -1: a malformed name, which no process owns


def _remove_dir(directory: str) -> None:
    """Rename `directory` aside (atomically), then delete it: a client that makes it anew meanwhile
    gets an empty one of its own, never one whose files are still being deleted."""
    parent, name = os.path.split(directory)
    trash = os.path.join(parent, _trash_name(name))
    try:
        os.rename(directory, trash)
    except FileNotFoundError:
        return
    shutil.rmtree(trash, ignore_errors=True)


def pid_alive(pid: int) -> bool:
    """True if a process with `pid` exists and is not a zombie."""
    try:
        os.kill(pid, 0)
    except ProcessLookupError:
        return False
    except PermissionError:
        return True
    try:
        with open(f"/proc/{pid}/stat") as f:
            return f.read().rsplit(")", 1)[1].split()[0] != "Z"
    except OSError:
        return True


# a directory younger than this is never swept: a client may have just made it for a service it starts
SWEEP_GRACE_S = 30.0


def journal_has_work(journal_dir: str) -> bool:
    """True if the registry journal in `journal_dir` tracks any file (unconfirmed change sets,
    orphans, pending deletions, intents): work the next service must replay."""
    if not os.path.isdir(journal_dir):
        return False
    from dstl.changelog.upload.service.journal import Journal

    try:  # a registry process (of a live or a dying service) holds this lock while it uses the journal
        with file_lock(os.path.join(journal_dir, "lock"), timeout_s=0):
            j = Journal(journal_dir)
            try:
                st = j.load()
            finally:
                j.close()
    except TimeoutError:
        return True
    return bool(st.entries or st.orphans or st.pending_delete or st.intents)


def remove_if_idle(paths: "ServicePaths", own_pid: Optional[int] = None, lock_timeout_s: float = 5.0) -> bool:
    """Remove a service directory if no service runs in it (or only `own_pid`, exiting) and its
    journal holds no work. Under the directory's lock, so no client is starting a service meanwhile."""
    try:
        with file_lock(paths.lock, timeout_s=lock_timeout_s):
            pid = paths.read_pid()
            if pid is not None and pid != own_pid and pid_alive(pid):
                return False
            if journal_has_work(paths.journal_dir):
                return False
            _remove_dir(paths.directory)
            return True
    except (TimeoutError, FileNotFoundError):
        return False


def sweep_runtime_dirs(root: Optional[str] = None, grace_s: float = SWEEP_GRACE_S) -> int:
    """Remove the directories of services that died (no live pid) with an empty journal; in those
    kept for their journal, remove the dead service's socket, pid file and temporary files.
    Returns how many directories were removed."""
    import time

    root = root or runtime_root()
    if grace_s == SWEEP_GRACE_S and os.environ.get("DSTL_SWEEP_GRACE_S"):  # tests: sweep young dirs too
        grace_s = float(os.environ["DSTL_SWEEP_GRACE_S"])
    removed = 0
    now = time.time()
    for name in os.listdir(root):
        if name.startswith("_"):  # not a service's: the Spark slots' sockets (dstl.spark.slot_client)
            continue
        d = os.path.join(root, name)
        try:
            if not os.path.isdir(d) or now - os.stat(d).st_mtime < grace_s:
                continue
        except FileNotFoundError:
            continue
        remover = _trash_remover(name)
        if remover is not None:  # being removed: left over if its remover died mid-way
            if remover < 0 or not pid_alive(remover):
                shutil.rmtree(d, ignore_errors=True)
            continue
        paths = ServicePaths(d)
        pid = paths.read_pid()
        if pid is not None and pid_alive(pid):
            continue
        if remove_if_idle(paths, lock_timeout_s=0):
            removed += 1
        else:  # unconfirmed work: keep the journal for the next service, drop the dead one's leftovers
            shutil.rmtree(paths.tmp_dir, ignore_errors=True)
    return removed


CACHE_PREFIX = "dstl-download-cache-"
def sweep_download_caches(directory: Optional[str] = None, prefix: str = CACHE_PREFIX, grace_s: float = 0.0) -> int:
    """Remove `<prefix><pid>-*` directories (download caches; with another `prefix`, local-recovery
    owner directories) whose process is gone, and, with `grace_s`, in which nothing was written for
    that long (a dead owner's latest copies may still be what a retry restores from); returns how many."""
    import time

    directory = directory or tempfile.gettempdir()
    removed = 0
    try:
        names = os.listdir(directory)
    except OSError:
        return 0
    for name in names:
        if not name.startswith(prefix):
            continue
        pid = name[len(prefix):].split("-", 1)[0]
        if not pid.isdigit() or int(pid) == os.getpid() or pid_alive(int(pid)):
            continue
        path = os.path.join(directory, name)
        if grace_s > 0 and time.time() - _newest_dir_mtime(path) < grace_s:
            continue
        shutil.rmtree(path, ignore_errors=True)
        removed += 1
    return removed


def _newest_dir_mtime(path: str) -> float:
    """The latest mtime of `path` and the directories below it (a file added or removed shows there)."""
    newest = 0.0
    for root, _dirs, _files in os.walk(path):
        try:
            newest = max(newest, os.stat(root).st_mtime)
        except OSError:
            continue
    return newest


def sweep_stale(root: Optional[str] = None) -> dict:
    """What a starting client cleans up: dead services' runtime directories, download caches of dead
    processes, shared-memory segments whose service and client both died. Never raises."""
    out = {"runtime_dirs": 0, "download_caches": 0, "segments": 0}
    try:
        out["runtime_dirs"] = sweep_runtime_dirs(root)
    except OSError as exc:
        _log().warning("could not sweep the runtime directory: %s", exc)
    try:
        sweep_socket_links()
    except OSError as exc:
        _log().warning("could not sweep socket links: %s", exc)
    try:
        out["download_caches"] = sweep_download_caches()
    except OSError as exc:
        _log().warning("could not sweep download caches: %s", exc)
    try:
        from dstl.changelog.upload.service import shm

        out["segments"] = shm.sweep_orphans(pid_alive)
    except OSError as exc:
        _log().warning("could not sweep shared memory segments: %s", exc)
    return out


def _log():
    import logging

    return logging.getLogger(__name__)


__all__ = ["runtime_root", "socket_root", "sweep_socket_links", "SUN_PATH_MAX", "service_key", "service_fingerprint", "ServicePaths", "file_lock", "pid_alive",
           "normalize_base_path", "journal_has_work", "remove_if_idle", "sweep_runtime_dirs", "sweep_stale"]
