"""In-memory keyed state with the `KeyedStateBackend` API (value, list, map and reducing state in dicts).

No changelog and no durability: the baseline that benchmarks and the `--state memory` runs compare
dstl's overhead against. `MEMORY_KINDS` holds one class per state kind; importing this module fails
when a state kind (dstl.state.kinds) has none.
"""
from __future__ import annotations

from typing import Any, Callable, Dict, Tuple

from dstl.state.kinds import require_every_kind

class _MemValue:
    def __init__(self):
        self.d: Dict[Any, Any] = {}

    def get(self, key, default=None):
        return self.d.get(key, default)

    def get_many(self, keys, default=None):
        d = self.d
        return [d.get(k, default) for k in _as_list(keys)]

    def update(self, key, value):
        self.d[key] = value

    def update_many(self, keys, values):
        self.d.update(zip(_as_list(keys), _as_list(values)))

    def items(self):
        return self.d.items()


class _MemList:
    def __init__(self, max_length=None):
        self.d: Dict[Any, list] = {}
        self.max_length = max_length

    def get(self, key):
        return list(self.d.get(key, ()))

    def add_many(self, keys, values):
        d, m = self.d, self.max_length
        touched = set()
        for k, v in zip(_as_list(keys), _as_list(values)):
            lst = d.get(k)
            if lst is None:
                d[k] = [v]
            else:
                lst.append(v)
            touched.add(k)
        if m is not None:
            for k in touched:
                lst = d[k]
                if len(lst) > m:
                    del lst[:len(lst) - m]


class _MemMap:
    def __init__(self):
        self.d: Dict[Any, Dict[Any, Any]] = {}

    def put_many(self, keys, user_keys, values):
        d = self.d
        for k, uk, v in zip(_as_list(keys), _as_list(user_keys), _as_list(values)):
            m = d.get(k)
            if m is None:
                d[k] = {uk: v}
            else:
                m[uk] = v

    def size(self, key) -> int:
        return len(self.d.get(key, ()))

    def items(self, key):
        return self.d.get(key, {}).items()


class _MemReducing:
    def __init__(self, reduce_fn: Callable[[Any, Any], Any]):
        self.d: Dict[Any, Any] = {}
        self.reduce_fn = reduce_fn

    def get(self, key, default=None):
        return self.d.get(key, default)

    def add(self, key, value):
        d = self.d
        d[key] = self.reduce_fn(d[key], value) if key in d else value

    def add_many(self, keys, values):
        d, fn = self.d, self.reduce_fn
        for k, v in zip(_as_list(keys), _as_list(values)):
            d[k] = fn(d[k], v) if k in d else v

    def items(self):
        return self.d.items()


def _as_list(col) -> list:
    return col.tolist() if hasattr(col, "tolist") else list(col)


#: state kind -> the class that holds one state of it in dicts
MEMORY_KINDS: Dict[str, type] = {"value": _MemValue, "list": _MemList, "map": _MemMap,
                                 "reducing": _MemReducing}
require_every_kind(MEMORY_KINDS, f"{__name__}.MEMORY_KINDS")


class MemoryState:
    """The same state API as `KeyedStateBackend`, in dicts: no changelog, no durability."""

    def __init__(self):
        self._states: Dict[Tuple[str, str], Any] = {}

    def _get(self, kind: str, name: str, *args: Any) -> Any:
        s = self._states.get((kind, name))
        if s is None:
            s = self._states[(kind, name)] = MEMORY_KINDS[kind](*args)
        return s

    def value_state(self, name):
        return self._get("value", name)

    def list_state(self, name, max_length=None):
        return self._get("list", name, max_length)

    def map_state(self, name):
        return self._get("map", name)

    def reducing_state(self, name, reduce_fn):
        """A value per key folded with `reduce_fn(old, new)` (re-getting it keeps the first function)."""
        if not callable(reduce_fn):
            raise TypeError("reduce_fn must be callable")
        return self._get("reducing", name, reduce_fn)
