"""StatefulProcessors that exercise what Spark's own transformWithState test helper exercises
(value/list/map state, TTL, timers of both kinds, initial state, deleteIfExists, timestamps and
nested values), each written once for both flavours: `use_pandas=True` for
transformWithStateInPandas (DataFrames in and out), False for transformWithState (Rows).

tests/test_conformance.py runs each natively and on dstl over the same file stream. `Recording`
wraps a processor to note the batch timestamps native hands it, so dstl's `clock=` can replay them.
"""
from __future__ import annotations

import os
import sys
from typing import Any, Iterator, List

from pyspark import cloudpickle
from pyspark.sql import Row
from pyspark.sql.streaming import StatefulProcessor
from pyspark.sql.types import (ArrayType, DateType, DecimalType, IntegerType, LongType, MapType,
                               StringType, StructField, StructType, TimestampType)

# Spark's Python workers cannot import this test module: its classes travel by value
cloudpickle.register_pickle_by_value(sys.modules[__name__])


def _rows(rows, use_pandas: bool) -> List[Any]:
    """The key's input as a list of Rows, whichever flavour delivered it."""
    if not use_pandas:
        return list(rows)
    out = []
    for pdf in rows:
        out.extend(Row(**{c: pdf[c].iloc[i] for c in pdf.columns}) for i in range(len(pdf)))
    return out


def _emit(records: List[dict], use_pandas: bool):
    if not records:
        return iter([])
    if use_pandas:
        import pandas as pd

        return iter([pd.DataFrame(records)])
    return iter([Row(**r) for r in records])


class Recording(StatefulProcessor):
    """`inner`, plus a note of every batch timestamp it is handed (one line per call) in `path`."""

    def __init__(self, inner: StatefulProcessor, path: str):
        self.inner, self.path = inner, path

    def _note(self, timer_values) -> None:
        with open(self.path, "a") as f:
            f.write(f"{timer_values.getCurrentProcessingTimeInMs()}\n")

    def init(self, handle) -> None:
        self.inner.init(handle)

    def handleInputRows(self, key, rows, timerValues):
        self._note(timerValues)
        return self.inner.handleInputRows(key, rows, timerValues)

    def handleExpiredTimer(self, key, timerValues, expiredTimerInfo):
        self._note(timerValues)
        return self.inner.handleExpiredTimer(key, timerValues, expiredTimerInfo)

    def handleInitialState(self, key, initialState, timerValues) -> None:
        self._note(timerValues)
        self.inner.handleInitialState(key, initialState, timerValues)

    def close(self) -> None:
        self.inner.close()


def recorded_timestamps(path: str) -> List[int]:
    """The distinct batch timestamps a Recording noted, in order (one per micro-batch)."""
    if not os.path.exists(path):
        return []
    with open(path) as f:
        return sorted({int(line) for line in f if line.strip()})


class EventTimeMax(StatefulProcessor):
    """The largest event time (seconds) per key; a timer at the current watermark clears it."""

    OUTPUT = "id string, timestamp string"

    def __init__(self, use_pandas: bool):
        self.use_pandas = use_pandas

    def init(self, handle) -> None:
        self.handle = handle
        self.max_state = handle.getValueState("max_state", StructType([StructField("value", StringType())]))

    def handleInputRows(self, key, rows, timerValues) -> Iterator:
        seconds = [int(r.eventTime.timestamp()) for r in _rows(rows, self.use_pandas)]
        cur = int(self.max_state.get()[0]) if self.max_state.exists() else 0
        top = str(max([cur] + seconds))
        self.max_state.update((top,))
        self.handle.registerTimer(timerValues.getCurrentWatermarkInMs())
        return _emit([{"id": key[0], "timestamp": top}], self.use_pandas)

    def handleExpiredTimer(self, key, timerValues, expiredTimerInfo) -> Iterator:
        self.max_state.clear()
        self.handle.deleteTimer(expiredTimerInfo.getExpiryTimeInMs())
        return _emit([{"id": f"{key[0]}-expired", "timestamp": str(expiredTimerInfo.getExpiryTimeInMs())}],
                     self.use_pandas)

    def close(self) -> None:
        pass


class EventTimeCount(StatefulProcessor):
    """Rows per key so far, and the watermark the batch's handlers see."""

    OUTPUT = "id string, n long, watermark long"

    def __init__(self, use_pandas: bool):
        self.use_pandas = use_pandas

    def init(self, handle) -> None:
        self.count = handle.getValueState("count", "n long")

    def handleInputRows(self, key, rows, timerValues) -> Iterator:
        n = (self.count.get()[0] if self.count.exists() else 0) + len(_rows(rows, self.use_pandas))
        self.count.update((n,))
        return _emit([{"id": key[0], "n": n, "watermark": timerValues.getCurrentWatermarkInMs()}],
                     self.use_pandas)

    def close(self) -> None:
        pass


class DroppedStates(StatefulProcessor):
    """A violation counter, plus states deleted in init: every call on them must raise."""

    OUTPUT = "id string, violations long, raised string"

    def __init__(self, use_pandas: bool, ttl_ms=None):
        self.use_pandas, self.ttl_ms = use_pandas, ttl_ms

    def init(self, handle) -> None:
        self.violations = handle.getValueState("violations", "value long", self.ttl_ms)
        self.temp = handle.getValueState("tempState", StructType([StructField("value", IntegerType())]))
        self.temp_list = handle.getListState("tempList", "value int")
        handle.deleteIfExists("tempState")
        handle.deleteIfExists("tempList")

    def handleInputRows(self, key, rows, timerValues) -> Iterator:
        from pyspark.errors import PySparkRuntimeError

        raised = []
        for what, call in (("exists", self.temp.exists), ("get", self.temp.get),
                           ("list", lambda: self.temp_list.appendValue((1,)))):
            try:
                call()
            except PySparkRuntimeError as exc:
                raised.append(f"{what}:{str(exc).split(':')[0]}")
        total = self.violations.get()[0] if self.violations.exists() else 0
        total += sum(1 for r in _rows(rows, self.use_pandas) if r.temperature > 100)
        self.violations.update((total,))
        return _emit([{"id": key[0], "violations": total, "raised": "|".join(raised)}],
                     self.use_pandas)

    def close(self) -> None:
        pass


class ProcTimeTimers(StatefulProcessor):
    """A running count; key "0" sets a processing-time timer 1 ms after the batch, which resets it.
    A timer set at exactly the batch timestamp tests the firing bound."""

    OUTPUT = "id string, countAsString string, timeValues string"

    def __init__(self, use_pandas: bool):
        self.use_pandas = use_pandas

    def init(self, handle) -> None:
        self.handle = handle
        self.count = handle.getValueState("count_state", StructType([StructField("value", StringType())]))

    def handleInputRows(self, key, rows, timerValues) -> Iterator:
        now = timerValues.getCurrentProcessingTimeInMs()
        n = (int(self.count.get()[0]) if self.count.exists() else 0) + len(_rows(rows, self.use_pandas))
        if key[0] == "0":
            self.handle.registerTimer(now + 1)
        if key[0] == "1":
            self.handle.registerTimer(now)
        self.count.update((str(n),))
        return _emit([{"id": key[0], "countAsString": str(n), "timeValues": str(now)}], self.use_pandas)

    def handleExpiredTimer(self, key, timerValues, expiredTimerInfo) -> Iterator:
        # the key's timers, listed twice: two iterators over them must agree
        first, second = list(self.handle.listTimers()), list(self.handle.listTimers())
        assert first == second, (first, second)
        self.count.clear()
        return _emit([{"id": key[0], "countAsString": "-1",
                       "timeValues": f"{expiredTimerInfo.getExpiryTimeInMs()} timers={sorted(first)}"}],
                     self.use_pandas)

    def close(self) -> None:
        pass


class InitialStateTimers(StatefulProcessor):
    """Initial values summed with input; handleInitialState also sets a timer just before the batch."""

    OUTPUT = "id string, value string"

    def __init__(self, use_pandas: bool):
        self.use_pandas = use_pandas

    def init(self, handle) -> None:
        self.handle = handle
        self.value = handle.getValueState("value_state", StructType([StructField("value", IntegerType())]))
        self.seen = handle.getListState("list_state", "value int")

    def handleInitialState(self, key, initialState, timerValues) -> None:
        vals = ([int(v) for v in initialState["initVal"].tolist()] if self.use_pandas
                else [int(initialState.initVal)])
        self.value.update(((self.value.get()[0] if self.value.exists() else 0) + sum(vals),))
        self.seen.appendList([(v,) for v in vals])
        self.handle.registerTimer(timerValues.getCurrentProcessingTimeInMs() - 1)

    def handleInputRows(self, key, rows, timerValues) -> Iterator:
        total = self.value.get()[0] if self.value.exists() else 0
        total += sum(int(r.temperature) for r in _rows(rows, self.use_pandas))
        self.value.update((total,))
        seen = len(list(self.seen.get())) if self.seen.exists() else 0
        return _emit([{"id": key[0], "value": f"{total}/{seen}"}], self.use_pandas)

    def handleExpiredTimer(self, key, timerValues, expiredTimerInfo) -> Iterator:
        self.handle.deleteTimer(expiredTimerInfo.getExpiryTimeInMs())
        return _emit([{"id": f"{key[0]}-expired", "value": "timer"}], self.use_pandas)

    def close(self) -> None:
        pass


class TtlStates(StatefulProcessor):
    """Value, list and map state with a TTL next to a plain count; key "0" stops refreshing its
    TTL states in its second batch."""

    OUTPUT = "id string, count int"

    def __init__(self, use_pandas: bool):
        self.use_pandas = use_pandas

    def init(self, handle) -> None:
        schema = StructType([StructField("value", IntegerType())])
        self.ttl_value = handle.getValueState("ttl-state", schema, 10_000)
        self.plain = handle.getValueState("state", schema)
        self.ttl_list = handle.getListState("ttl-list-state", schema, 10_000)
        self.ttl_map = handle.getMapState("ttl-map-state", StructType([StructField("id", StringType())]),
                                          schema, 10_000)

    def handleInputRows(self, key, rows, timerValues) -> Iterator:
        n = len(_rows(rows, self.use_pandas))
        plain = (self.plain.get()[0] if self.plain.exists() else 0) + n
        ttl = (self.ttl_value.get()[0] if self.ttl_value.exists() else 0) + n
        lst = (sum(v[0] for v in self.ttl_list.get()) if self.ttl_list.exists() else 0) + n
        mp = (self.ttl_map.getValue(key)[0] if self.ttl_map.containsKey(key) else 0) + n
        self.plain.update((plain,))
        if not (key[0] == "0" and ttl == 2):
            self.ttl_value.update((ttl,))
            self.ttl_list.put([(lst,), (lst,)])
            self.ttl_map.updateValue(key, (mp,))
        return _emit([{"id": f"ttl-count-{key[0]}", "count": ttl}, {"id": f"count-{key[0]}", "count": plain},
                      {"id": f"ttl-list-{key[0]}", "count": lst}, {"id": f"ttl-map-{key[0]}", "count": mp}],
                     self.use_pandas)

    def close(self) -> None:
        pass


class FirstTimestamp(StatefulProcessor):
    """Stateless: each key's first event time, as a timestamp column (what a chained operator reads),
    and a naive wall-clock time the processor builds itself (Spark takes it in the session time zone)."""

    OUTPUT = "id string, outputTimestamp timestamp, wallClock timestamp"

    def __init__(self, use_pandas: bool):
        self.use_pandas = use_pandas

    def init(self, handle) -> None:
        pass

    def handleInputRows(self, key, rows, timerValues) -> Iterator:
        if self.use_pandas:
            first = None
            for pdf in rows:
                first = pdf["eventTime"].tolist()[0] if first is None else first
        else:
            first = [r.eventTime for r in rows][0]
        import datetime as dt

        return _emit([{"id": key[0], "outputTimestamp": first, "wallClock": dt.datetime(2026, 3, 29, 1, 30)}],
                     self.use_pandas)

    def close(self) -> None:
        pass


# nested value state: a struct holding arrays, a map, a nested struct, a timestamp, a date, a decimal
PROFILE = StructType([
    StructField("name", StringType()),
    StructField("scores", ArrayType(LongType())),
    StructField("tags", MapType(StringType(), LongType())),
    StructField("address", StructType([StructField("city", StringType()), StructField("zip", IntegerType())])),
    StructField("seen", TimestampType()),
    StructField("day", DateType()),
    StructField("amount", DecimalType(10, 2)),
])


class CompositeValues(StatefulProcessor):
    """Value, list and map state of nested types (PROFILE), read back as Spark hands them out (Rows
    for structs) and emitted with the same nested types."""

    OUTPUT = ("id string, n long, city string, scores array<bigint>, tags map<string,bigint>, "
              "address struct<city:string,zip:int>, seen timestamp, day date, amount decimal(10,2), "
              "history long")

    def __init__(self, use_pandas: bool):
        self.use_pandas = use_pandas

    def init(self, handle) -> None:
        self.profile = handle.getValueState("profile", StructType([StructField("p", PROFILE)]))
        self.history = handle.getListState("history", StructType([StructField("p", PROFILE)]))
        self.by_city = handle.getMapState("by_city", "city string", StructType([StructField("p", PROFILE)]))

    def handleInputRows(self, key, rows, timerValues) -> Iterator:
        import datetime as dt
        import decimal

        rows = _rows(rows, self.use_pandas)
        old = self.profile.get()[0] if self.profile.exists() else None
        n = len(rows) + (len(old.scores) if old is not None else 0)
        city = f"c{n % 3}" if n % 4 else None
        p = Row(name=key[0], scores=list(range(n)) + ([None] if n % 2 else []),
                tags={"n": n, "old": None if old is None else len(old.tags)},
                address=Row(city=city, zip=n * 100) if n % 5 else None,
                seen=dt.datetime(2026, 1, 1, 12, 0, n % 60), day=dt.date(2026, 1, 1 + n % 28),
                amount=decimal.Decimal(n) / 4 if n % 3 else None)
        self.profile.update((p,))
        self.history.appendValue((p,))
        self.by_city.updateValue((city or "none",), (p,))
        back = self.profile.get()[0]
        via_map = self.by_city.getValue((city or "none",))[0]
        assert back.address == via_map.address
        history = len(list(self.history.get()))
        addr = back.address
        if self.use_pandas and addr is not None:
            addr = addr.asDict()  # a struct column of a pandas DataFrame holds dicts
        return _emit([{"id": key[0], "n": n, "city": None if back.address is None else back.address.city,
                       "scores": back.scores, "tags": back.tags, "address": addr, "seen": back.seen, "day": back.day,
                       "amount": back.amount, "history": history}], self.use_pandas)

    def close(self) -> None:
        pass


class TwoKeyTotals(StatefulProcessor):
    """Grouped by two columns: running temperature totals seeded by an initial state, emitted with
    both key parts as Spark passes them (a tuple of two)."""

    OUTPUT = "id1 string, id2 bigint, value string"

    def __init__(self, use_pandas: bool):
        self.use_pandas = use_pandas

    def init(self, handle) -> None:
        self.value = handle.getValueState("value_state", "value int")

    def handleInitialState(self, key, initialState, timerValues) -> None:
        vals = ([int(v) for v in initialState["initVal"].tolist()] if self.use_pandas
                else [int(initialState.initVal)])
        self.value.update(((self.value.get()[0] if self.value.exists() else 0) + sum(vals),))

    def handleInputRows(self, key, rows, timerValues) -> Iterator:
        assert isinstance(key, tuple) and len(key) == 2, key
        rows = _rows(rows, self.use_pandas)
        assert all((r.id1, r.id2) == key for r in rows), (key, rows)
        total = (self.value.get()[0] if self.value.exists() else 0) + sum(int(r.temperature) for r in rows)
        self.value.update((total,))
        return _emit([{"id1": key[0], "id2": int(key[1]), "value": str(total)}], self.use_pandas)

    def close(self) -> None:
        pass


class TwoKeyTimers(StatefulProcessor):
    """Grouped by two columns: a running count and a processing-time timer a minute after the
    batch (tests/test_conformance_keys.py reads both back)."""

    OUTPUT = "id1 string, id2 bigint, n long"

    def __init__(self, use_pandas: bool):
        self.use_pandas = use_pandas

    def init(self, handle) -> None:
        self.handle = handle
        self.count = handle.getValueState("count", "n long")

    def handleInputRows(self, key, rows, timerValues) -> Iterator:
        n = (self.count.get()[0] if self.count.exists() else 0) + len(_rows(rows, self.use_pandas))
        self.count.update((n,))
        self.handle.registerTimer(timerValues.getCurrentProcessingTimeInMs() + 60_000)
        return _emit([{"id1": key[0], "id2": int(key[1]), "n": n}], self.use_pandas)

    def handleExpiredTimer(self, key, timerValues, expiredTimerInfo) -> Iterator:
        return iter([])

    def close(self) -> None:
        pass
