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
`/tmp/dstl-sock-<uid>/<16 hex>` (or below `$XDG_RUNTIME_DIR`; dstl.runtime_dir.socket_root): the files stay in the
service directory, only their spelling is short.

Nothing is left behind (docs/service.md): a service that exits with an empty journal removes its
directory, and a client that starts sweeps the directories of services that died (`sweep_stale`),
except those whose journal still holds unconfirmed work: the next service for that configuration
replays it.
"""
from __future__ import annotations

import hashlib
import json
import os
import secrets
import shutil
import tempfile
from dataclasses import dataclass
from typing import Optional

from dstl.runtime_dir import (LINK_DIR_PREFIX, SOCKET_TAIL, SUN_PATH_MAX, file_lock, pid_alive,  # noqa: F401
                              runtime_root, socket_root, sweep_socket_links)

# Bumped whenever client and service messages change: other versions get a service of their own.
PROTOCOL_VERSION = 3

# Options that do not change what the service does (client-side only) are left out of the key.
_CLIENT_ONLY = {"upload_mode", "cache_idle_timeout_ms", "preemptive_persist_threshold", "base_path"}


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
