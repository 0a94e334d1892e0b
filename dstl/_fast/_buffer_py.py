"""Pure-Python twin of `dstl._fast._buffer`: the change buffer that seals change-set bodies.

A change set body (docs/format.md §4) is written in canonical order: the metadata group (-1) first, then
one group per key group ascending, changes of a group in append order. The Cython module produces
byte-identical output; the argument checks (`coerce_many` for `append_many`) are shared by both, in
dstl/_fast/_buffer_common.py.
"""
from __future__ import annotations

import struct
from array import array
from typing import List

import numpy as np

from dstl._fast._buffer_common import INT32_MAX, byte_view, check_key_group, coerce_many, writable_view
from dstl._fast._sealed_py import SealedBody

_BE_I32 = struct.Struct(">i")
_BE_2I32 = struct.Struct(">ii")


class ChangeBuffer:
    """Accumulates changes and seals them into one canonical change-set body (docs/format.md §4)."""

    __slots__ = ("_arena", "_kgs", "_offs", "_lens", "_counts", "_size")

    def __init__(self) -> None:
        self._arena = bytearray()
        self._kgs = array("i")
        self._offs = array("q")
        self._lens = array("q")
        self._counts: dict = {}
        self._size = 0

    def append(self, key_group: int, data) -> None:
        """Add one change; `key_group` -1 is metadata."""
        kg = check_key_group(key_group)
        view = byte_view(data)
        n = view.nbytes
        if n > INT32_MAX:
            raise ValueError(f"change data of {n} bytes exceeds the int32 length field")
        self._offs.append(len(self._arena))
        self._lens.append(n)
        self._kgs.append(kg)
        self._arena += view
        self._counts[kg] = self._counts.get(kg, 0) + 1
        self._size += n

    def append_many(self, key_groups, data, offsets) -> None:
        """Add n changes given in Arrow's binary layout; all-or-nothing."""
        kgs, view, offs = coerce_many(key_groups, data, offsets)
        n = kgs.shape[0]
        if n == 0:
            return
        first, last = int(offs[0]), int(offs[-1])
        base = len(self._arena)
        self._arena += view[first:last]
        self._kgs.frombytes(kgs.tobytes())
        self._offs.frombytes((offs[:-1] + (base - first)).tobytes())
        self._lens.frombytes(np.diff(offs).tobytes())
        for kg, count in zip(*np.unique(kgs, return_counts=True)):
            self._counts[int(kg)] = self._counts.get(int(kg), 0) + int(count)
        self._size += last - first

    def __len__(self) -> int:
        return len(self._kgs)

    @property
    def size(self) -> int:
        """Payload bytes held (docs/format.md §2 size)."""
        return self._size

    @property
    def encoded_size(self) -> int:
        """Length of the body `seal()` would return: 4 + 8·G + 4·C + size."""
        return 4 + 8 * len(self._counts) + 4 * len(self._kgs) + self._size

    def key_groups(self) -> List[int]:
        """Distinct key groups held, in canonical (group) order."""
        return sorted(self._counts)

    def _encode_into(self, out, pos: int) -> int:
        kgs = np.frombuffer(self._kgs, dtype=np.intc) if len(self._kgs) else np.zeros(0, np.intc)
        order = np.argsort(kgs, kind="stable").tolist()  # a stable sort keeps append order in a group
        arena, offs, lens, counts, kg_list = self._arena, self._offs, self._lens, self._counts, self._kgs
        _BE_I32.pack_into(out, pos, len(counts))
        p = pos + 4
        prev = None
        for i in order:
            kg = kg_list[i]
            if kg != prev:
                _BE_2I32.pack_into(out, p, counts[kg], kg)
                p += 8
                prev = kg
            n = lens[i]
            _BE_I32.pack_into(out, p, n)
            p += 4
            start = offs[i]
            out[p:p + n] = arena[start:start + n]
            p += n
        return p - pos

    def seal(self) -> bytes:
        """The canonical change-set body; the buffer is empty afterwards."""
        out = bytearray(self.encoded_size)
        self._encode_into(out, 0)
        self.clear()
        return bytes(out)

    def seal_body(self) -> "SealedBody":
        """The canonical body as a `SealedBody` (here simply the sealed bytes); the buffer is empty afterwards."""
        return SealedBody(self.seal())

    def seal_into(self, out, pos: int = 0) -> int:
        """Write the body into the writable buffer `out` at `pos`; returns its length and empties the buffer."""
        mv = writable_view(out)
        pos = pos.__index__()
        need = self.encoded_size
        if pos < 0 or pos + need > mv.nbytes:
            raise ValueError(f"seal_into: {need} bytes do not fit at position {pos} of a {mv.nbytes}-byte buffer")
        length = self._encode_into(mv, pos)
        self.clear()
        return length

    def clear(self) -> None:
        """Drop every change held."""
        self._arena = bytearray()
        self._kgs = array("i")
        self._offs = array("q")
        self._lens = array("q")
        self._counts = {}
        self._size = 0

    def __repr__(self) -> str:
        return f"ChangeBuffer(changes={len(self)}, size={self._size}, python)"
