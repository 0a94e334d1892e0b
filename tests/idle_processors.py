"""Processors whose output comes from timers alone: what an idle stream must still emit.

`IdleTimeout` (ProcessingTime): each input moves the key's timer to now + IDLE_TIMEOUT_MS; when it
fires, the key emits how many rows it saw and forgets them. `IdleSessionClose` (EventTime): a timer
at each key's last event time, so the watermark after the batch closes the key. Both flavours.
"""
from __future__ import annotations

import sys
from typing import Iterator

import pandas as pd
from pyspark import cloudpickle
from pyspark.sql import Row
from pyspark.sql.streaming import StatefulProcessor, StatefulProcessorHandle

cloudpickle.register_pickle_by_value(sys.modules[__name__])

IDLE_OUTPUT = "user string, message string"
IDLE_TIMEOUT_MS = 3000


def _count(rows) -> int:
    return sum(len(r) for r in rows)


class _Base(StatefulProcessor):
    timeout_ms = IDLE_TIMEOUT_MS

    def init(self, handle: StatefulProcessorHandle) -> None:
        self.handle = handle
        self.seen = handle.getValueState("seen", "n long, timer long")

    def _arm(self, n: int, at: int) -> None:
        if self.seen.exists():
            old_n, old_at = (int(v) for v in self.seen.get())
            self.handle.deleteTimer(old_at)
            n += old_n
        self.seen.update((n, at))
        self.handle.registerTimer(at)

    def _expire(self) -> str:
        n = int(self.seen.get()[0])
        self.seen.clear()
        return f"timed out after {n}"

    def close(self) -> None:
        pass


class IdleTimeout(_Base):
    """ProcessingTime, pandas flavour."""

    def handleInputRows(self, key, rows, timerValues) -> Iterator[pd.DataFrame]:
        self._arm(_count(rows), timerValues.getCurrentProcessingTimeInMs() + self.timeout_ms)
        return iter([])

    def handleExpiredTimer(self, key, timerValues, expiredTimerInfo) -> Iterator[pd.DataFrame]:
        yield pd.DataFrame({"user": [key[0]], "message": [self._expire()]})


class RowIdleTimeout(_Base):
    """ProcessingTime, row flavour."""

    def handleInputRows(self, key, rows, timerValues) -> Iterator[Row]:
        self._arm(sum(1 for _ in rows), timerValues.getCurrentProcessingTimeInMs() + self.timeout_ms)
        return iter([])

    def handleExpiredTimer(self, key, timerValues, expiredTimerInfo) -> Iterator[Row]:
        yield Row(user=key[0], message=self._expire())


class IdleSessionClose(_Base):
    """EventTime, pandas flavour: a timer at the key's last event time."""

    def handleInputRows(self, key, rows, timerValues) -> Iterator[pd.DataFrame]:
        frame = pd.concat(list(rows), ignore_index=True)
        self._arm(len(frame), int(frame["ts_ms"].max()))
        return iter([])

    def handleExpiredTimer(self, key, timerValues, expiredTimerInfo) -> Iterator[pd.DataFrame]:
        yield pd.DataFrame({"user": [key[0]], "message": [self._expire()]})


class RowIdleSessionClose(_Base):
    """EventTime, row flavour."""

    def handleInputRows(self, key, rows, timerValues) -> Iterator[Row]:
        rows = list(rows)
        self._arm(len(rows), max(int(r["ts_ms"]) for r in rows))
        return iter([])

    def handleExpiredTimer(self, key, timerValues, expiredTimerInfo) -> Iterator[Row]:
        yield Row(user=key[0], message=self._expire())


class QuickTimeout(IdleTimeout):
    """A 1 ms timeout: due in the first timer round after the batch (tests/timer_kill_driver.py)."""

    timeout_ms = 1
