"""Processing-time TTL for keyed state, as Spark's transformWithState has it.

A state registered with a TTL stores every value beside its expiry time: a ValueState value, each
ListState element and each MapState entry is ``[value, expires_at_ms]`` in memory and in the log,
and the state's METADATA change carries the option ``{"ttl": True}`` so any reader knows the layout.
Every write sets the expiry to ``clock() + ttl_ms`` (Spark: "any state update resets the expiration
time"); the TTL duration itself is not recorded, so it may change between runs.

* Expired values are invisible at once: every read compares with `clock()` (expired when
  ``expires_at_ms <= now``).
* They are removed from memory when a read meets them and by `purge_expired` (which the backend
  runs before each materialization), and so from the log at the next materialization. Dropping one
  from memory logs nothing: replaying the log brings it back already expired, still invisible.

The clock is injectable (tests, and StatefulStream, whose clock is the micro-batch's timestamp).
"""
from __future__ import annotations

import time
from typing import Any, Callable, Dict, Iterator, List, Optional, Sequence, Tuple

__all__ = ["wall_clock_ms", "check_ttl", "TtlValueState", "TtlListState", "TtlMapState", "purge_expired",
           "TTL_OPTION"]

#: the METADATA option that marks a state's values as [value, expires_at_ms]
TTL_OPTION = "ttl"

Clock = Callable[[], int]


def wall_clock_ms() -> int:
    """Milliseconds since the epoch (the default TTL clock)."""
    return int(time.time() * 1000)


def check_ttl(ttl_ms: Any) -> Optional[int]:
    """A validated TTL duration (positive int milliseconds) or None."""
    if ttl_ms is None:
        return None
    if isinstance(ttl_ms, bool) or not hasattr(ttl_ms, "__index__") or int(ttl_ms) <= 0:
        raise ValueError(f"ttl_ms must be a positive int (milliseconds) or None, got {ttl_ms!r}")
    return int(ttl_ms)


class _Ttl:
    """Common part: the wrapped raw state, the TTL and the clock."""

    def __init__(self, raw, ttl_ms: int, clock: Optional[Clock] = None):
        self.raw = raw
        self.name = raw.name
        self.ttl_ms = check_ttl(ttl_ms)
        self.clock: Clock = clock or wall_clock_ms

    def _expiry(self) -> int:
        return int(self.clock()) + self.ttl_ms

    def _kg_table(self, key: Any) -> Tuple[int, Optional[dict]]:
        kg = self.raw._b._kg(key)
        return kg, self.raw._lookup(kg)

    def contains_key(self, key: Any) -> bool:
        return bool(self._live(key))

    def clear(self, key: Any) -> None:
        self.raw.clear(key)

    def __len__(self) -> int:
        return sum(1 for _ in self.items())

    def __repr__(self) -> str:
        return f"{type(self).__name__}({self.name!r}, ttl_ms={self.ttl_ms})"


class TtlValueState(_Ttl):
    """A ValueState whose values expire `ttl_ms` after their last update."""

    def _live(self, key: Any) -> Any:
        _, s = self._kg_table(key)
        if s is None:
            return None
        e = s.get(key)
        if e is None:
            return None
        if e[1] <= self.clock():
            del s[key]  # expired: gone from memory (the log drops it at the next materialization)
            return None
        return e

    def get(self, key: Any, default: Any = None) -> Any:
        e = self._live(key)
        return default if e is None else e[0]

    def expires_at(self, key: Any) -> Optional[int]:
        e = self._live(key)
        return None if e is None else e[1]

    def update(self, key: Any, value: Any) -> None:
        if value is None:
            self.raw.clear(key)
        else:
            self.raw.update(key, [value, self._expiry()])

    def items(self) -> Iterator[Tuple[Any, Any]]:
        now = self.clock()
        for k, e in self.raw.all_items():
            if e[1] > now:
                yield k, e[0]


class TtlListState(_Ttl):
    """A ListState whose elements each expire `ttl_ms` after they were written."""

    def _live(self, key: Any) -> List[Any]:
        _, s = self._kg_table(key)
        lst = None if s is None else s.get(key)
        if not lst:
            return []
        now = self.clock()
        if lst[0][1] <= now or any(e[1] <= now for e in lst):
            kept = [e for e in lst if e[1] > now]
            if kept:
                s[key] = kept
            else:
                del s[key]
            return kept
        return lst

    def get(self, key: Any) -> List[Any]:
        return [e[0] for e in self._live(key)]

    def add(self, key: Any, value: Any) -> None:
        self.raw.add(key, [value, self._expiry()])

    def add_all(self, key: Any, values: Sequence[Any]) -> None:
        exp = self._expiry()
        self.raw.add_all(key, [[v, exp] for v in values])

    def update(self, key: Any, values: Optional[Sequence[Any]]) -> None:
        exp = self._expiry()
        self.raw.update(key, None if values is None else [[v, exp] for v in values])

    def items(self) -> Iterator[Tuple[Any, List[Any]]]:
        now = self.clock()
        for k, lst in self.raw.all_items():
            live = [e[0] for e in lst if e[1] > now]
            if live:
                yield k, live


class TtlMapState(_Ttl):
    """A MapState whose entries each expire `ttl_ms` after their last put."""

    def _live(self, key: Any) -> Dict[Any, Any]:
        _, s = self._kg_table(key)
        m = None if s is None else s.get(key)
        if not m:
            return {}
        now = self.clock()
        dead = [uk for uk, e in m.items() if e[1] <= now]
        for uk in dead:
            del m[uk]
        if not m:
            del s[key]
        return m

    def get(self, key: Any, user_key: Any, default: Any = None) -> Any:
        e = self._live(key).get(user_key)
        return default if e is None else e[0]

    def contains(self, key: Any, user_key: Any) -> bool:
        return user_key in self._live(key)

    def put(self, key: Any, user_key: Any, value: Any) -> None:
        self.raw.put(key, user_key, [value, self._expiry()])

    def remove(self, key: Any, user_key: Any) -> None:
        self.raw.remove(key, user_key)

    def items(self, key: Any) -> List[Tuple[Any, Any]]:
        return [(uk, e[0]) for uk, e in list(self._live(key).items())]

    def keys(self, key: Any) -> List[Any]:
        return list(self._live(key))

    def values(self, key: Any) -> List[Any]:
        return [e[0] for e in list(self._live(key).values())]

    def is_empty(self, key: Any) -> bool:
        return not self._live(key)

    def all_maps(self) -> Iterator[Tuple[Any, Dict[Any, Any]]]:
        now = self.clock()
        for k, m in self.raw.all_items():
            live = {uk: e[0] for uk, e in m.items() if e[1] > now}
            if live:
                yield k, live


def purge_expired(backend, now: Optional[int] = None) -> int:
    """Drop every expired value of every TTL state from `backend`'s memory; returns how many.

    Logs nothing (see the module docstring); run before a materialization, whose compact snapshot
    then no longer holds them.
    """
    now = wall_clock_ms() if now is None else int(now)
    # each state's kind knows the layout of its entries (value, list of elements, map of entries)
    purges = {name: st._purge_entry for name, st in backend._states.items() if st.meta.options.get(TTL_OPTION)}
    dropped = 0
    if not purges:
        return 0
    for tables in backend._table.values():
        for name, purge in purges.items():
            s = tables.get(name)
            if not s:
                continue
            dead = []
            for key, v in s.items():
                n, gone = purge(v, now)
                dropped += n
                if gone:
                    dead.append(key)
            for key in dead:
                del s[key]
    return dropped
