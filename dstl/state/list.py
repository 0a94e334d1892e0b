"""ListState: a list of values per key."""
from __future__ import annotations

from typing import Any, List, Optional, Sequence


from dstl.errors import CorruptChangelogError
from dstl.state import changes as C
from dstl.state.columns import as_column
from dstl.state.base import _State


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
