"""Timers as keyed state: registered per key, logged, restored and rescaled exactly like state.

The timers of a backend live in one MapState, `TIMER_STATE` (key -> {timestamp_ms: 1}). So a
timer sits in the key group of its key, and registering (ADD_OR_UPDATE_ELEMENT) or deleting
(REMOVE_ELEMENT) one is a change in that key group's log. A restore at any parallelism brings each
timer to the subtask that owns its key, with every deletion already applied: the Flink bug
FLINK-26063 (a deletion logged in the wrong key group, so a rescale revived deleted timers) cannot
happen here by construction.

Firing: `due(threshold)` lists the timers with ``timestamp <= threshold`` in (timestamp, key)
order; the caller fires each and then `delete`s it in the same micro-batch, so the deletion is part
of that batch's checkpoint. A failed batch is replayed from the previous checkpoint, where the timer
still exists and has not fired in any committed output: each timer fires exactly once.
"""
from __future__ import annotations

from typing import Any, Iterator, List, Tuple

__all__ = ["TimerService", "TIMER_STATE"]

#: the reserved name of the state that holds the timers
TIMER_STATE = "_dstl_timers"


def _check_ts(ts: Any) -> int:
    if isinstance(ts, bool) or not hasattr(ts, "__index__"):
        raise TypeError(f"a timer timestamp is an int of milliseconds, got {type(ts).__name__} {ts!r}")
    return int(ts)


class TimerService:
    """Per-key timers of one `KeyedStateBackend`."""

    def __init__(self, backend):
        self.backend = backend
        self.state = backend.map_state(TIMER_STATE)

    def register(self, key: Any, ts: int) -> None:
        """Register a timer for `key` at `ts` ms (registering an existing one changes nothing)."""
        ts = _check_ts(ts)
        if not self.state.contains(key, ts):
            self.state.put(key, ts, 1)

    def delete(self, key: Any, ts: int) -> None:
        """Delete `key`'s timer at `ts` (absent: nothing happens, nothing is logged)."""
        ts = _check_ts(ts)
        if self.state.contains(key, ts):
            self.state.remove(key, ts)

    def list(self, key: Any) -> List[int]:
        """`key`'s timers, earliest first."""
        return sorted(self.state.keys(key))

    def due(self, threshold: int) -> List[Tuple[int, Any]]:
        """(timestamp, key) of every timer with timestamp <= threshold, in that order."""
        threshold = int(threshold)
        out: List[Tuple[int, Any]] = []
        name = TIMER_STATE
        for tables in self.backend._table.values():
            s = tables.get(name)
            if not s:
                continue
            for key, m in s.items():
                for ts in m:
                    if ts <= threshold:
                        out.append((ts, key))
        out.sort(key=_order)
        return out

    def all(self) -> Iterator[Tuple[Any, int]]:
        """(key, timestamp) of every registered timer."""
        for key, m in self.state.all_items():
            for ts in sorted(m):
                yield key, ts

    def __len__(self) -> int:
        return sum(len(m) for _, m in self.state.all_items())


def _order(item: Tuple[int, Any]) -> Tuple[int, int, Any]:
    ts, key = item
    # keys of one job share a type; the type rank only keeps mixed keys sortable
    return ts, 0 if isinstance(key, int) else 1 if isinstance(key, str) else 2, key
