"""The per-user runtime directory and the process helpers its users share: the upload service
(dstl.changelog.upload.service) keeps a directory per service there, the Spark slots
(dstl.spark.slot_client, dstl.spark.slot_process) their sockets and locks.

* `runtime_root`: `$DSTL_RUNTIME_DIR`, else `$XDG_RUNTIME_DIR/dstl`, else `<tmp>/dstl-<uid>`, this
  user's own (mode 0700).
* `socket_root`: the root spelled short enough for a Unix socket below it (108 bytes on Linux, 104 on
  macOS): the root itself, or a short symbolic link to it, `/tmp/dstl-sock-<uid>/<16 hex>` (or below
  `$XDG_RUNTIME_DIR`); `sweep_socket_links` removes links whose directory is gone.
* `file_lock`: an exclusive flock that survives its directory's removal; `pid_alive`: a live,
  non-zombie process.
"""
from __future__ import annotations

import contextlib
import fcntl
import hashlib
import logging
import os
import secrets
import stat
import sys
import tempfile
import time
from typing import Iterator, Optional

log = logging.getLogger(__name__)

__all__ = ["runtime_root", "socket_root", "sweep_socket_links", "SUN_PATH_MAX", "SOCKET_TAIL", "LINK_DIR_PREFIX",
           "file_lock", "pid_alive"]


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
            log.debug("no socket link in %s: %s", link_dir, exc)
            continue
        return link
    longest = len(os.fsencode(root)) + SOCKET_TAIL
    raise OSError(f"the sockets below {root} would be {longest} bytes long, over the "
                  f"{SUN_PATH_MAX - 1}-byte limit of a Unix socket path, and no short link to it could be made "
                  f"in {' or '.join(tried)}; set DSTL_RUNTIME_DIR to a directory of at most "
                  f"{SUN_PATH_MAX - 1 - SOCKET_TAIL} characters")


def _ensure_link(link_dir: str, link: str, target: str) -> None:
    """`link` -> `target`, in `link_dir` (made 0700; refused unless it is this user's own directory)."""
    os.makedirs(link_dir, mode=0o700, exist_ok=True)
    st = os.lstat(link_dir)
    if not stat.S_ISDIR(st.st_mode) or st.st_uid != os.getuid() or st.st_mode & 0o077:
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


@contextlib.contextmanager
def file_lock(path: str, timeout_s: Optional[float] = None) -> Iterator[None]:
    """An exclusive flock on `path` (released on exit, and by the kernel if the holder dies).

    Held only once `path` still names the locked file: a lock file whose directory was removed
    while this waited for it excludes nobody (the next opener makes a new one), so it is dropped
    and `path` opened again (FileNotFoundError if its directory is gone)."""
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
