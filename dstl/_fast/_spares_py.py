"""Pure-Python twin of `dstl._fast._spares`: the memory kept for reuse between change sets.

The compiled modules keep sealed bodies' record arrays and arenas for the next change sets; the
twins keep nothing (Python's allocator reuses their memory), so the pool is always empty here.
"""
from __future__ import annotations


def spare_bytes() -> int:
    """Idle memory kept for the next change sets: none here (the Cython module keeps sealed bodies'
    arrays and arenas for reuse; Python's allocator does that for the twin)."""
    return 0


def release_spares() -> None:
    """Free the idle memory kept for the next change sets: nothing to free in the twin."""
