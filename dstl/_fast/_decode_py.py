"""Pure-Python twin of `dstl._fast._decode`: decodes change sets of a logical stream (docs/format.md §4, §8).

Every field is bounds-checked before it is read; malformed input raises only CorruptChangelogError
naming the logical offset where the offending field starts.
"""
from __future__ import annotations

import gc
import struct
from typing import Iterator, List, NamedTuple, Tuple

import numpy as np

from dstl.errors import CorruptChangelogError
from dstl._fast._change_py import StateChange, make_change

MAX_KEY_GROUP = 32767
_I32 = struct.Struct(">i")
_2I32 = struct.Struct(">ii")

class ChangeSetInfo(NamedTuple):
    """One change set found by `walk` (all sizes in logical-stream bytes, `size` = payload)."""

    offset: int
    encoded_size: int
    num_groups: int
    num_changes: int
    size: int
    group_order: Tuple[int, ...]


def logical_view(logical) -> memoryview:
    """A flat byte view of the logical stream."""
    try:
        mv = memoryview(logical)
    except TypeError:
        raise TypeError(f"the logical stream must be bytes-like, got {type(logical).__name__}") from None
    if not mv.c_contiguous:
        raise TypeError("the logical stream must be a contiguous buffer")
    if mv.format != "B" or mv.ndim != 1:
        mv = mv.cast("B") if mv.ndim <= 1 else mv.cast("B", (mv.nbytes,))
    return mv


def range_bounds(key_group_range) -> Tuple[int, int]:
    """(start, end) of a KeyGroupRange or a (start, end) pair; None keeps every key group."""
    if key_group_range is None:
        return 0, MAX_KEY_GROUP
    if hasattr(key_group_range, "start") and hasattr(key_group_range, "end"):
        return int(key_group_range.start), int(key_group_range.end)
    start, end = key_group_range
    return int(start), int(end)


def check_offset(offset, end: int) -> int:
    if isinstance(offset, bool) or not hasattr(offset, "__index__"):
        raise TypeError(f"offset must be an int, got {type(offset).__name__}")
    offset = offset.__index__()
    if offset < 0 or offset > end:
        raise CorruptChangelogError(f"offset {offset} is outside the logical stream of {end} bytes", offset)
    return offset


def _scan(mv: memoryview, pos: int, lo: int, hi: int, sink) -> Tuple[int, int, int, int, list]:
    """Walk the change set at `pos`; call sink(kg, start, length) for kept changes.

    Returns (end, num_groups, num_changes, payload_size, group_order)."""
    end = len(mv)
    if end - pos < 4:
        raise CorruptChangelogError(f"truncated: group count needs 4 bytes, {end - pos} remain", pos)
    (groups,) = _I32.unpack_from(mv, pos)
    if groups < 0:
        raise CorruptChangelogError(f"negative group count {groups}", pos)
    if groups > (end - pos - 4) // 8:
        raise CorruptChangelogError(
            f"group count {groups} needs at least {8 * groups} bytes, {end - pos - 4} remain", pos)
    p = pos + 4
    num_changes = 0
    size = 0
    order = []
    for _ in range(groups):
        if end - p < 8:
            raise CorruptChangelogError(f"truncated: group header needs 8 bytes, {end - p} remain", p)
        count, kg = _2I32.unpack_from(mv, p)
        if count < 0:
            raise CorruptChangelogError(f"negative change count {count}", p)
        if kg < -1 or kg > MAX_KEY_GROUP:
            raise CorruptChangelogError(f"invalid key group {kg}", p + 4)
        if count > (end - p - 8) // 4:
            raise CorruptChangelogError(
                f"change count {count} needs at least {4 * count} bytes, {end - p - 8} remain", p)
        order.append(kg)
        keep = kg == -1 or lo <= kg <= hi
        p += 8
        for _ in range(count):
            if end - p < 4:
                raise CorruptChangelogError(f"truncated: change length needs 4 bytes, {end - p} remain", p)
            (n,) = _I32.unpack_from(mv, p)
            if n < 0:
                raise CorruptChangelogError(f"negative change length {n}", p)
            if n > end - p - 4:
                raise CorruptChangelogError(f"change length {n} runs past the end ({end - p - 4} bytes remain)", p)
            if keep:
                sink(kg, p + 4, n)
            p += 4 + n
            size += n
        num_changes += count
    return p, groups, num_changes, size, order


def decode_change_set(logical, offset: int = 0, key_group_range=None) -> Tuple[List[StateChange], int]:
    """The changes of the change set at `offset` (stream order) and the offset just after it."""
    mv = logical_view(logical)
    pos = check_offset(offset, len(mv))
    lo, hi = range_bounds(key_group_range)
    out: List[StateChange] = []
    append = out.append
    gc_was_enabled = gc.isenabled()
    gc.disable()  # the cyclic GC would otherwise rescan the growing list every few hundred objects
    try:
        end, _, _, _, _ = _scan(mv, pos, lo, hi, lambda kg, s, n: append(make_change(kg, bytes(mv[s:s + n]))))
    finally:
        if gc_was_enabled:
            gc.enable()
    return out, end


class ChangeIterator:
    """Twin of the Cython `ChangeIterator`: the changes of one change set (decoded up front here)."""

    __slots__ = ("_changes", "_it", "end")

    def __init__(self, changes: List[StateChange], end: int):
        self._changes = changes
        self._it = iter(changes)
        self.end = end

    @property
    def count(self) -> int:
        return len(self._changes)

    def __iter__(self):
        return self._it

    def __next__(self) -> StateChange:
        return next(self._it)

    def __len__(self) -> int:
        return self._it.__length_hint__()

    def close(self) -> None:
        """The iterator is exhausted afterwards (also where `iter()` already handed it out)."""
        self._changes = []
        for _ in self._it:
            pass


def iter_change_set(logical, offset: int = 0, key_group_range=None) -> ChangeIterator:
    """An iterator of the changes of the change set at `offset` (stream order; `.end` is the offset
    just after it). Malformed input raises here, before the first change."""
    changes, end = decode_change_set(logical, offset, key_group_range)
    return ChangeIterator(changes, end)


def chain_changes(entries) -> Iterator[StateChange]:
    """The changes of every `ChangeIterator` that `entries` yields, in order (one iterator); each
    exhausted one is closed before the next is asked for."""
    return _chain(iter(entries))


def _chain(entries) -> Iterator[StateChange]:
    for item in entries:
        if type(item) is not ChangeIterator:
            raise TypeError(f"chain_changes: expected a ChangeIterator, got {type(item).__name__}")
        yield from item
        item.close()


def decode_change_set_arrays(logical, offset: int = 0, key_group_range=None):
    """(key_groups int32, offsets int64, lengths int64, end_offset); offsets index into `logical`."""
    mv = logical_view(logical)
    pos = check_offset(offset, len(mv))
    lo, hi = range_bounds(key_group_range)
    kgs: list = []
    starts: list = []
    lens: list = []

    def sink(kg, s, n):
        kgs.append(kg)
        starts.append(s)
        lens.append(n)

    end, _, _, _, _ = _scan(mv, pos, lo, hi, sink)
    return (np.array(kgs, dtype=np.int32), np.array(starts, dtype=np.int64),
            np.array(lens, dtype=np.int64), end)


def walk(logical) -> List[ChangeSetInfo]:
    """Every change set of a whole logical stream; the last must end exactly at its end (docs/format.md §5.8)."""
    mv = logical_view(logical)
    infos: List[ChangeSetInfo] = []
    pos, end = 0, len(mv)
    ignore = lambda kg, s, n: None  # noqa: E731
    while pos < end:
        nxt, groups, changes, size, order = _scan(mv, pos, 0, -1, ignore)
        infos.append(ChangeSetInfo(pos, nxt - pos, groups, changes, size, tuple(order)))
        pos = nxt
    return infos
