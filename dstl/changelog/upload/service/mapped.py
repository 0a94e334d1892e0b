"""An uploader process's read-only mappings of the clients' segments, kept from one attempt to the next.

Clients reuse their segments (a pool of finished tasks' segments), so the same few segments come back
attempt after attempt. Mapping a segment costs a page-table entry per 4 KiB page and an unmap per
attempt: about 40% of copying a segment into the page cache (docs/service.md). A kept mapping makes
the copy one `write(2)` from pages that are already mapped.

A mapping outlives neither its segment nor a resize: each use compares the segment's inode and size
with the mapping's. A mapping of a segment that was unlinked would pin its pages, so every attempt
first drops the kept mappings whose names are gone or name another inode, the total is bounded
(least recently used go first), and an uploader idle for `IDLE_S` drops them all.
"""
from __future__ import annotations

import mmap
import os
from collections import OrderedDict
from typing import Optional, Tuple

from dstl.changelog.upload.service.shm import SHM_DIR

MAX_BYTES = 256 << 20  # mapped segments kept at most (they are the clients' pages: no extra memory)
IDLE_S = 5.0  # an uploader with no attempt for this long drops its mappings (as clients trim their pools)
_POPULATE = getattr(mmap, "MAP_POPULATE", 0)


class MappedSegments:
    """name -> (inode, size, mmap), least recently used first."""

    def __init__(self, max_bytes: int = MAX_BYTES) -> None:
        self.max_bytes = int(max_bytes)
        self._maps: "OrderedDict[str, Tuple[int, int, mmap.mmap]]" = OrderedDict()
        self._bytes = 0
        self.hits = 0
        self.misses = 0

    def __len__(self) -> int:
        return len(self._maps)

    @property
    def mapped_bytes(self) -> int:
        return self._bytes

    def get(self, name: str, fd: int, end: int) -> Optional[mmap.mmap]:
        """A read-only mapping of the segment open at `fd`, covering at least `end` bytes; None if the
        segment is shorter than `end` (the caller reports that) or too large to keep."""
        st = os.fstat(fd)
        if st.st_size < end:
            return None
        kept = self._maps.get(name)
        if kept is not None:
            ino, size, m = kept
            if ino == st.st_ino and size == st.st_size:
                self._maps.move_to_end(name)
                self.hits += 1
                return m
            self._drop(name)
        if st.st_size > self.max_bytes:
            return None
        self.misses += 1
        m = mmap.mmap(fd, st.st_size, flags=mmap.MAP_SHARED | _POPULATE, prot=mmap.PROT_READ)
        self._maps[name] = (st.st_ino, st.st_size, m)
        self._bytes += st.st_size
        while self._bytes > self.max_bytes and len(self._maps) > 1:
            self._drop(next(iter(self._maps)))
        return m

    def prune(self) -> int:
        """Drop the mappings whose segment name is gone or now names another inode; returns how many."""
        gone = []
        for name, (ino, _size, _m) in self._maps.items():
            try:
                if os.stat(os.path.join(SHM_DIR, name)).st_ino != ino:
                    gone.append(name)
            except FileNotFoundError:
                gone.append(name)
        for name in gone:
            self._drop(name)
        return len(gone)

    def clear(self) -> None:
        for name in list(self._maps):
            self._drop(name)

    def _drop(self, name: str) -> None:
        _ino, size, m = self._maps.pop(name)
        self._bytes -= size
        try:
            m.close()
        except BufferError:  # a view is still out: the mapping goes with it
            pass


__all__ = ["MappedSegments", "MAX_BYTES", "IDLE_S"]
