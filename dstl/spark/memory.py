"""In-memory keyed state with the `KeyedStateBackend` API (value, list and map state in dicts).

No changelog and no durability: the baseline that benchmarks and the `--state memory` runs compare
dstl's overhead against.
"""
from __future__ import annotations

from typing import Any, Dict, Tuple



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


def _as_list(col) -> list:
    return col.tolist() if hasattr(col, "tolist") else list(col)


class MemoryState:
    """The same state API as `KeyedStateBackend`, in dicts: no changelog, no durability."""

    def __init__(self):
        self._states: Dict[Tuple[str, str], Any] = {}

    def _get(self, kind, name, factory):
        s = self._states.get((kind, name))
        if s is None:
            s = self._states[(kind, name)] = factory()
        return s

    def value_state(self, name):
        return self._get("value", name, _MemValue)

    def list_state(self, name, max_length=None):
        return self._get("list", name, lambda: _MemList(max_length))

    def map_state(self, name):
        return self._get("map", name, _MemMap)
