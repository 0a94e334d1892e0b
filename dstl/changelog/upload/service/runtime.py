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
"""
from __future__ import annotations

import contextlib
import fcntl
import hashlib
import json
import os
import secrets
import tempfile
from dataclasses import dataclass
from typing import Iterator, Optional

# Bumped whenever client and service messages change: other versions get a service of their own.
PROTOCOL_VERSION = 2

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


@dataclass(frozen=True)
class ServicePaths:
    """The files of one service directory."""

    directory: str

    @classmethod
    def for_config(cls, config) -> "ServicePaths":
        d = os.path.join(runtime_root(), service_key(config))
        os.makedirs(d, mode=0o700, exist_ok=True)
        paths = cls(d)
        if len(paths.socket) > 100:  # AF_UNIX path limit is 108 bytes including the NUL
            raise OSError(f"runtime directory path too long for a Unix socket: {paths.socket!r}; "
                          "set DSTL_RUNTIME_DIR to a shorter directory")
        return paths

    @property
    def lock(self) -> str:
        return os.path.join(self.directory, "lock")

    @property
    def socket(self) -> str:
        return os.path.join(self.directory, "sock")

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
    """An exclusive flock on `path` (released on exit, and by the kernel if the holder dies)."""
    import time

    fd = os.open(path, os.O_RDWR | os.O_CREAT, 0o600)
    try:
        if timeout_s is None:
            fcntl.flock(fd, fcntl.LOCK_EX)
        else:
            deadline = time.monotonic() + timeout_s
            while True:
                try:
                    fcntl.flock(fd, fcntl.LOCK_EX | fcntl.LOCK_NB)
                    break
                except BlockingIOError:
                    if time.monotonic() >= deadline:
                        raise TimeoutError(f"could not lock {path} within {timeout_s} s") from None
                    time.sleep(0.01)
        yield
    finally:
        os.close(fd)  # closing the descriptor drops the lock


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


__all__ = ["runtime_root", "service_key", "service_fingerprint", "ServicePaths", "file_lock", "pid_alive",
           "normalize_base_path"]
