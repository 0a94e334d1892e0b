"""ValueState and ReducingState: one value per key."""
from __future__ import annotations

from typing import Any, Callable, Dict, Iterator, List, Optional, Tuple

import numpy as np

from dstl import _impl
from dstl.errors import CorruptChangelogError
from dstl.state import changes as C
from dstl.state.columns import as_column, dict_update_rows, pack_bin_rows
from dstl.state.base import _KEY_TYPES, _State, _norm_key, _row_values
from dstl.state.ttl import TtlValueState

#: `list(value)` when `value` is a tuple or list whose items have exactly `types`, else None: the
#: processor adapters' plain-value encode, one kernel call (dstl/_fast/_keyed)
plain_list: Callable[[Any, tuple], Optional[list]] = _impl.kernel("_keyed").plain_list


class ValueState(_State):
    """One value per key. `update(key, None)` clears, as in Flink."""

    kind = "value"
    ttl_view = TtlValueState
    native_replay_ops = frozenset((C.SET,))
    feed_ops = {C.CLEAR: "clear", C.SET: "update"}

    def __init__(self, backend, meta, serializer):
        super().__init__(backend, meta, serializer)
        if type(self) is ValueState and self._native:
            # the bound fast path: an int, str or bytes key takes one C call (dstl/_fast/_keyed); other
            # keys, and update(key, None), go on to the methods below
            self.get, self.update = self._put.bind_value(
                C.SET, ValueState.get.__get__(self), ValueState.update.__get__(self))

    def get(self, key: Any, default: Any = None) -> Any:
        if type(key) not in _KEY_TYPES:  # numpy scalars: stored and looked up as plain Python keys
            key = _norm_key(key)
        s = self._lookup(self._b._kg(key))
        if s is None:
            return default
        return s.get(key, default)

    def update(self, key: Any, value: Any) -> None:
        if value is None:
            self.clear(key)
            return
        if type(key) not in _KEY_TYPES:  # numpy scalars: stored and looked up as plain Python keys
            key = _norm_key(key)
        self._put.set(C.SET, key, self._w(value), value)  # logs the change, then sets the table entry
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

    # one value per entry: TTL, the readers and schema evolution see it whole
    @staticmethod
    def _copy(v: Any) -> Any:
        return v

    @staticmethod
    def _purge_entry(entry: Any, now: int) -> Tuple[int, bool]:
        """(values dropped, whether the entry is gone) for a TTL entry [value, expires_at_ms]."""
        return (1, True) if entry[1] <= now else (0, False)

    @staticmethod
    def _entry_rows(entry: Any, ttl: bool, now: int, enc: Callable[[Any], Any]) -> Iterator[Tuple]:
        if ttl:
            if entry[1] <= now:
                return
            entry = entry[0]
        yield None, None, enc(entry)

    @classmethod
    def _feed_cells(cls, op: int, body: list, val: Callable[[Any], Any], js: Callable[[Any], Any]) -> Tuple:
        name = cls.feed_ops.get(op, str(op))
        if op == C.CLEAR:
            return name, None, None
        return name, None, js(val(body[2]))

    @staticmethod
    def _evolve_entry(entry: Any, one: Callable[[Any], Any]) -> Any:
        return one(entry)


class ReducingState(ValueState):
    """A value per key folded with `reduce_fn(old, new)`; logged as SET_INTERNAL of the result."""

    kind = "reducing"
    ttl_view = None  # reducing_state() takes no ttl_ms: dstl offers TTL on value, list and map state
    native_replay_ops = frozenset((C.SET, C.SET_INTERNAL))
    feed_ops = {C.CLEAR: "clear", C.SET: "update", C.SET_INTERNAL: "update"}

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
        if type(key) not in _KEY_TYPES:  # numpy scalars: stored and looked up as plain Python keys
            key = _norm_key(key)
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
