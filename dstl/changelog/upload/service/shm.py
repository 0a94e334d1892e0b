"""Shared-memory hand-off of sealed change-set bodies (one copy: writer -> segment -> uploader).

Naming: `dstl_<service pid>_<instance>_<client pid>_<client>_<n>`, so the owner of every segment can
be found from its name alone (by the service when a client dies, by a later service when both died).

Creation uses the same POSIX shm_open as multiprocessing.shared_memory (readers may attach with
`SharedMemory(name)`; the uploader reads with pread). The client keeps each segment mapped and builds
the bodies straight into the mapping (`Segment`): the sealed body's one copy.

Ownership: the client that creates a segment owns it and unlinks it when its task finishes (done,
failed, cancelled) or when it closes. If the client dies, the service unlinks what the client left
(`sweep`). Python's resource_tracker is told to forget every segment (creator and attacher side), so it
neither unlinks a segment another process still needs nor warns about "leaked" ones at exit.
"""
from __future__ import annotations

import errno
import logging
import mmap
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


class Segment:
    """A client's segment, mapped for as long as the client keeps it.

    Bodies are written into the mapping directly (`SealedBody.write_into` builds a body there: its
    one copy, with no intermediate buffer), and a reused segment's pages and page-table entries exist
    already, so writing it again costs a plain memcpy. The pages are allocated with fallocate before
    they are mapped: a full /dev/shm is then a clean ENOSPC OSError here, never a SIGBUS on a page.
    """

    __slots__ = ("name", "size", "_map", "_ino")

    def __init__(self, name: str, size: int) -> None:
        self.name = name
        self.size = 0
        self._map: Optional[mmap.mmap] = None
        self._ino = -1
        self._resize(segment_size(size), os.O_CREAT | os.O_EXCL | os.O_RDWR)

    def _resize(self, size: int, flags: int) -> None:
        fd = _shm_open(self.name, flags)
        try:
            try:
                os.ftruncate(fd, size)
                os.posix_fallocate(fd, 0, size)
            except OSError as exc:
                if exc.errno in (errno.ENOSPC, errno.ENOMEM):
                    raise OSError(exc.errno, f"shared memory ({SHM_DIR}) is full: cannot hold {size} bytes "
                                             "of change sets for the upload service") from exc
                raise
            self.close()
            self._map = mmap.mmap(fd, size, flags=mmap.MAP_SHARED | _POPULATE)
            self.size = size
            self._ino = os.fstat(fd).st_ino
        except BaseException:
            if flags & os.O_CREAT:  # a segment that never held anything is not left behind
                unlink(self.name)
            raise
        finally:
            os.close(fd)

    def write(self, bodies: Sequence) -> Tuple[int, List[Tuple[int, int]]]:
        """Write `bodies` back to back from offset 0 (growing the segment if they do not fit); return
        (the bytes used, [(offset, length)]). FileNotFoundError if the segment had to grow but its
        name is gone (swept)."""
        lengths = [len(b) if _streams(b) or hasattr(b, "write_into") else _flat(b).nbytes for b in bodies]
        need = max(1, sum(lengths))
        if os.stat(os.path.join(SHM_DIR, self.name)).st_ino != self._ino:  # swept (and made anew)
            raise FileNotFoundError(errno.ENOENT, "shared memory segment is gone", self.name)
        if need > self.size:
            self._resize(segment_size(need), os.O_RDWR)
        m = self._map
        spans = []
        pos = 0
        for b, n in zip(bodies, lengths):
            if hasattr(b, "write_into"):
                b.write_into(m, pos)
            elif _streams(b):
                at = pos

                def put(piece, m=m) -> None:
                    nonlocal at
                    v = _flat(piece)
                    m[at:at + v.nbytes] = v
                    at += v.nbytes

                b.write_to(put, max(1, min(n, STREAM_PIECE)))
                if at - pos != n:
                    raise RuntimeError(f"a sealed body streamed {at - pos} bytes, but its length is {n}")
            else:
                m[pos:pos + n] = _flat(b)
            spans.append((pos, n))
            pos += n
        return need, spans

    def close(self) -> None:
        """Drop the mapping (the segment stays until unlinked)."""
        m, self._map = self._map, None
        if m is not None:
            try:
                m.close()
            except BufferError:  # a view is still exported: the mapping goes with its last view
                pass

    def unlink(self) -> bool:
        self.close()
        return unlink(self.name)

    def __repr__(self) -> str:
        return f"Segment({self.name!r}, size={self.size})"


_POPULATE = getattr(mmap, "MAP_POPULATE", 0)  # page-table entries filled at map time, not per page fault


def segment_size(need: int) -> int:
    """Sizes segments are made in: 64 KiB steps below 1 MiB, 1 MiB steps above, so that bodies of
    similar size share kept segments and a segment rarely has to grow."""
    step = 64 << 10 if need < (1 << 20) else 1 << 20
    return max(step, (need + step - 1) // step * step)


def _flat(b) -> memoryview:
    v = b if isinstance(b, memoryview) else memoryview(b)
    return v if v.format == "B" and v.ndim == 1 else v.cast("B")


# pieces a streaming body without `write_into` is copied in (each piece is one memcpy into the mapping)
STREAM_PIECE = 16 << 20


def _streams(body) -> bool:
    """A body that produces its bytes while it is written (`write_to`): copied piece by piece."""
    return not isinstance(body, (bytes, bytearray, memoryview)) and hasattr(body, "write_to")


def _shm_open(name: str, flags: int) -> int:
    try:
        import _posixshmem  # what multiprocessing.shared_memory uses

        return _posixshmem.shm_open("/" + name, flags, mode=0o600)
    except ImportError:  # pragma: no cover - every CPython on Linux has it
        return os.open(os.path.join(SHM_DIR, name), flags, 0o600)


def open_readonly(name: str) -> int:
    """A read-only descriptor of an existing segment (FileNotFoundError if it is gone): the uploader
    copies from it with pread, without mapping it."""
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


__all__ = ["Segment", "segment_size", "open_readonly", "attach", "unlink", "sweep", "sweep_orphans",
           "list_segments", "segment_prefix", "SHM_DIR"]

