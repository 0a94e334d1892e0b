"""MapState: a map of user keys to values per key."""
from __future__ import annotations

from typing import Any, Callable, Dict, Iterator, List, Optional, Tuple

import numpy as np

from dstl.errors import CorruptChangelogError
from dstl.state import changes as C
from dstl.state.columns import as_column
from dstl.state.base import _KEY_TYPES, _USER_KEY_TYPES, _State, _norm_key
from dstl.state.ttl import TtlMapState


def _check_user_key(uk: Any) -> None:
    if not isinstance(uk, _USER_KEY_TYPES):
        raise TypeError(f"map user keys must be int, str, bytes, float, bool or None, got {type(uk).__name__}")


class MapState(_State):
    """A map per key: `put`, `get`, `remove`, `contains`, `items`, ... (user keys: msgpack scalars)."""

    kind = "map"
    ttl_view = TtlMapState
    native_replay_ops: frozenset = frozenset()
    feed_ops = {C.CLEAR: "clear", C.SET: "update", C.ADD: "put_all", C.ADD_OR_UPDATE_ELEMENT: "put",
                C.REMOVE_ELEMENT: "remove"}

    @staticmethod
    def _copy(v: dict) -> dict:
        return dict(v)

    def _map(self, key: Any) -> Optional[dict]:
        if type(key) not in _KEY_TYPES:  # numpy scalars: stored and looked up as plain Python keys
            key = _norm_key(key)
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
        if type(key) not in _KEY_TYPES:  # numpy scalars: stored and looked up as plain Python keys
            key = _norm_key(key)
        kg = self._put.change(C.ADD_OR_UPDATE_ELEMENT, key, user_key, self._w(value))
        self._table(kg).setdefault(key, {})[user_key] = value
        self._b._mutated()

    def put_all(self, key: Any, mapping: Dict[Any, Any]) -> None:
        mapping = dict(mapping)
        if not mapping:
            return
        for uk in mapping:
            _check_user_key(uk)
        if type(key) not in _KEY_TYPES:  # numpy scalars: stored and looked up as plain Python keys
            key = _norm_key(key)
        kg = self._b._kg(key)
        self._append(kg, C.ADD, [key, {uk: self._w(v) for uk, v in mapping.items()}])
        self._table(kg).setdefault(key, {}).update(mapping)
        self._b._mutated()

    def remove(self, key: Any, user_key: Any) -> None:
        """Remove one entry (one REMOVE_ELEMENT change); an empty map means no state for the key."""
        _check_user_key(user_key)
        if type(key) not in _KEY_TYPES:  # numpy scalars: stored and looked up as plain Python keys
            key = _norm_key(key)
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

    # an entry is a map of user keys to values: TTL, the readers and schema evolution take them one by one
    @staticmethod
    def _purge_entry(entry: dict, now: int) -> Tuple[int, bool]:
        """(entries dropped, whether the map is gone) for a TTL map of user key -> [value, expires_at_ms]."""
        gone = [uk for uk, e in entry.items() if e[1] <= now]
        for uk in gone:
            del entry[uk]
        return len(gone), not entry

    @staticmethod
    def _entry_rows(entry: dict, ttl: bool, now: int, enc: Callable[[Any], Any]) -> Iterator[Tuple]:
        for uk, v in entry.items():
            if ttl:
                if v[1] <= now:
                    continue
                v = v[0]
            yield enc(uk), None, enc(v)

    @classmethod
    def _feed_cells(cls, op: int, body: list, val: Callable[[Any], Any], js: Callable[[Any], Any]) -> Tuple:
        name = cls.feed_ops.get(op, str(op))
        if op == C.CLEAR:
            return name, None, None
        if op == C.ADD_OR_UPDATE_ELEMENT:
            return name, js(body[2]), js(val(body[3]))
        if op == C.REMOVE_ELEMENT:
            return name, js(body[2]), None
        return name, None, js({k: val(x) for k, x in body[2].items()})

    @staticmethod
    def _evolve_entry(entry: dict, one: Callable[[Any], Any]) -> dict:
        return {uk: one(v) for uk, v in entry.items()}
