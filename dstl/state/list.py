"""ListState: a list of values per key."""
from __future__ import annotations

from typing import Any, Callable, Iterator, List, Optional, Sequence, Tuple

from dstl.errors import CorruptChangelogError
from dstl.state import changes as C
from dstl.state.columns import as_column
from dstl.state.base import _KEY_TYPES, _State, _norm_key
from dstl.state.ttl import TtlListState


class ListState(_State):
    """A list per key. With `max_length` (recorded in the metadata) only the last N elements stay."""

    kind = "list"
    ttl_view = TtlListState
    native_replay_ops: frozenset = frozenset()
    feed_ops = {C.CLEAR: "clear", C.SET: "update", C.ADD: "add_all", C.ADD_ELEMENT: "add"}

    def __init__(self, backend, meta, serializer):
        super().__init__(backend, meta, serializer)
        self.max_length = meta.options.get("max_length")

    @staticmethod
    def _copy(v: list) -> list:
        return list(v)

    def _trim(self, lst: list) -> list:
        m = self.max_length
        if m is not None and len(lst) > m:
            del lst[:len(lst) - m]
        return lst

    def get(self, key: Any) -> list:
        """A copy of the key's list ([] if none)."""
        if type(key) not in _KEY_TYPES:  # numpy scalars: stored and looked up as plain Python keys
            key = _norm_key(key)
        s = self._lookup(self._b._kg(key))
        if s is None:
            return []
        return list(s.get(key, ()))

    def get_many(self, keys: Any) -> List[list]:
        """Copies of the lists of a column of keys ([] where there is none)."""
        return [[] if s is None else list(s.get(k, ())) for s, k in self._lookup_many(keys)]

    def add(self, key: Any, value: Any) -> None:
        if type(key) not in _KEY_TYPES:  # numpy scalars: stored and looked up as plain Python keys
            key = _norm_key(key)
        kg = self._put.change(C.ADD_ELEMENT, key, self._w(value))
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
        if type(key) not in _KEY_TYPES:  # numpy scalars: stored and looked up as plain Python keys
            key = _norm_key(key)
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
        if type(key) not in _KEY_TYPES:  # numpy scalars: stored and looked up as plain Python keys
            key = _norm_key(key)
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

    # an entry is a list of elements: TTL, the readers and schema evolution take them one by one
    @staticmethod
    def _purge_entry(entry: list, now: int) -> Tuple[int, bool]:
        """(elements dropped, whether the list is gone) for a TTL list of [value, expires_at_ms]."""
        kept = [e for e in entry if e[1] > now]
        dropped = len(entry) - len(kept)
        if dropped and kept:
            entry[:] = kept
        return dropped, dropped > 0 and not kept

    @staticmethod
    def _entry_rows(entry: list, ttl: bool, now: int, enc: Callable[[Any], Any]) -> Iterator[Tuple]:
        pos = 0
        for el in entry:
            if ttl:
                if el[1] <= now:
                    continue
                el = el[0]
            yield None, pos, enc(el)
            pos += 1

    @classmethod
    def _feed_cells(cls, op: int, body: list, val: Callable[[Any], Any], js: Callable[[Any], Any]) -> Tuple:
        name = cls.feed_ops.get(op, str(op))
        if op == C.CLEAR:
            return name, None, None
        if op in (C.SET, C.ADD):
            return name, None, js([val(x) for x in body[2]])
        return name, None, js(val(body[2]))

    @staticmethod
    def _evolve_entry(entry: list, one: Callable[[Any], Any]) -> list:
        return [one(e) for e in entry]
