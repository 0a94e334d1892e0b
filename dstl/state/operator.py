"""Operator (non-keyed) list state and its redistribution on rescale, as Flink's FLIP-8 (docs/rescaling.md §5).

A subtask's operator state is snapshotted in full at every checkpoint: every registered
`OperatorListState` becomes a list of units (partitions) written one after the other into a single
msgpack stream, and the `OperatorStateHandle` records, per state name, the offset of each unit and
the state's distribution mode. `repartition` deals these units out to a new parallelism without
reading the streams: only offsets move, and slices of one stream that land on one new subtask are
merged into one handle.
"""
from __future__ import annotations

import uuid
from typing import Any, Dict, Iterable, Iterator, List, NamedTuple, Optional, Sequence, Tuple

import msgpack

SPLIT_DISTRIBUTE = "split_distribute"
UNION = "union"
BROADCAST = "broadcast"
MODES = (SPLIT_DISTRIBUTE, UNION, BROADCAST)
_FORMAT_VERSION = 1

__all__ = [
    "SPLIT_DISTRIBUTE", "UNION", "BROADCAST", "StateMetaInfo", "OperatorListState", "OperatorStateHandle",
    "snapshot_operator_state", "repartition", "restore_operator_state",
]


def _mode(mode: Any) -> str:
    """Accept 'split_distribute' / 'SPLIT_DISTRIBUTE' (Flink's enum spelling) and the like."""
    if isinstance(mode, str) and mode.lower() in MODES:
        return mode.lower()
    raise ValueError(f"unknown operator state mode {mode!r}; expected one of {', '.join(MODES)}")


def _pack(value: Any) -> bytes:
    try:
        return msgpack.packb(value, use_bin_type=True)
    except (TypeError, ValueError, OverflowError) as exc:
        raise TypeError(f"operator state values must be msgpack-serialisable: {exc}") from None


class OperatorListState:
    """A named list of units; on rescale the units are split (round robin), unioned or broadcast."""

    __slots__ = ("name", "mode", "_items")

    def __init__(self, name: str, mode: str = SPLIT_DISTRIBUTE, values: Optional[Iterable[Any]] = None):
        if not isinstance(name, str) or not name:
            raise ValueError(f"state name must be a non-empty string, got {name!r}")
        self.name = name
        self.mode = _mode(mode)
        self._items: List[Any] = []
        if values is not None:
            self.add_all(values)

    def add(self, value: Any) -> None:
        """Append one unit (checked to be msgpack-serialisable now, not at snapshot time)."""
        _pack(value)
        self._items.append(value)

    def add_all(self, values: Iterable[Any]) -> None:
        values = list(values)
        for v in values:
            _pack(v)
        self._items.extend(values)

    def get(self) -> List[Any]:
        """A copy of the units."""
        return list(self._items)

    def update(self, values: Iterable[Any]) -> None:
        """Replace all units."""
        values = list(values)
        for v in values:
            _pack(v)
        self._items = values

    def clear(self) -> None:
        self._items = []

    def __len__(self) -> int:
        return len(self._items)

    def __iter__(self) -> Iterator[Any]:
        return iter(list(self._items))

    def __repr__(self) -> str:
        return f"OperatorListState({self.name!r}, mode={self.mode!r}, units={len(self._items)})"


class StateMetaInfo(NamedTuple):
    """Where one state's units sit in a stream, and how they are redistributed."""

    offsets: Tuple[int, ...]
    mode: str


class OperatorStateHandle:
    """One msgpack stream plus `state name -> StateMetaInfo(offsets, mode)` (Flink's OperatorStreamStateHandle).

    `stream_id` identifies the stream: handles produced by `repartition` from one snapshot share its
    id and its bytes, with different offsets.
    """

    __slots__ = ("_states", "_data", "_stream_id")

    def __init__(self, states: Dict[str, Any], data: bytes, stream_id: Optional[str] = None):
        if not isinstance(data, (bytes, bytearray, memoryview)):
            raise TypeError(f"operator state stream must be bytes, got {type(data).__name__}")
        data = bytes(data)
        checked: Dict[str, StateMetaInfo] = {}
        for name, info in states.items():
            if not isinstance(name, str) or not name:
                raise ValueError(f"state name must be a non-empty string, got {name!r}")
            offsets, mode = info
            offsets = tuple(int(o) for o in offsets)
            for o in offsets:
                if not 0 <= o < len(data):
                    raise ValueError(f"state {name!r}: offset {o} is outside the stream of {len(data)} bytes")
            checked[name] = StateMetaInfo(offsets, _mode(mode))
        self._states = checked
        self._data = data
        if stream_id is not None and (not isinstance(stream_id, str) or not stream_id):
            raise ValueError(f"stream_id must be a non-empty string, got {stream_id!r}")
        self._stream_id = stream_id if stream_id is not None else uuid.uuid4().hex

    @property
    def states(self) -> Dict[str, StateMetaInfo]:
        """`state name -> StateMetaInfo(offsets, mode)` (a copy)."""
        return dict(self._states)

    get_state_name_to_partition_offsets = states.fget  # Flink spelling

    @property
    def data(self) -> bytes:
        return self._data

    @property
    def stream_id(self) -> str:
        return self._stream_id

    @property
    def state_size(self) -> int:
        return len(self._data)

    def read_units(self) -> Dict[str, List[Any]]:
        """Every state's units in offset order, decoded from the stream."""
        at = _decode_stream(self._data, self._stream_id)
        out: Dict[str, List[Any]] = {}
        for name, info in self._states.items():
            try:
                out[name] = [at[o] for o in info.offsets]
            except KeyError as exc:
                raise ValueError(f"operator state stream {self._stream_id}: state {name!r} has offset "
                                 f"{exc.args[0]}, which is not the start of a unit") from None
        return out

    def to_dict(self) -> Dict[str, Any]:
        return {"v": _FORMAT_VERSION, "type": "operator-state", "id": self._stream_id,
                "states": {n: [i.mode, list(i.offsets)] for n, i in self._states.items()},
                "data": self._data}

    @classmethod
    def from_dict(cls, d: Dict[str, Any]) -> "OperatorStateHandle":
        if not isinstance(d, dict) or d.get("type") != "operator-state":
            raise ValueError("operator state handle: not an operator-state record")
        if d.get("v") != _FORMAT_VERSION:
            raise ValueError(f"operator state handle: unsupported version {d.get('v')!r}")
        try:
            states = {n: (offs, mode) for n, (mode, offs) in d["states"].items()}
            return cls(states, d["data"], d["id"])
        except (KeyError, TypeError, ValueError) as exc:
            raise ValueError(f"operator state handle: malformed serialized form ({exc})") from exc

    def to_bytes(self) -> bytes:
        return msgpack.packb(self.to_dict(), use_bin_type=True)

    @classmethod
    def from_bytes(cls, data: bytes) -> "OperatorStateHandle":
        try:
            d = msgpack.unpackb(data, raw=False, strict_map_key=False)
        except Exception as exc:
            raise ValueError(f"operator state handle: not valid msgpack ({exc})") from exc
        return cls.from_dict(d)

    def __eq__(self, other) -> bool:
        if isinstance(other, OperatorStateHandle):
            return (self._stream_id == other._stream_id and self._states == other._states
                    and self._data == other._data)
        return NotImplemented

    def __hash__(self) -> int:
        return hash((self._stream_id, tuple(sorted(self._states.items()))))

    def __reduce__(self):
        return (OperatorStateHandle.from_bytes, (self.to_bytes(),))

    def __repr__(self) -> str:
        shown = ", ".join(f"{n}: {i.mode} x{len(i.offsets)}" for n, i in self._states.items())
        return f"OperatorStateHandle(stream={self._stream_id[:8]}, {{{shown}}}, {len(self._data)} bytes)"


def _decode_stream(data: bytes, stream_id: str) -> Dict[int, Any]:
    """offset -> unit, for every unit in the stream."""
    unpacker = msgpack.Unpacker(raw=False, strict_map_key=False, max_buffer_size=max(len(data), 1 << 20))
    unpacker.feed(data)
    out: Dict[int, Any] = {}
    pos = 0
    try:
        for value in unpacker:
            out[pos] = value
            pos = unpacker.tell()
    except Exception as exc:
        raise ValueError(f"operator state stream {stream_id}: corrupt at byte {pos} ({exc})") from None
    if pos != len(data):
        raise ValueError(f"operator state stream {stream_id}: truncated unit at byte {pos} of {len(data)}")
    return out


def snapshot_operator_state(states: Sequence[OperatorListState]) -> OperatorStateHandle:
    """All units of all states in one stream, with each state's offsets and mode."""
    out = bytearray()
    meta: Dict[str, Tuple[List[int], str]] = {}
    for state in states:
        if not isinstance(state, OperatorListState):
            raise TypeError(f"expected OperatorListState, got {type(state).__name__}")
        if state.name in meta:
            raise ValueError(f"two operator states are named {state.name!r}")
        offsets = []
        for value in state._items:
            offsets.append(len(out))
            out += _pack(value)
        meta[state.name] = (offsets, state.mode)
    return OperatorStateHandle(meta, bytes(out))


def restore_operator_state(handles: Iterable[OperatorStateHandle]) -> Dict[str, OperatorListState]:
    """Rebuild the states a subtask was assigned: units of each name concatenated in handle order.

    A `broadcast` state is the same list everywhere, so only its first entry is used.
    """
    result: Dict[str, OperatorListState] = {}
    seen_broadcast = set()
    seen_units = set()  # (stream, state, offset): a unit listed by two handles is restored once
    for handle in handles:
        if not isinstance(handle, OperatorStateHandle):
            raise TypeError(f"expected OperatorStateHandle, got {type(handle).__name__}")
        units = handle.read_units()
        for name, info in handle._states.items():
            state = result.get(name)
            if state is None:
                state = result[name] = OperatorListState(name, info.mode)
            elif state.mode != info.mode:
                raise ValueError(f"operator state {name!r} is {state.mode} in one handle and {info.mode} in another")
            if info.mode == BROADCAST:
                if name in seen_broadcast:
                    continue
                seen_broadcast.add(name)
            for offset, value in zip(info.offsets, units[name]):
                key = (handle.stream_id, name, offset)
                if key not in seen_units:
                    seen_units.add(key)
                    state._items.append(value)
    return result


# ------------------------------------------------------------------------------ repartitioning

_Entry = Tuple[OperatorStateHandle, StateMetaInfo]  # (source handle = its stream, meta info)


class _MergeMap:
    """Per new subtask: one output handle per source stream, in first-use order."""

    def __init__(self) -> None:
        self.by_stream: Dict[str, Tuple[OperatorStateHandle, Dict[str, StateMetaInfo]]] = {}

    def put(self, source: OperatorStateHandle, name: str, info: StateMetaInfo) -> None:
        slot = self.by_stream.get(source.stream_id)
        if slot is None:
            slot = self.by_stream[source.stream_id] = (source, {})
        have = slot[1].get(name)
        if have is not None:  # two slices of one stream for one state: keep both (each unit once)
            known = set(have.offsets)
            info = StateMetaInfo(have.offsets + tuple(o for o in info.offsets if o not in known), info.mode)
        slot[1][name] = info

    def handles(self, stream_rank: Dict[str, int]) -> List[OperatorStateHandle]:
        """The merged handles in the order their streams first appear among the old subtasks."""
        slots = sorted(self.by_stream.values(), key=lambda slot: stream_rank[slot[0].stream_id])
        return [OperatorStateHandle(states, src.data, src.stream_id) for src, states in slots]


def _group_by_mode(old: Sequence[Sequence[OperatorStateHandle]]) -> Dict[str, Dict[str, List[Tuple[int, _Entry]]]]:
    """mode -> state name -> [(old subtask, (handle, info))], old subtasks then handles in order.

    A unit is identified by (stream, offset). Fresh snapshots never repeat one, but handles that were
    themselves produced by `repartition` can (union states, re-listed slices); split and union units
    are kept once each, so a second rescale neither duplicates nor drops any.
    """
    groups: Dict[str, Dict[str, List[Tuple[int, _Entry]]]] = {m: {} for m in MODES}
    seen: Dict[str, set] = {}
    for subtask, handles in enumerate(old):
        for handle in handles:
            if not isinstance(handle, OperatorStateHandle):
                raise TypeError(f"old subtask {subtask}: expected OperatorStateHandle, got {type(handle).__name__}")
            for name, info in handle._states.items():
                for mode, names in groups.items():
                    if mode != info.mode and name in names:
                        raise ValueError(f"operator state {name!r} has modes {mode} and {info.mode}")
                if info.mode != BROADCAST and info.offsets:
                    units = seen.setdefault(name, set())
                    fresh = tuple(o for o in info.offsets if (handle.stream_id, o) not in units)
                    if not fresh:
                        continue
                    units.update((handle.stream_id, o) for o in fresh)
                    info = StateMetaInfo(fresh, info.mode)
                groups[info.mode].setdefault(name, []).append((subtask, (handle, info)))
    return groups


def _split(states: Dict[str, List[Tuple[int, _Entry]]], n: int, merge: List[_MergeMap]) -> None:
    start = 0
    for name in sorted(states):  # Flink iterates a HashMap here; dstl fixes the order (RESCALING §5)
        entries = [e for _, e in states[name]]
        total = sum(len(info.offsets) for _, info in entries)
        base, rem = divmod(total, n)
        next_start = start
        entry_idx, offset_idx = 0, 0
        for k in range(n):
            op = (k + start) % n
            take = base
            if rem > 0:
                take += 1
                rem -= 1
            elif rem == 0:  # first subtask without an extra unit: the next state starts here
                next_start = op
                rem = -1
            while take > 0:
                handle, info = entries[entry_idx]
                remaining = len(info.offsets) - offset_idx
                if remaining > take:
                    part = info.offsets[offset_idx:offset_idx + take]
                    offset_idx += take
                else:  # the rest of this entry (possibly nothing, as Flink does for empty entries)
                    part = info.offsets[offset_idx:]
                    offset_idx = 0
                    entry_idx += 1
                take -= remaining
                merge[op].put(handle, name, StateMetaInfo(tuple(part), SPLIT_DISTRIBUTE))
        start = next_start


def _union(states: Dict[str, List[Tuple[int, _Entry]]], merge: List[_MergeMap]) -> None:
    for name, entries in states.items():
        for m in merge:
            for _, (handle, info) in entries:
                m.put(handle, name, info)


def _broadcast(states: Dict[str, List[Tuple[int, _Entry]]], merge: List[_MergeMap]) -> None:
    for name, entries in states.items():
        for i, m in enumerate(merge):
            handle, info = entries[i % len(entries)][1]
            m.put(handle, name, info)


def repartition(old_states_per_subtask: Sequence[Sequence[OperatorStateHandle]],
                new_parallelism: int) -> List[List[OperatorStateHandle]]:
    """Assign the old subtasks' operator state to `new_parallelism` subtasks (docs/rescaling.md §5).

    `split_distribute` units are dealt round robin with a rotating start, `union` states go whole to
    every subtask, `broadcast` states give subtask i entry i % (number of entries). With the
    parallelism unchanged, subtasks keep their own split units.
    """
    if isinstance(new_parallelism, bool) or not isinstance(new_parallelism, int) or new_parallelism < 1:
        raise ValueError(f"new_parallelism must be an int >= 1, got {new_parallelism!r}")
    old = [list(handles) for handles in old_states_per_subtask]
    if not old:
        raise ValueError("old_states_per_subtask must list at least one old subtask")
    groups = _group_by_mode(old)
    n = new_parallelism
    if n == len(old):
        fully_reported = {name for name, entries in groups[BROADCAST].items()
                          if len({subtask for subtask, _ in entries}) == n}
        if not groups[UNION] and len(fully_reported) == len(groups[BROADCAST]):
            return [list(handles) for handles in old]
        merge = [_MergeMap() for _ in range(n)]
        for i, handles in enumerate(old):
            for handle in handles:
                for name, info in handle._states.items():
                    if info.mode == SPLIT_DISTRIBUTE or (info.mode == BROADCAST and name in fully_reported):
                        merge[i].put(handle, name, info)
        _union(groups[UNION], merge)
        _broadcast({k: v for k, v in groups[BROADCAST].items() if k not in fully_reported}, merge)
    else:
        merge = [_MergeMap() for _ in range(n)]
        _split(groups[SPLIT_DISTRIBUTE], n, merge)
        _union(groups[UNION], merge)
        _broadcast(groups[BROADCAST], merge)
    # restore concatenates units in handle order: keep that the old subtasks' order
    stream_rank: Dict[str, int] = {}
    for handles in old:
        for handle in handles:
            stream_rank.setdefault(handle.stream_id, len(stream_rank))
    return [m.handles(stream_rank) for m in merge]
