"""Shared-memory hand-off of sealed change-set bodies (one copy: writer -> segment -> uploader).

Naming: `dstl_<service pid>_<instance>_<client pid>_<client>_<n>`, so the owner of every segment can
be found from its name alone (by the service when a client dies, by a later service when both died).

Creation uses the same POSIX shm_open as multiprocessing.shared_memory (readers attach with
`SharedMemory(name)`), but writes the payload with one pwritev() instead of through a mapping.

Ownership: the client that creates a segment owns it and unlinks it when its task finishes (done,
failed, cancelled) or when it closes. If the client dies, the service unlinks what the client left
(`sweep`). Python's resource_tracker is told to forget every segment (creator and attacher side), so it
neither unlinks a segment another process still needs nor warns about "leaked" ones at exit.
"""
from __future__ import annotations

import errno
import logging
import os
from multiprocessing import resource_tracker
from multiprocessing.shared_memory import SharedMemory
from typing import List, Optional, Sequence, Tuple

log = logging.getLogger(__name__)

SHM_DIR = "/dev/shm"
PREFIX = "dstl_"


def segment_prefix(instance: str, client_pid: int, client_id: str) -> str:
    """Names of one client's segments start with this (instance = `<service pid>x<random>`)."""
    return f"{PREFIX}{instance}_{client_pid}_{client_id}_"


def _forget(shm: SharedMemory) -> None:
    # 3.11 registers attachers too; untracking keeps the single-owner rule (see module docstring)
    try:
        resource_tracker.unregister(shm._name, "shared_memory")  # type: ignore[attr-defined]
    except Exception:  # the tracker may be gone at interpreter exit
        pass


def create_segment(name: str, bodies: Sequence, reuse: bool = False) -> Tuple[int, List[Tuple[int, int]]]:
    """Create segment `name` holding `bodies` back to back; return (total size, [(offset, length)]).
    With `reuse`, `name` exists already (a segment of an earlier, finished task) and is overwritten:
    its pages are already allocated, which makes the copy several times cheaper.

    The bodies are written with writev() on the segment's descriptor rather than through a mapping:
    the one copy then costs what a page-cache write costs (no page-fault per 4 KiB page), and a full
    /dev/shm is a clean ENOSPC OSError here instead of a SIGBUS on a mapped page later.
    """
    items = []  # (memoryview or streaming body, length)
    for b in bodies:
        if _streams(b):
            items.append((b, len(b)))
        else:
            v = b if isinstance(b, memoryview) else memoryview(b)
            v = v if v.format == "B" and v.ndim == 1 else v.cast("B")
            items.append((v, v.nbytes))
    spans = []
    pos = 0
    for _, n in items:
        spans.append((pos, n))
        pos += n
    fd = _shm_open(name, os.O_RDWR if reuse else os.O_CREAT | os.O_EXCL | os.O_RDWR)
    try:
        try:
            if pos == 0:
                os.ftruncate(fd, 1)  # a zero-size segment cannot be mapped by the reader
            at = 0
            views: List[memoryview] = []
            for obj, n in items:
                if isinstance(obj, memoryview):
                    views.append(obj)
                    continue
                at = _write_views(fd, views, at)
                views = []
                at = _write_stream(fd, obj, n, at)
            _write_views(fd, views, at)
        except OSError as exc:
            if exc.errno in (errno.ENOSPC, errno.ENOMEM):
                raise OSError(exc.errno, f"shared memory ({SHM_DIR}) is full: cannot hold {pos} bytes "
                                         "of change sets for the upload service") from exc
            raise
    except BaseException:
        os.close(fd)
        unlink(name)
        raise
    os.close(fd)
    return max(pos, 1), spans


_IOV_MAX = 1024
# pieces a streaming body is written in: each write() gives the GIL up and takes it back, which on a
# busy writer (its appending thread holds the GIL) waits up to the switch interval (5 ms) each
# time, so a body is written whole (it is built whole up to 16 MiB anyway) rather than in 1 MiB pieces
STREAM_PIECE = 16 << 20


def _streams(body) -> bool:
    """A body that produces its bytes while it is written (the Cython `SealedBody`): streamed into the
    segment piece by piece, so the writer never builds the whole body (its only copy is this one)."""
    return not isinstance(body, (bytes, bytearray, memoryview)) and hasattr(body, "write_to")


def _write_views(fd: int, views: List[memoryview], at: int) -> int:
    total = sum(v.nbytes for v in views)
    done = 0
    while done < total:  # writev may write less than asked (large totals, signals)
        done += os.pwritev(fd, _rest(views, done), at + done)
    return at + total


def _write_stream(fd: int, body, length: int, at: int) -> int:
    pos = at

    def write(piece) -> None:
        nonlocal pos
        v = piece if isinstance(piece, memoryview) else memoryview(piece)
        v = v if v.format == "B" and v.ndim == 1 else v.cast("B")
        off = 0
        while off < v.nbytes:
            off += os.pwrite(fd, v[off:], pos + off)
        pos += v.nbytes

    body.write_to(write, max(1, min(length, STREAM_PIECE)))
    if pos - at != length:
        raise RuntimeError(f"a sealed body streamed {pos - at} bytes, but its length is {length}")
    return pos


def _rest(views, skip: int):
    """The views after the first `skip` bytes, at most IOV_MAX of them."""
    out = []
    for v in views:
        if skip >= v.nbytes:
            skip -= v.nbytes
            continue
        out.append(v[skip:] if skip else v)
        skip = 0
        if len(out) == _IOV_MAX:
            break
    return out


def _shm_open(name: str, flags: int) -> int:
    try:
        import _posixshmem  # what multiprocessing.shared_memory uses

        return _posixshmem.shm_open("/" + name, flags, mode=0o600)
    except ImportError:  # pragma: no cover - every CPython on Linux has it
        return os.open(os.path.join(SHM_DIR, name), flags, 0o600)


def open_readonly(name: str) -> int:
    """A read-only descriptor of an existing segment (FileNotFoundError if it is gone): the uploader
    copies from it with sendfile/pread, without mapping it."""
    return _shm_open(name, os.O_RDONLY | getattr(os, "O_CLOEXEC", 0))


def attach(name: str) -> SharedMemory:
    """Map an existing segment without taking ownership (FileNotFoundError if it is gone)."""
    shm = SharedMemory(name=name, create=False)
    _forget(shm)
    return shm


def unlink(name: str) -> bool:
    """Remove segment `name`; True if it existed."""
    try:
        try:
            import _posixshmem

            _posixshmem.shm_unlink("/" + name)
        except ImportError:  # pragma: no cover
            os.unlink(os.path.join(SHM_DIR, name))
        return True
    except FileNotFoundError:
        return False
    except OSError:
        log.warning("could not unlink shared memory segment %s", name, exc_info=True)
        return False


def list_segments(prefix: str = PREFIX) -> List[str]:
    """Names of the segments in /dev/shm that start with `prefix`."""
    try:
        return sorted(n for n in os.listdir(SHM_DIR) if n.startswith(prefix))
    except FileNotFoundError:
        return []


def sweep(prefix: str) -> int:
    """Unlink every segment whose name starts with `prefix`; return how many."""
    return sum(1 for n in list_segments(prefix) if unlink(n))


def parse_name(name: str) -> Optional[Tuple[int, int]]:
    """(service pid, client pid) from a segment name, or None if it is not one of ours."""
    parts = name[len(PREFIX):].split("_") if name.startswith(PREFIX) else []
    if len(parts) != 4:  # instance (= <service pid>x<random>), client pid, client id, n
        return None
    try:
        return int(parts[0].split("x")[0]), int(parts[1])
    except ValueError:
        return None


def sweep_orphans(alive) -> int:
    """Unlink segments whose service and client processes are both gone (`alive(pid) -> bool`)."""
    count = 0
    for n in list_segments():
        pids = parse_name(n)
        if pids is not None and not alive(pids[0]) and not alive(pids[1]) and unlink(n):
            count += 1
    return count


__all__ = ["create_segment", "open_readonly", "attach", "unlink", "sweep", "sweep_orphans", "list_segments",
           "segment_prefix", "SHM_DIR"]

