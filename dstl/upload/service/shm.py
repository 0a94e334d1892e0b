"""Shared-memory hand-off of sealed change-set bodies (one copy: writer -> segment -> uploader).

Naming: `dstl_<service pid>_<instance>_<client pid>_<client>_<n>`, so the owner of every segment can
be found from its name alone (by the service when a client dies, by a later service when both died).

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
from typing import Iterable, List, Optional, Sequence, Tuple

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


def create_segment(name: str, bodies: Sequence) -> Tuple[int, List[Tuple[int, int]]]:
    """Create segment `name` holding `bodies` back to back; return (total size, [(offset, length)]).

    Memory is reserved up front (posix_fallocate), so a full /dev/shm is a clean OSError here rather
    than a SIGBUS later. The mapping is closed before returning; the name stays until `unlink`.
    """
    lengths = [len(b) if not isinstance(b, memoryview) else b.nbytes for b in bodies]
    total = max(1, sum(lengths))
    shm = SharedMemory(name=name, create=True, size=total)
    _forget(shm)
    try:
        try:
            os.posix_fallocate(shm._fd, 0, total)  # type: ignore[attr-defined]
        except OSError as exc:
            if exc.errno in (errno.ENOSPC, errno.ENOMEM):
                raise OSError(exc.errno, f"shared memory ({SHM_DIR}) is full: cannot hold {total} bytes "
                                         "of change sets for the upload service") from exc
            if exc.errno not in (errno.EOPNOTSUPP, errno.EINVAL):
                raise
        buf = shm.buf
        pos = 0
        spans = []
        for body, n in zip(bodies, lengths):
            buf[pos:pos + n] = body  # the one copy of the payload
            spans.append((pos, n))
            pos += n
        del buf
    except BaseException:
        shm.close()
        unlink(name)
        raise
    shm.close()
    return total, spans


def attach(name: str) -> SharedMemory:
    """Map an existing segment without taking ownership (FileNotFoundError if it is gone)."""
    shm = SharedMemory(name=name, create=False)
    _forget(shm)
    return shm


def unlink(name: str) -> bool:
    """Remove segment `name`; True if it existed."""
    try:
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
    if len(parts) != 5:
        return None
    try:
        return int(parts[0].split("x")[0]), int(parts[2])
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


__all__ = ["create_segment", "attach", "unlink", "sweep", "sweep_orphans", "list_segments",
           "segment_prefix", "SHM_DIR"]


def _iter_views(shm: SharedMemory, spans: Iterable[Tuple[int, int]]):
    buf = shm.buf
    for off, n in spans:
        yield buf[off:off + n]
