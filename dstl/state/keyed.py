"""Keyed state on the changelog: ValueState, ListState, MapState, ReducingState.

Every mutation does two things: it changes an in-memory table (key group -> state name -> key ->
value, so one key group can be snapshotted or dropped on its own) and it appends exactly one change
(`dstl.state.changes`: op byte + msgpack body) to the writer's key group. Registering a state appends
a METADATA change. Bulk methods (`update_many`, `add_many`, `put_many`) encode a whole pandas/numpy/
Arrow batch without a Python loop per row and hand the writer ONE `append_many` per batch.

Checkpoints: `snapshot(cp)` persists the log from the sqn of the last materialization and returns a
Future of a `KeyedStateSnapshot` (materialized handles + the changelog handle since then); `confirm`
hands that range to the checkpoint and truncates what a confirmed materialization made obsolete;
`abort` resets. `restore` rebuilds a backend for any key-group range from the snapshots of all old
subtasks (any old parallelism, RESCALING.md §6).

Log segments are self-describing: each segment a checkpoint can reference (from sqn 0, from a
materialization, from a restore) starts with the METADATA changes of every state, because state ids
are per log. After a restore the old handles (intersected with the new range) are kept as the new
backend's base and included in every snapshot until the next materialization, as Flink does with
restored state (`materialize_on_restore=True` materializes at once instead).

A backend is not thread-safe: use it from one thread (the task thread), as in Flink.
"""
from __future__ import annotations

import logging
from concurrent.futures import Future
from typing import Any, Callable, Dict, Iterator, List, Optional, Sequence, Tuple

import msgpack
import numpy as np

from dstl.errors import CorruptChangelogError
from dstl.keygroups import assign_key_groups, assign_to_key_group
from dstl.state import changes as C
from dstl.state.columns import Column, as_column, dict_update_rows, encode_rows, pack_bin_rows
from dstl.state.serializers import get_serializer, resolve_serializer, unpackb
from dstl.types import KeyGroupRange

log = logging.getLogger(__name__)

__all__ = ["KeyedStateBackend", "KeyedStateSnapshot", "ValueState", "ListState", "MapState",
           "ReducingState"]

_MAX_PARALLELISM = 32768
_KEY_TYPES = (int, str, bytes)
_USER_KEY_TYPES = (int, str, bytes, float, bool, type(None))


# ---------------------------------------------------------------------------------- snapshot


class KeyedStateSnapshot:
    """What a checkpoint keeps of one backend: materialized handles + the changelog since then.

    `materialized` is replayed first, in order, then `changelog` (None if nothing was logged).
    """

    __slots__ = ("key_group_range", "materialized", "changelog", "max_parallelism", "checkpoint_id")
    _VERSION = 1

    def __init__(self, key_group_range: KeyGroupRange, materialized: Sequence[Any], changelog: Any = None,
                 max_parallelism: Optional[int] = None, checkpoint_id: Optional[int] = None):
        if not isinstance(key_group_range, KeyGroupRange):
            raise ValueError(f"key_group_range must be a KeyGroupRange, got {type(key_group_range).__name__}")
        self.key_group_range = key_group_range
        self.materialized = list(materialized)
        self.changelog = changelog
        self.max_parallelism = max_parallelism
        self.checkpoint_id = checkpoint_id

    def handles(self) -> List[Any]:
        """Every handle in replay order."""
        return self.materialized + ([self.changelog] if self.changelog is not None else [])

    def files(self) -> List[str]:
        """Distinct files this snapshot needs (for retention / gc)."""
        seen: Dict[str, None] = {}
        for h in self.handles():
            for f in h.files():
                seen.setdefault(f, None)
        return list(seen)

    def to_bytes(self) -> bytes:
        return msgpack.packb({
            "v": self._VERSION, "kgr": [self.key_group_range.start, self.key_group_range.end],
            "max_parallelism": self.max_parallelism, "checkpoint_id": self.checkpoint_id,
            "materialized": [h.to_bytes() for h in self.materialized],
            "changelog": self.changelog.to_bytes() if self.changelog is not None else None,
        }, use_bin_type=True)

    @classmethod
    def from_bytes(cls, data: bytes) -> "KeyedStateSnapshot":
        from dstl.handles import ChangelogStateHandleStreamImpl as H

        try:
            d = msgpack.unpackb(data, raw=False, strict_map_key=False)
        except Exception as exc:
            raise ValueError(f"keyed state snapshot: not valid msgpack ({exc})") from exc
        if not isinstance(d, dict) or d.get("v") != cls._VERSION:
            raise ValueError(f"keyed state snapshot: unsupported content {str(d)[:80]!r}")
        try:
            start, end = d["kgr"]
            return cls(KeyGroupRange(start, end), [H.from_bytes(b) for b in d["materialized"]],
                       H.from_bytes(d["changelog"]) if d["changelog"] is not None else None,
                       d.get("max_parallelism"), d.get("checkpoint_id"))
        except (KeyError, TypeError) as exc:
            raise ValueError(f"keyed state snapshot: malformed ({exc!r})") from exc

    def __eq__(self, other) -> bool:
        return isinstance(other, KeyedStateSnapshot) and self.to_bytes() == other.to_bytes()

    def __repr__(self) -> str:
        return (f"KeyedStateSnapshot({self.key_group_range}, materialized={len(self.materialized)}, "
                f"changelog={'yes' if self.changelog is not None else 'no'}, "
                f"checkpoint_id={self.checkpoint_id})")


class _Pending:
    __slots__ = ("mat", "start", "end")

    def __init__(self, mat, start, end):
        self.mat, self.start, self.end = mat, start, end


# ---------------------------------------------------------------------------------- states


class _State:
    """Common part of the state kinds: identity, serializer, table access, bulk encoding."""

    kind = ""

    def __init__(self, backend: "KeyedStateBackend", meta: C.StateMeta, serializer: Any):
        self._b = backend
        self.meta = meta
        self.name = meta.name
        self._sid = meta.state_id
        self.serializer = serializer
        self._native = bool(getattr(serializer, "native", False))
        # replay may store SET/SET_INTERNAL bodies directly (see KeyedStateBackend._replay_handle)
        self._fast_ops = frozenset() if not self._native else {
            "value": frozenset((C.SET,)), "reducing": frozenset((C.SET, C.SET_INTERNAL))}.get(self.kind, frozenset())

    # value <-> what goes into a change body
    def _w(self, v: Any) -> Any:
        return v if self._native else self.serializer.dumps(v)

    def _u(self, w: Any) -> Any:
        return w if self._native else self.serializer.loads(w)

    def _convert(self) -> Optional[Callable[[Any], Any]]:
        return None if self._native else self.serializer.dumps

    # table access
    def _table(self, kg: int) -> dict:
        t = self._b._table.get(kg)
        if t is None:
            t = self._b._table[kg] = {}
        s = t.get(self.name)
        if s is None:
            s = t[self.name] = {}
        return s

    def _lookup(self, kg: int) -> Optional[dict]:
        t = self._b._table.get(kg)
        return None if t is None else t.get(self.name)

    def _forget(self, kg: int, key: Any) -> None:
        """Drop `key`'s entry in key group `kg` (live clear and replay of CLEAR); absent is fine."""
        s = self._lookup(kg)
        if s is not None:
            s.pop(key, None)

    def _append(self, kg: int, op: int, fields: List[Any]) -> None:
        try:
            payload = C.encode(op, [self._sid] + fields)
        except (TypeError, ValueError, OverflowError) as exc:
            raise type(exc)(f"state {self.name!r}, key {fields[0]!r:.80}: cannot serialize the change: "
                            f"{exc}") from exc
        self._b._append(kg, payload)

    # state-wide views
    def all_items(self) -> Iterator[Tuple[Any, Any]]:
        """(key, value) of every key with state, in key-group order (values are copies for list/map)."""
        for kg in sorted(self._b._table):
            s = self._b._table[kg].get(self.name)
            if s:
                for k, v in list(s.items()):
                    yield k, self._copy(v)

    def _copy(self, v: Any) -> Any:
        return v

    def keys_with_state(self) -> List[Any]:
        return [k for k, _ in self.all_items()]

    def __len__(self) -> int:
        return sum(len(t.get(self.name, ())) for t in self._b._table.values())

    def contains_key(self, key: Any) -> bool:
        s = self._lookup(self._b._kg(key))
        return s is not None and key in s

    def clear(self, key: Any) -> None:
        """Remove the key's state (one CLEAR change, even if there was none, as Flink logs it)."""
        kg = self._b._kg(key)
        self._append(kg, C.CLEAR, [key])
        self._forget(kg, key)
        self._b._mutated()

    # bulk helpers
    def _bulk_keys(self, keys: Any, n_expected: Optional[int] = None) -> Tuple[Column, np.ndarray]:
        col = as_column(keys)
        if n_expected is not None and col.n != n_expected:
            raise ValueError(f"keys and values differ in length: {col.n} keys, {n_expected} values")
        if col.kind in ("float", "bool"):
            raise TypeError(f"state keys must be int, str or bytes; got a {col.kind} column")
        kgs = np.asarray(assign_key_groups(col.for_hash, self._b.max_parallelism))
        self._b._check_kgs(kgs, col)
        return col, kgs

    def _bulk_append(self, op: int, kgs: np.ndarray, key_col: Column, value_specs: List[tuple],
                     num_fields: int) -> None:
        data, offsets = encode_rows(C.row_prefix(op, num_fields, self._sid), key_col.specs() + value_specs,
                                    key_col.n)
        self._b._append_many(kgs, data, offsets)

    def _groups(self, kgs: np.ndarray) -> Tuple[np.ndarray, List[Tuple[int, int, int]]]:
        """Stable order by key group and the (kg, start, end) runs of it."""
        n = len(kgs)
        order = np.argsort(kgs.astype(np.int16), kind="stable")  # int16: numpy radix-sorts it
        skg = kgs[order]
        cuts = (np.flatnonzero(skg[1:] != skg[:-1]) + 1).tolist()
        starts = [0] + cuts
        ends = cuts + [n]
        return order, [(int(skg[s]), s, e) for s, e in zip(starts, ends)]

    def _tables_for(self, kgs: np.ndarray) -> List[Optional[dict]]:
        """Per slot of the backend's range: this state's table of that key group if `kgs` uses it."""
        start = self._b._kg_start
        used = np.bincount(np.asarray(kgs, dtype=np.int64) - start, minlength=len(self._b.key_group_range))
        tables: List[Optional[dict]] = [None] * len(used)
        for slot in np.flatnonzero(used).tolist():
            tables[slot] = self._table(start + slot)
        return tables

    def _lookup_many(self, keys: Any) -> List[Tuple[Optional[dict], Any]]:
        """(per-key table of the key's group or None, key) for a column of keys."""
        col = as_column(keys)
        if col.kind in ("float", "bool"):
            raise TypeError(f"state keys must be int, str or bytes; got a {col.kind} column")
        kgs = np.asarray(assign_key_groups(col.for_hash, self._b.max_parallelism))
        self._b._check_kgs(kgs, col)
        table, name = self._b._table, self.name
        out = []
        for kg, k in zip(kgs.tolist(), col.tolist()):
            t = table.get(kg)
            out.append((None if t is None else t.get(name), k))
        return out

    def __repr__(self) -> str:
        return f"{type(self).__name__}({self.name!r}, serializer={self.serializer.id!r})"


class ValueState(_State):
    """One value per key. `update(key, None)` clears, as in Flink."""

    kind = "value"

    def get(self, key: Any, default: Any = None) -> Any:
        s = self._lookup(self._b._kg(key))
        if s is None:
            return default
        return s.get(key, default)

    def update(self, key: Any, value: Any) -> None:
        if value is None:
            self.clear(key)
            return
        kg = self._b._kg(key)
        self._append(kg, C.SET, [key, self._w(value)])
        self._table(kg)[key] = value
        self._b._mutated()

    def items(self) -> Iterator[Tuple[Any, Any]]:
        """(key, value) of every key with a value."""
        return self.all_items()

    def get_many(self, keys: Any, default: Any = None) -> List[Any]:
        """Values of a column of keys (key groups computed vectorised)."""
        return [default if s is None else s.get(k, default) for s, k in self._lookup_many(keys)]

    def update_many(self, keys: Any, values: Any) -> None:
        """Set a whole batch: one change per row, ONE writer.append_many for the batch.

        `keys`/`values`: numpy arrays, pandas Series, pyarrow arrays or lists of equal length. Later
        rows win over earlier rows with the same key. None values clear their key.
        """
        vcol = as_column(values)
        kcol, kgs = self._bulk_keys(keys, vcol.n)
        n = kcol.n
        if n == 0:
            return
        vals = vcol.tolist() if vcol.kind == "object" else None
        if vals is not None and any(v is None for v in vals):
            # mixed SET/CLEAR rows: encode per row, still one append_many
            keys_l = kcol.tolist()
            rows = [C.encode(C.CLEAR, [self._sid, k]) if v is None else
                    C.encode(C.SET, [self._sid, k, self._w(v)]) for k, v in zip(keys_l, vals)]
            col = pack_bin_rows(rows)
            self._b._append_many(kgs, col.data, col.offsets)
            for k, v, kg in zip(keys_l, vals, kgs.tolist()):
                if v is None:
                    s = self._lookup(kg)
                    if s is not None:
                        s.pop(k, None)
                else:
                    self._table(kg)[k] = v
            self._b._mutated(n)
            return
        self._bulk_append(C.SET, kgs, kcol, vcol.specs(self._convert()), 3)
        dict_update_rows(self._tables_for(kgs), self._b._kg_start, kgs, _row_values(kcol), _row_values(vcol))
        self._b._mutated(n)

    def _apply(self, op: int, kg: int, body: list) -> None:
        if op == C.SET:
            self._table(kg)[body[1]] = self._u(body[2])
        elif op == C.CLEAR:
            self._forget(kg, body[1])
        else:
            raise CorruptChangelogError(f"{C.OP_NAMES[op]} is not a ValueState operation (state {self.name!r})", 0)

    def _snapshot_value(self, v: Any) -> Any:
        return self._w(v)

    def _restore_value(self, w: Any) -> Any:
        return self._u(w)


class ListState(_State):
    """A list per key. With `max_length` (recorded in the metadata) only the last N elements stay."""

    kind = "list"

    def __init__(self, backend, meta, serializer):
        super().__init__(backend, meta, serializer)
        self.max_length = meta.options.get("max_length")

    def _copy(self, v):
        return list(v)

    def _trim(self, lst: list) -> list:
        m = self.max_length
        if m is not None and len(lst) > m:
            del lst[:len(lst) - m]
        return lst

    def get(self, key: Any) -> list:
        """A copy of the key's list ([] if none)."""
        s = self._lookup(self._b._kg(key))
        if s is None:
            return []
        return list(s.get(key, ()))

    def get_many(self, keys: Any) -> List[list]:
        """Copies of the lists of a column of keys ([] where there is none)."""
        return [[] if s is None else list(s.get(k, ())) for s, k in self._lookup_many(keys)]

    def add(self, key: Any, value: Any) -> None:
        kg = self._b._kg(key)
        self._append(kg, C.ADD_ELEMENT, [key, self._w(value)])
        s = self._table(kg)
        lst = s.get(key)
        if lst is None:
            s[key] = [value]
        else:
            lst.append(value)
            self._trim(lst)
        self._b._mutated()

    def add_all(self, key: Any, values: Sequence[Any]) -> None:
        values = list(values)
        if not values:
            return
        kg = self._b._kg(key)
        self._append(kg, C.ADD, [key, [self._w(v) for v in values]])
        s = self._table(kg)
        s[key] = self._trim(s.get(key, []) + values)
        self._b._mutated()

    def update(self, key: Any, values: Optional[Sequence[Any]]) -> None:
        """Replace the list; None or empty clears (Flink semantics)."""
        values = list(values) if values is not None else []
        if not values:
            self.clear(key)
            return
        kg = self._b._kg(key)
        self._append(kg, C.SET, [key, [self._w(v) for v in values]])
        self._table(kg)[key] = self._trim(values)
        self._b._mutated()

    def add_many(self, keys: Any, values: Any) -> None:
        """Append one element per row (one ADD_ELEMENT change each, one append_many per batch)."""
        vcol = as_column(values)
        kcol, kgs = self._bulk_keys(keys, vcol.n)
        n = kcol.n
        if n == 0:
            return
        self._bulk_append(C.ADD_ELEMENT, kgs, kcol, vcol.specs(self._convert()), 3)
        order, runs = self._groups(kgs)
        keys_l = kcol.take(order)
        vals_l = vcol.take(order)
        for kg, s, e in runs:
            tbl = self._table(kg)
            touched = {}
            for k, v in zip(keys_l[s:e], vals_l[s:e]):
                lst = tbl.get(k)
                if lst is None:
                    tbl[k] = [v]
                else:
                    lst.append(v)
                touched[k] = None
            if self.max_length is not None:
                for k in touched:
                    self._trim(tbl[k])
        self._b._mutated(n)

    def _apply(self, op: int, kg: int, body: list) -> None:
        key = body[1]
        if op == C.ADD_ELEMENT:
            s = self._table(kg)
            lst = s.get(key)
            if lst is None:
                s[key] = [self._u(body[2])]
            else:
                lst.append(self._u(body[2]))
                self._trim(lst)
        elif op == C.ADD:
            s = self._table(kg)
            s[key] = self._trim(s.get(key, []) + [self._u(w) for w in body[2]])
        elif op == C.SET:
            self._table(kg)[key] = self._trim([self._u(w) for w in body[2]])
        elif op == C.CLEAR:
            self._forget(kg, key)
        else:
            raise CorruptChangelogError(f"{C.OP_NAMES[op]} is not a ListState operation (state {self.name!r})", 0)

    def _snapshot_value(self, v: list) -> Any:
        return [self._w(x) for x in v] if not self._native else v

    def _restore_value(self, w: Any) -> Any:
        return [self._u(x) for x in w] if not self._native else w


def _check_user_key(uk: Any) -> None:
    if not isinstance(uk, _USER_KEY_TYPES):
        raise TypeError(f"map user keys must be int, str, bytes, float, bool or None, got {type(uk).__name__}")


class MapState(_State):
    """A map per key: `put`, `get`, `remove`, `contains`, `items`, ... (user keys: msgpack scalars)."""

    kind = "map"

    def _copy(self, v):
        return dict(v)

    def _map(self, key: Any) -> Optional[dict]:
        s = self._lookup(self._b._kg(key))
        return None if s is None else s.get(key)

    def get(self, key: Any, user_key: Any, default: Any = None) -> Any:
        m = self._map(key)
        return default if m is None else m.get(user_key, default)

    def contains(self, key: Any, user_key: Any) -> bool:
        m = self._map(key)
        return m is not None and user_key in m

    def _pairs(self, keys: Any, user_keys: Any):
        uks = as_column(user_keys).tolist()
        found = self._lookup_many(keys)
        if len(uks) != len(found):
            raise ValueError(f"keys and user_keys differ in length: {len(found)} and {len(uks)}")
        for (s, k), uk in zip(found, uks):
            yield (None if s is None else s.get(k)), uk

    def get_many(self, keys: Any, user_keys: Any, default: Any = None) -> List[Any]:
        """`get(key, user_key, default)` for two columns."""
        return [default if m is None else m.get(uk, default) for m, uk in self._pairs(keys, user_keys)]

    def contains_many(self, keys: Any, user_keys: Any) -> np.ndarray:
        """`contains(key, user_key)` for two columns, as a bool array."""
        return np.fromiter((m is not None and uk in m for m, uk in self._pairs(keys, user_keys)), dtype=bool)

    def items(self, key: Any) -> List[Tuple[Any, Any]]:
        m = self._map(key)
        return [] if m is None else list(m.items())

    def keys(self, key: Any) -> List[Any]:
        m = self._map(key)
        return [] if m is None else list(m)

    def values(self, key: Any) -> List[Any]:
        m = self._map(key)
        return [] if m is None else list(m.values())

    def is_empty(self, key: Any) -> bool:
        return not self._map(key)

    def size(self, key: Any) -> int:
        m = self._map(key)
        return 0 if m is None else len(m)

    def put(self, key: Any, user_key: Any, value: Any) -> None:
        _check_user_key(user_key)
        kg = self._b._kg(key)
        self._append(kg, C.ADD_OR_UPDATE_ELEMENT, [key, user_key, self._w(value)])
        self._table(kg).setdefault(key, {})[user_key] = value
        self._b._mutated()

    def put_all(self, key: Any, mapping: Dict[Any, Any]) -> None:
        mapping = dict(mapping)
        if not mapping:
            return
        for uk in mapping:
            _check_user_key(uk)
        kg = self._b._kg(key)
        self._append(kg, C.ADD, [key, {uk: self._w(v) for uk, v in mapping.items()}])
        self._table(kg).setdefault(key, {}).update(mapping)
        self._b._mutated()

    def remove(self, key: Any, user_key: Any) -> None:
        """Remove one entry (one REMOVE_ELEMENT change); an empty map means no state for the key."""
        _check_user_key(user_key)
        kg = self._b._kg(key)
        self._append(kg, C.REMOVE_ELEMENT, [key, user_key])
        self._remove(kg, key, user_key)
        self._b._mutated()

    def _remove(self, kg: int, key: Any, user_key: Any) -> None:
        s = self._lookup(kg)
        m = None if s is None else s.get(key)
        if m is not None:
            m.pop(user_key, None)
            if not m:
                del s[key]

    def put_many(self, keys: Any, user_keys: Any, values: Any) -> None:
        """One ADD_OR_UPDATE_ELEMENT per row, ONE append_many per batch."""
        vcol = as_column(values)
        ucol = as_column(user_keys)
        if ucol.n != vcol.n:
            raise ValueError(f"user_keys and values differ in length: {ucol.n} and {vcol.n}")
        kcol, kgs = self._bulk_keys(keys, vcol.n)
        n = kcol.n
        if n == 0:
            return
        if ucol.kind == "object":
            for uk in ucol.tolist():
                _check_user_key(uk)
        self._bulk_append(C.ADD_OR_UPDATE_ELEMENT, kgs, kcol, ucol.specs() + vcol.specs(self._convert()), 4)
        order, runs = self._groups(kgs)
        keys_l = kcol.take(order)
        uks_l = ucol.take(order)
        vals_l = vcol.take(order)
        for kg, s, e in runs:
            tbl = self._table(kg)
            for k, uk, v in zip(keys_l[s:e], uks_l[s:e], vals_l[s:e]):
                m = tbl.get(k)
                if m is None:
                    tbl[k] = {uk: v}
                else:
                    m[uk] = v
        self._b._mutated(n)

    def _apply(self, op: int, kg: int, body: list) -> None:
        key = body[1]
        if op == C.ADD_OR_UPDATE_ELEMENT:
            self._table(kg).setdefault(key, {})[body[2]] = self._u(body[3])
        elif op == C.REMOVE_ELEMENT:
            self._remove(kg, key, body[2])
        elif op == C.ADD:
            self._table(kg).setdefault(key, {}).update({uk: self._u(w) for uk, w in body[2].items()})
        elif op == C.SET:
            self._table(kg)[key] = {uk: self._u(w) for uk, w in body[2].items()}
        elif op == C.CLEAR:
            self._forget(kg, key)
        else:
            raise CorruptChangelogError(f"{C.OP_NAMES[op]} is not a MapState operation (state {self.name!r})", 0)

    def _snapshot_value(self, v: dict) -> Any:
        return v if self._native else {uk: self._w(x) for uk, x in v.items()}

    def _restore_value(self, w: Any) -> Any:
        return w if self._native else {uk: self._u(x) for uk, x in w.items()}


class ReducingState(ValueState):
    """A value per key folded with `reduce_fn(old, new)`; logged as SET_INTERNAL of the result."""

    kind = "reducing"

    def __init__(self, backend, meta, serializer, reduce_fn: Optional[Callable[[Any, Any], Any]] = None):
        super().__init__(backend, meta, serializer)
        self.reduce_fn = reduce_fn

    def _fn(self) -> Callable[[Any, Any], Any]:
        if self.reduce_fn is None:
            raise RuntimeError(f"reducing state {self.name!r} was restored; register it again with "
                               f"reducing_state(name, reduce_fn) before adding to it")
        return self.reduce_fn

    def add(self, key: Any, value: Any) -> None:
        fn = self._fn()
        kg = self._b._kg(key)
        s = self._table(kg)
        new = fn(s[key], value) if key in s else value
        self._append(kg, C.SET_INTERNAL, [key, self._w(new)])
        s[key] = new
        self._b._mutated()

    def update(self, key: Any, value: Any) -> None:  # pragma: no cover - guard
        raise TypeError("ReducingState has add(), not update()")

    update_many = update

    def add_many(self, keys: Any, values: Any) -> None:
        """Fold a batch; logs one SET_INTERNAL per distinct key (its final value), one append_many."""
        fn = self._fn()
        vcol = as_column(values)
        kcol, kgs = self._bulk_keys(keys, vcol.n)
        if kcol.n == 0:
            return
        acc: Dict[Any, Any] = {}
        kg_of: Dict[Any, int] = {}
        for k, v, kg in zip(kcol.tolist(), vcol.tolist(), kgs.tolist()):
            if k in acc:
                acc[k] = fn(acc[k], v)
            else:
                s = self._lookup(kg)
                acc[k] = fn(s[k], v) if s is not None and k in s else v
                kg_of[k] = kg
        ukeys = list(acc)
        ukgs = np.fromiter((kg_of[k] for k in ukeys), dtype=np.int32, count=len(ukeys))
        kc = as_column(ukeys)
        vc = as_column([acc[k] for k in ukeys])
        self._bulk_append(C.SET_INTERNAL, ukgs, kc, vc.specs(self._convert()), 3)
        for k, kg in zip(ukeys, ukgs.tolist()):
            self._table(kg)[k] = acc[k]
        self._b._mutated(len(ukeys))

    def _apply(self, op: int, kg: int, body: list) -> None:
        if op in (C.SET_INTERNAL, C.SET):
            self._table(kg)[body[1]] = self._u(body[2])
        elif op == C.CLEAR:
            self._forget(kg, body[1])
        else:
            raise CorruptChangelogError(
                f"{C.OP_NAMES[op]} is not a ReducingState operation (state {self.name!r})", 0)


def _row_values(col: Column) -> Any:
    """What dict_update_rows takes: int64/float64 arrays as they are (the kernel makes the Python
    objects), anything else as a list of Python objects."""
    if col.np is not None and col.np.dtype.kind == "i":
        return np.ascontiguousarray(col.np, dtype=np.int64)
    if col.np is not None and col.np.dtype.kind == "f":
        return np.ascontiguousarray(col.np, dtype=np.float64)
    return col.tolist()


_KIND_CLASSES = {"value": ValueState, "list": ListState, "map": MapState, "reducing": ReducingState}


# ---------------------------------------------------------------------------------- backend


class KeyedStateBackend:
    """The keyed state of one operator subtask (one key-group range), backed by a changelog writer.

    `materialize_every_changes` / `materialize_every_bytes`: materialize automatically once that many
    changes / payload bytes were logged since the last materialization (checked after each mutation
    or batch). `serializer`: default value serializer (msgpack).
    """

    def __init__(self, storage, operator_id: str, key_group_range: KeyGroupRange, max_parallelism: int, *,
                 materialize_every_changes: Optional[int] = None, materialize_every_bytes: Optional[int] = None,
                 serializer: Any = None):
        if isinstance(max_parallelism, bool) or not isinstance(max_parallelism, (int, np.integer)):
            raise TypeError(f"max_parallelism must be an int, got {type(max_parallelism).__name__}")
        max_parallelism = int(max_parallelism)
        if not 1 <= max_parallelism <= _MAX_PARALLELISM:
            raise ValueError(f"max_parallelism must be in 1..{_MAX_PARALLELISM}, got {max_parallelism}")
        if not isinstance(key_group_range, KeyGroupRange):
            raise TypeError(f"key_group_range must be a KeyGroupRange, got {type(key_group_range).__name__}")
        if key_group_range.is_empty() or key_group_range.end >= max_parallelism:
            raise ValueError(f"key_group_range {key_group_range} must be non-empty and within "
                             f"0..{max_parallelism - 1} (max_parallelism {max_parallelism})")
        for name, v in (("materialize_every_changes", materialize_every_changes),
                        ("materialize_every_bytes", materialize_every_bytes)):
            if v is not None and (isinstance(v, bool) or not isinstance(v, int) or v <= 0):
                raise ValueError(f"{name} must be a positive int or None, got {v!r}")
        self.storage = storage
        self.operator_id = operator_id
        self.key_group_range = key_group_range
        self.max_parallelism = max_parallelism
        self.materialize_every_changes = materialize_every_changes
        self.materialize_every_bytes = materialize_every_bytes
        self.default_serializer = resolve_serializer(serializer)
        self._kg_start = key_group_range.start
        self._kg_end = key_group_range.end
        self._writer = storage.create_writer(operator_id, key_group_range)
        self._table: Dict[int, Dict[str, dict]] = {}
        self._states: Dict[str, _State] = {}
        self._next_sid = 0
        # materialization bookkeeping (see materialize.py)
        self._mat = None                  # current Materialization (or the restored base), or None
        self._old_mats: List[Any] = []    # superseded ones, discarded once a newer one is confirmed
        self._mat_counter = 0
        self._truncated_mat_id = -1
        self._pending: Dict[int, _Pending] = {}
        self._since_changes = 0
        self._since_bytes = 0
        self._materializing = False
        self._deferred_error: Optional[BaseException] = None
        self._closed = False
        self.restore_stats: Dict[str, int] = {}
        self.materializations = 0

    # -- keys and appends -----------------------------------------------------------------------
    def _kg(self, key: Any) -> int:
        if type(key) not in _KEY_TYPES:
            if isinstance(key, np.integer):
                raise TypeError(f"state keys must be Python int, str or bytes; convert {type(key).__name__} "
                                f"with int()")
            if isinstance(key, bool) or not isinstance(key, _KEY_TYPES):
                raise TypeError(f"state keys must be int, str or bytes, got {type(key).__name__}: {key!r}")
        kg = assign_to_key_group(key, self.max_parallelism)
        if not self._kg_start <= kg <= self._kg_end:
            raise ValueError(f"key {key!r} belongs to key group {kg}, outside this backend's range "
                             f"{self.key_group_range}")
        return kg

    def _check_kgs(self, kgs: np.ndarray, col: Column) -> None:
        if kgs.size:
            bad = (kgs < self._kg_start) | (kgs > self._kg_end)
            if bad.any():
                row = int(np.argmax(bad))
                key = col.tolist()[row]
                raise ValueError(f"row {row}: key {key!r} belongs to key group {int(kgs[row])}, outside this "
                                 f"backend's range {self.key_group_range}")

    def _append(self, kg: int, payload: bytes) -> None:
        self._check_open()
        try:
            self._writer.append(kg, payload)
        except OSError as exc:
            # the change is in the log (a pre-emptive upload failed afterwards, SEMANTICS §4.5): let
            # the caller apply it in memory too, then raise from _mutated()
            self._deferred_error = exc
        self._since_changes += 1
        self._since_bytes += len(payload)

    def _append_many(self, kgs: np.ndarray, data: np.ndarray, offsets: np.ndarray) -> None:
        self._check_open()
        try:
            self._writer.append_many(np.ascontiguousarray(kgs, dtype=np.int32), data, offsets)
        except OSError as exc:
            self._deferred_error = exc
        self._since_changes += len(kgs)
        self._since_bytes += int(offsets[-1] - offsets[0])

    def _mutated(self, n: int = 1) -> None:
        """After the in-memory table changed: raise a deferred append error, else materialize if
        the interval is reached."""
        if self._deferred_error is not None:
            exc, self._deferred_error = self._deferred_error, None
            raise exc
        if self._materializing:
            return
        if (self.materialize_every_changes is not None and self._since_changes >= self.materialize_every_changes) \
                or (self.materialize_every_bytes is not None and self._since_bytes >= self.materialize_every_bytes):
            self.materialize()

    def _check_open(self) -> None:
        if self._closed:
            raise RuntimeError(f"keyed state backend {self.operator_id!r} {self.key_group_range} is closed")

    # -- registration ---------------------------------------------------------------------------
    def _register(self, name: str, kind: str, serializer: Any, options: Dict[str, Any]) -> _State:
        self._check_open()
        ser = resolve_serializer(serializer) if serializer is not None else self.default_serializer
        existing = self._states.get(name)
        if existing is not None:
            m = existing.meta
            if m.kind != kind:
                raise ValueError(f"state {name!r} is already registered as {m.kind} state, not {kind}")
            if m.serializer_id != ser.id and serializer is not None:
                raise ValueError(f"state {name!r} uses serializer {m.serializer_id!r}, not {ser.id!r}")
            if m.options != options:
                raise ValueError(f"state {name!r} is registered with options {m.options}, not {options}")
            return existing
        meta = C.StateMeta(self._next_sid, name, kind, ser.id, options)
        self._next_sid += 1
        self._writer.append_meta(C.encode_meta(meta))
        state = _KIND_CLASSES[kind](self, meta, ser)
        self._states[name] = state
        return state

    def value_state(self, name: str, serializer: Any = None) -> ValueState:
        """Get or register a ValueState (one METADATA change on first registration)."""
        return self._register(name, "value", serializer, {})

    def list_state(self, name: str, serializer: Any = None, max_length: Optional[int] = None) -> ListState:
        """Get or register a ListState; `max_length` keeps only the last N elements per key."""
        if max_length is not None and (isinstance(max_length, bool) or not isinstance(max_length, int)
                                       or max_length <= 0):
            raise ValueError(f"max_length must be a positive int or None, got {max_length!r}")
        return self._register(name, "list", serializer, {} if max_length is None else {"max_length": max_length})

    def map_state(self, name: str, serializer: Any = None) -> MapState:
        """Get or register a MapState (the serializer applies to map values)."""
        return self._register(name, "map", serializer, {})

    def reducing_state(self, name: str, reduce_fn: Callable[[Any, Any], Any], serializer: Any = None) -> ReducingState:
        """Get or register a ReducingState (re-registering after a restore attaches `reduce_fn`)."""
        if not callable(reduce_fn):
            raise TypeError("reduce_fn must be callable")
        state = self._register(name, "reducing", serializer, {})
        state.reduce_fn = reduce_fn
        return state

    @property
    def state_names(self) -> List[str]:
        return list(self._states)

    def get_state(self, name: str) -> _State:
        """A registered (or restored) state by name."""
        try:
            return self._states[name]
        except KeyError:
            raise KeyError(f"no state named {name!r} (registered: {sorted(self._states)})") from None

    def key_groups(self) -> List[int]:
        """Key groups that hold any state."""
        return sorted(kg for kg, t in self._table.items() if any(t.values()))

    # -- checkpoints ----------------------------------------------------------------------------
    def snapshot(self, checkpoint_id: int) -> "Future[KeyedStateSnapshot]":
        """Persist the log since the last materialization; Future of the checkpoint's snapshot."""
        self._check_open()
        checkpoint_id = int(checkpoint_id)
        if checkpoint_id < 0:
            raise ValueError(f"checkpoint_id must be >= 0, got {checkpoint_id}")
        if checkpoint_id in self._pending:
            raise ValueError(f"checkpoint {checkpoint_id} was already snapshotted")
        try:
            mat, start, end, persisted = self._persist(checkpoint_id)
        except OSError:
            if self._writer.highest_failed is None:
                raise
            # an upload of this log segment failed, so it cannot be persisted any more; the state in
            # memory is complete, so materialize it and persist the fresh segment after it
            log.warning("%s %s: changelog upload failed earlier; materializing before checkpoint %d",
                        self.operator_id, self.key_group_range, checkpoint_id)
            self.materialize(force=True)
            mat, start, end, persisted = self._persist(checkpoint_id)
        self._pending[checkpoint_id] = _Pending(mat, start, end)
        handles = list(mat.handles) if mat is not None else []
        kgr, maxp = self.key_group_range, self.max_parallelism
        out: Future = Future()

        def done(f: Future) -> None:
            exc = f.exception()
            if exc is not None:
                out.set_exception(exc)
                return
            h = f.result().job_manager_owned_snapshot
            changelog = h if h is not None and len(h.handles_and_offsets) else None
            out.set_result(KeyedStateSnapshot(kgr, handles, changelog, maxp, checkpoint_id))

        persisted.add_done_callback(done)
        return out

    def _persist(self, checkpoint_id: int):
        mat = self._mat
        start = mat.sqn if mat is not None else self._writer.initial_sequence_number()
        end = self._writer.next_sequence_number()
        return mat, start, end, self._writer.persist(start, checkpoint_id)

    def confirm(self, checkpoint_id: int) -> None:
        """The checkpoint completed: it owns its files now; drop what it made obsolete."""
        rec = self._pending.pop(int(checkpoint_id), None)
        if rec is None:
            log.debug("confirm of unknown or already settled checkpoint %s", checkpoint_id)
            return
        for cp in [c for c in self._pending if c < checkpoint_id]:  # subsumed
            del self._pending[cp]
        self._writer.confirm(rec.start, rec.end, checkpoint_id)
        mat = rec.mat
        if mat is None:
            return
        mat.confirm(checkpoint_id)
        if mat.id > self._truncated_mat_id:
            # everything logged before this materialization is now covered by it
            self._writer.truncate(rec.start)
            self._truncated_mat_id = mat.id
            keep = []
            for old in self._old_mats:
                if old.id < mat.id:
                    old.discard()
                else:
                    keep.append(old)
            self._old_mats = keep

    def abort(self, checkpoint_id: int) -> None:
        """The checkpoint failed: forget it (uploaded change sets stay reusable)."""
        rec = self._pending.pop(int(checkpoint_id), None)
        if rec is not None:
            self._writer.reset(rec.start, rec.end, checkpoint_id)

    def materialize(self, force: bool = False) -> None:
        """Write a compact snapshot of all state per key group; see dstl.state.materialize.

        A no-op when nothing changed since the last materialization, unless `force`."""
        from dstl.state.materialize import materialize

        self._check_open()
        materialize(self, force=force)

    # -- restore --------------------------------------------------------------------------------
    @classmethod
    def restore(cls, storage, operator_id: str, key_group_range: KeyGroupRange, max_parallelism: int,
                snapshots: Sequence[KeyedStateSnapshot], *, serializers: Optional[Dict[str, Any]] = None,
                materialize_on_restore: bool = False, **kw: Any) -> "KeyedStateBackend":
        """A backend for `key_group_range` rebuilt from the snapshots of all old subtasks.

        Metadata changes are replayed from every handle (idempotent); data changes only for key
        groups in range. `serializers` maps serializer ids to objects (besides the registered ones).
        The old handles stay part of this backend's snapshots until the next materialization
        (immediately, with `materialize_on_restore=True`).
        """
        from dstl.state.materialize import Materialization

        backend = cls(storage, operator_id, key_group_range, max_parallelism, **kw)
        try:
            base = backend._replay_snapshots(snapshots, serializers or {})
            backend._mat = Materialization.restored(base, backend._writer.initial_sequence_number())
            if materialize_on_restore:
                backend.materialize()
        except BaseException:
            backend.close()
            raise
        return backend

    def _replay_snapshots(self, snapshots: Sequence[KeyedStateSnapshot], serializers: Dict[str, Any]) -> List[Any]:
        stats = {"handles": 0, "change_sets": 0, "changes_read": 0, "changes_applied": 0,
                 "meta_changes": 0, "bytes_read": 0}
        self.restore_stats = stats
        reader = self.storage.create_reader()
        base: List[Any] = []
        for snap in snapshots:
            if not isinstance(snap, KeyedStateSnapshot):
                raise TypeError(f"expected KeyedStateSnapshot objects, got {type(snap).__name__}")
            if snap.max_parallelism is not None and snap.max_parallelism != self.max_parallelism:
                raise ValueError(f"snapshot was taken with max_parallelism {snap.max_parallelism}; a restore "
                                 f"must use the same value, not {self.max_parallelism}")
            for handle in snap.handles():
                part = handle.get_intersection(self.key_group_range)
                if part is None:
                    continue
                base.append(part)
                self._replay_handle(reader, part, serializers, stats)
        # this backend's own log starts self-described
        for state in self._states.values():
            self._writer.append_meta(C.encode_meta(state.meta))
        return base

    def _replay_handle(self, reader, handle, serializers: Dict[str, Any], stats: Dict[str, int]) -> None:
        local: Dict[int, _State] = {}   # state ids are per log
        stats["handles"] += 1
        META, KG_SNAPSHOT, names = C.METADATA, C.KEY_GROUP_SNAPSHOT, C.OP_NAMES
        applied = meta_changes = 0
        cur_kg: Optional[int] = None    # key group whose per-state tables are cached in `cur`
        cur: Dict[Any, dict] = {}
        it = reader.get_changes_arrays(handle)
        try:
            for buf, kgs, offs, lens in it:
                stats["change_sets"] += 1
                stats["changes_read"] += len(kgs)
                stats["bytes_read"] += int(lens.sum())
                view = buf if isinstance(buf, (bytes, memoryview)) else memoryview(buf)
                for kg, off, ln in zip(kgs.tolist(), offs.tolist(), lens.tolist()):
                    if ln == 0:
                        raise CorruptChangelogError("empty state change payload", off)
                    op = view[off]
                    if op not in names:
                        raise CorruptChangelogError(f"unknown state change operation code {op}", off)
                    try:
                        body = unpackb(view[off + 1:off + ln])
                    except Exception as exc:  # msgpack raises several unrelated types
                        raise CorruptChangelogError(f"undecodable {names[op]} change body: {exc}", off) from exc
                    if op == META:
                        meta_changes += 1
                        meta = C.decode_meta(body)
                        local[meta.state_id] = self._restore_meta(meta, serializers)
                        continue
                    applied += 1
                    if op == KG_SNAPSHOT:
                        cur_kg = None
                        self._apply_kg_snapshot(kg, body, local)
                        continue
                    try:
                        state = local[body[0]]
                    except (KeyError, TypeError, IndexError):
                        raise CorruptChangelogError(
                            f"{names[op]} change refers to state id {body[0] if body else None!r} "
                            f"without a preceding METADATA change", off) from None
                    if op in state._fast_ops:
                        # hot path (value/reducing state, msgpack values): no method calls per change
                        if kg != cur_kg:
                            cur_kg, cur = kg, {}
                        tbl = cur.get(state)
                        if tbl is None:
                            tbl = cur[state] = state._table(kg)
                        tbl[body[1]] = body[2]
                        continue
                    cur_kg = None  # other ops may create/replace per-key-group tables
                    state._apply(op, kg, body)
        finally:
            it.close()
            stats["changes_applied"] += applied
            stats["meta_changes"] += meta_changes

    def _restore_meta(self, meta: C.StateMeta, serializers: Dict[str, Any]) -> _State:
        existing = self._states.get(meta.name)
        if existing is not None:
            if not existing.meta.same_definition(C.StateMeta(existing.meta.state_id, meta.name, meta.kind,
                                                             meta.serializer_id, meta.options)):
                raise ValueError(f"state {meta.name!r} is defined differently in two snapshots: "
                                 f"{existing.meta} vs {meta}")
            return existing
        ser = get_serializer(meta.serializer_id, serializers)
        own = C.StateMeta(self._next_sid, meta.name, meta.kind, meta.serializer_id, meta.options)
        self._next_sid += 1
        state = _KIND_CLASSES[meta.kind](self, own, ser)
        self._states[meta.name] = state
        return state

    def _apply_kg_snapshot(self, kg: int, body: Any, local: Dict[int, _State]) -> None:
        if kg < 0:
            raise CorruptChangelogError("KEY_GROUP_SNAPSHOT change in the metadata group", 0)
        t = self._table.setdefault(kg, {})
        for sid, entries in body:
            state = local.get(sid)
            if state is None:
                raise CorruptChangelogError(f"key-group snapshot refers to unknown state id {sid!r}", 0)
            restore = state._restore_value
            # merge: a big key group comes as several changes (materialize.CHUNK_ENTRIES)
            dst = t.get(state.name)
            if dst is None:
                dst = t[state.name] = {}
            dst.update({k: restore(w) for k, w in entries.items()})

    # -- lifecycle ------------------------------------------------------------------------------
    @property
    def writer(self):
        return self._writer

    @property
    def closed(self) -> bool:
        return self._closed

    def close(self) -> None:
        """Close the writers (releases nothing: persisted handles stay valid). Idempotent."""
        if self._closed:
            return
        self._closed = True
        self._writer.close()
        for m in [self._mat] + self._old_mats:
            if m is not None:
                m.close()
        self._table.clear()

    def __enter__(self) -> "KeyedStateBackend":
        return self

    def __exit__(self, *exc) -> None:
        self.close()

    def __repr__(self) -> str:
        return (f"KeyedStateBackend({self.operator_id!r}, {self.key_group_range}, max_parallelism="
                f"{self.max_parallelism}, states={sorted(self._states)})")
