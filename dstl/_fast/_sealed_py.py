"""Pure-Python twin of `dstl._fast._sealed`: a sealed change-set body, here its bytes themselves.

The compiled `SealedBody` lays its bytes out only while it is written; this one holds them, with the
same methods (`write_to`, `write_into`, `tobytes`) and the same errors.
"""
from __future__ import annotations

from dstl._fast._buffer_common import writable_view

CHUNK = 1 << 20  # bytes per piece of SealedBody.write_to


class SealedBody(bytes):
    """Twin of the Cython `SealedBody`: a sealed body with `write_to(write, chunk_size)` (pieces in
    order, each at most `chunk_size` bytes) and `tobytes()`; here it is the body bytes themselves."""

    __slots__ = ()

    def write_to(self, write, chunk_size: int = CHUNK) -> int:
        """Call `write(view)` with consecutive pieces of the body; returns the bytes written."""
        if chunk_size <= 0:
            raise ValueError(f"chunk_size must be positive, got {chunk_size}")
        view = memoryview(self)
        for pos in range(0, len(self), chunk_size):
            write(view[pos:pos + chunk_size])
        return len(self)

    def write_into(self, out, pos: int = 0) -> int:
        """Write the whole body into the writable buffer `out` at `pos`; returns its length."""
        mv = writable_view(out)
        pos = pos.__index__()
        if pos < 0 or pos + len(self) > mv.nbytes:
            raise ValueError(f"write_into: {len(self)} bytes do not fit at position {pos} of a "
                             f"{mv.nbytes}-byte buffer")
        mv[pos:pos + len(self)] = self
        return len(self)

    def tobytes(self) -> bytes:
        return bytes(self)

    def __repr__(self) -> str:
        return f"SealedBody(encoded={len(self)})"
