"""The part every keyed state kind shares: identity, serializer, table access, bulk encoding.

See dstl.state.backend for how states, the in-memory table and the changelog fit together; a state
reaches its backend only through dstl.state.host.StateHost.

A kind is a subclass of `_State` that names itself with `kind`; it must provide every member of
`KIND_MEMBERS` (what the backend, the replay, the snapshots, TTL, the readers and schema evolution
ask of it), or its class statement raises. dstl.state.kinds is the registry of the kinds."""
from __future__ import annotations

from typing import Any, Callable, Dict, Iterator, List, Optional, Tuple

import numpy as np

from dstl.keygroups import assign_key_groups
from dstl.state import changes as C
from dstl.state.columns import Column, as_column, encode_rows
from dstl.state.host import StateHost

_KEY_TYPES = (int, str, bytes)
_USER_KEY_TYPES = (int, str, bytes, float, bool, type(None))


def _norm_key(key: Any) -> Any:
    """A numpy integer, str or bytes scalar as the plain Python key it stands for (anything else as
    it is, for the key check to reject). Stored keys are always plain Python."""
    if isinstance(key, np.generic) and not isinstance(key, np.bool_):
        v = key.item()
        if isinstance(v, _KEY_TYPES) and not isinstance(v, bool):
            return v
    elif type(key) is not bool and isinstance(key, _KEY_TYPES):
        return int(key) if isinstance(key, int) else str(key) if isinstance(key, str) else bytes(key)
    return key


#: what every state kind provides, beside the mutating methods of its own API (one line each: who asks)
KIND_MEMBERS: Dict[str, str] = {
    "kind": "its name in METADATA changes (one of dstl.state.changes.KINDS)",
    "ttl_view": "the dstl.state.ttl view class a TTL registration returns, or None when the kind takes no TTL",
    "native_replay_ops": "ops whose body a native-serializer replay may store as it is (restore.py)",
    "feed_ops": "op code -> the op's name in read_changes rows, for every op the kind logs",
    "_apply": "replay one logged change into the table (restore.py)",
    "_snapshot_value": "a table entry as a key-group snapshot stores it (materialize.py)",
    "_restore_value": "a key-group snapshot's entry back as a table entry (restore.py)",
    "_copy": "a table entry as all_items hands it out (a copy where it is mutable)",
    "_purge_entry": "drop the expired parts of a TTL table entry (ttl.purge_expired)",
    "_entry_rows": "a table entry as the reader's (user_key, position, value) cells (reader.state_rows)",
    "_feed_cells": "one logged change as the change feed's (op, user_key, value) cells (reader.change_rows)",
    "_evolve_entry": "a table entry with every stored value converted (evolution.evolve_backend)",
}

#: kind name -> its class, filled by the class statements (dstl.state.kinds imports every kind)
KIND_CLASSES: Dict[str, type] = {}


class _State:
    """Common part of the state kinds: identity, serializer, table access, bulk encoding."""

    kind = ""
    # provided by each kind (KIND_MEMBERS), with the methods named there
    ttl_view: Optional[type]
    native_replay_ops: frozenset
    feed_ops: Dict[int, str]

    def __init_subclass__(cls, **kw: Any) -> None:
        super().__init_subclass__(**kw)
        kind = cls.__dict__.get("kind")
        if kind is None:
            return  # an intermediate class: its subclasses name the kind
        missing = [m for m in KIND_MEMBERS if not any(m in c.__dict__ for c in cls.__mro__ if c is not _State)]
        if missing:
            raise TypeError(f"state kind {kind!r} ({cls.__name__}) does not provide "
                            f"{', '.join(missing)}; every kind provides all of: {', '.join(KIND_MEMBERS)} "
                            f"(see dstl.state.base.KIND_MEMBERS)")
        if kind not in C.KINDS:
            raise TypeError(f"state kind {kind!r} ({cls.__name__}) is not one of the format's kinds "
                            f"{', '.join(C.KINDS)}: add it to dstl.state.changes.KINDS")
        other = KIND_CLASSES.get(kind)
        if other is not None and other.__qualname__ != cls.__qualname__:
            raise TypeError(f"state kind {kind!r} is already provided by {other.__name__}, not {cls.__name__}")
        KIND_CLASSES[kind] = cls

    def __init__(self, backend: StateHost, meta: C.StateMeta, serializer: Any):
        self._b = backend
        self.meta = meta
        self.name = meta.name
        self._sid = meta.state_id
        # single-key changes: key group + payload + append in one kernel call (dstl/_fast/_keyed)
        self._put = backend._k.for_state(self._sid, self.name)
        self.serializer = serializer
        self._native = bool(getattr(serializer, "native", False))
        # replay may store SET/SET_INTERNAL bodies directly (see dstl.state.restore._replay_handle)
        self._fast_ops = self.native_replay_ops if self._native else frozenset()

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

    def keys_with_state(self) -> List[Any]:
        return [k for k, _ in self.all_items()]

    def __len__(self) -> int:
        return sum(len(t.get(self.name, ())) for t in self._b._table.values())

    def contains_key(self, key: Any) -> bool:
        if type(key) not in _KEY_TYPES:  # numpy scalars: stored and looked up as plain Python keys
            key = _norm_key(key)
        s = self._lookup(self._b._kg(key))
        return s is not None and key in s

    def clear(self, key: Any) -> None:
        """Remove the key's state (one CLEAR change, even if there was none, as Flink logs it)."""
        if type(key) not in _KEY_TYPES:  # numpy scalars: stored and looked up as plain Python keys
            key = _norm_key(key)
        kg = self._put.change(C.CLEAR, key)
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

    def with_ttl(self, ttl_ms: int, clock: Callable[[], int]) -> Any:
        """This state seen through its kind's TTL view (values expire `ttl_ms` after their write)."""
        view = type(self).ttl_view
        if view is None:
            raise ValueError(f"{self.kind} state {self.name!r} takes no TTL")
        return view(self, ttl_ms, clock)

    def __repr__(self) -> str:
        return f"{type(self).__name__}({self.name!r}, serializer={self.serializer.id!r})"


def _row_values(col: Column) -> Any:
    """What dict_update_rows takes: int64/float64 arrays as they are (the kernel makes the Python
    objects), anything else as a list of Python objects."""
    if col.np is not None and col.np.dtype.kind == "i":
        return np.ascontiguousarray(col.np, dtype=np.int64)
    if col.np is not None and col.np.dtype.kind == "f":
        return np.ascontiguousarray(col.np, dtype=np.float64)
    return col.tolist()
