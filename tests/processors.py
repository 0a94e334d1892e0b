"""StatefulProcessor subclasses written as a PySpark user writes them for `transformWithStateInPandas`
(and, the Row* classes, for PySpark 4.1+'s Row-based `transformWithState`).

The same classes run unchanged on Spark's native operator and on `dstl.spark.StatefulStream`
(tests/test_streaming_compare.py, bench/streaming_report.py). The input rows are the events of
tests/streaming_util.py: `user string, kind string, value long, ts_ms long, ts timestamp`.
`count_fn` is the vectorised `fn(rows, state)` that produces exactly `CountingProcessor`'s output.
"""
from __future__ import annotations

import sys
from typing import Iterator

import numpy as np
import pandas as pd
from pyspark import cloudpickle
from pyspark.sql import Row
try:
    from pyspark.sql.streaming import StatefulProcessor, StatefulProcessorHandle
except ImportError:  # PySpark 3.5 has no transformWithState API: only count_fn is usable there
    StatefulProcessor, StatefulProcessorHandle = object, None

# Spark's Python workers cannot import tests/: ship these classes inside the pickled function
cloudpickle.register_pickle_by_value(sys.modules[__name__])

COUNT_OUTPUT = "user string, events long, value_sum long, batches long, kinds long, top_kind_events long"
TTL_OUTPUT = "user string, total long, previous long"
SESSION_OUTPUT = "user string, first_ms long, last_ms long, events long, fired_at_ms long"

# TTLs of TtlProcessor: one value outlives every test run, the other never outlives its own batch
# (the next batch starts more than 1 ms later on either engine), so the output is deterministic
# whatever the wall clock does.
LONG_TTL_MS = 3_600_000
SHORT_TTL_MS = 1
# A session closes once the watermark passes its last event + SESSION_GAP_MS. Event times are whole
# seconds and the watermark delay is whole seconds, so a timer (ending in 500 ms) never equals a
# watermark and `<` versus `<=` cannot matter.
SESSION_GAP_MS = 30_500


def _concat(rows: Iterator[pd.DataFrame]) -> pd.DataFrame:
    return pd.concat(list(rows), ignore_index=True)


class CountingProcessor(StatefulProcessor):
    """Per user: events and value sum (ValueState), one list entry per batch the user appeared in
    (ListState) and events per kind (MapState). Emits one row per user and batch."""

    def init(self, handle: StatefulProcessorHandle) -> None:
        self.totals = handle.getValueState("totals", "events long, value_sum long")
        self.batches = handle.getListState("batches", "events long")
        self.kinds = handle.getMapState("kinds", "kind string", "events long")

    def handleInputRows(self, key, rows, timerValues) -> Iterator[pd.DataFrame]:
        pdf = _concat(rows)
        events, value_sum = self.totals.get() if self.totals.exists() else (0, 0)
        events = int(events) + len(pdf)
        value_sum = int(value_sum) + int(pdf["value"].sum())
        self.totals.update((events, value_sum))
        self.batches.appendValue((len(pdf),))
        for kind, n in pdf.groupby("kind").size().items():
            old = self.kinds.getValue((kind,))        # None when the kind is new
            self.kinds.updateValue((kind,), (int(old[0]) + int(n) if old else int(n),))
        per_kind = [int(v[0]) for v in self.kinds.values()]
        yield pd.DataFrame({
            "user": [key[0]], "events": [events], "value_sum": [value_sum],
            "batches": [sum(1 for _ in self.batches.get())], "kinds": [len(per_kind)],
            "top_kind_events": [max(per_kind)],
        })

    def close(self) -> None:
        pass


class TtlProcessor(StatefulProcessor):
    """Processing-time TTL: `total` (1 hour TTL) keeps counting; `previous` (1 ms TTL) is the
    user's event count of the batch that wrote it, expired by the next batch: always -1 on read."""

    def init(self, handle: StatefulProcessorHandle) -> None:
        self.total = handle.getValueState("total", "n long", ttlDurationMs=LONG_TTL_MS)
        self.previous = handle.getValueState("previous", "n long", ttlDurationMs=SHORT_TTL_MS)

    def handleInputRows(self, key, rows, timerValues) -> Iterator[pd.DataFrame]:
        n = len(_concat(rows))
        total = (int(self.total.get()[0]) if self.total.exists() else 0) + n
        previous = int(self.previous.get()[0]) if self.previous.exists() else -1
        self.total.update((total,))
        self.previous.update((n,))
        yield pd.DataFrame({"user": [key[0]], "total": [total], "previous": [previous]})

    def close(self) -> None:
        pass


class SessionProcessor(StatefulProcessor):
    """Event-time sessions: each input moves the user's timer to last event + SESSION_GAP_MS; when
    the watermark passes it, handleExpiredTimer emits the session and clears it."""

    def init(self, handle: StatefulProcessorHandle) -> None:
        self.handle = handle
        self.session = handle.getValueState("session", "first_ms long, last_ms long, events long")

    def handleInputRows(self, key, rows, timerValues) -> Iterator[pd.DataFrame]:
        ts = _concat(rows)["ts_ms"].to_numpy(dtype=np.int64)
        first, last, events = int(ts.min()), int(ts.max()), len(ts)
        if self.session.exists():
            old_first, old_last, old_events = (int(v) for v in self.session.get())
            self.handle.deleteTimer(old_last + SESSION_GAP_MS)
            first, last, events = min(first, old_first), max(last, old_last), events + old_events
        self.session.update((first, last, events))
        self.handle.registerTimer(last + SESSION_GAP_MS)
        return iter([])

    def handleExpiredTimer(self, key, timerValues, expiredTimerInfo) -> Iterator[pd.DataFrame]:
        first, last, events = (int(v) for v in self.session.get())
        self.session.clear()
        yield pd.DataFrame({
            "user": [key[0]], "first_ms": [first], "last_ms": [last], "events": [events],
            "fired_at_ms": [int(expiredTimerInfo.getExpiryTimeInMs())],
        })

    def close(self) -> None:
        pass


def count_fn(rows: pd.DataFrame, state) -> pd.DataFrame:
    """Vectorised equivalent of CountingProcessor for dstl's `fn(rows, state)` contract: all rows of
    one subtask and batch at once, bulk state calls, the same output rows."""
    totals = state.value_state("totals")          # user -> [events, value_sum, batches, kinds, top]
    kinds = state.map_state("kinds")              # user -> {kind: events}
    per_user = rows.groupby("user", sort=False).agg(n=("value", "size"), s=("value", "sum"))
    users = per_user.index.to_numpy(dtype=object)
    pairs = rows.groupby(["user", "kind"], sort=False).size()
    pair_users = pairs.index.get_level_values(0).to_numpy(dtype=object)
    pair_kinds = pairs.index.get_level_values(1).to_numpy(dtype=object)
    pair_events = np.asarray(kinds.get_many(pair_users, pair_kinds, 0), dtype=np.int64) + pairs.to_numpy()
    new_pair = ~kinds.contains_many(pair_users, pair_kinds)
    kinds.put_many(pair_users, pair_kinds, pair_events.tolist())

    old = np.array([t if t is not None else (0, 0, 0, 0, 0) for t in totals.get_many(users)],
                   dtype=np.int64).reshape(-1, 5)
    frame = pd.DataFrame({"user": pair_users, "new": new_pair, "events": pair_events})
    by_user = frame.groupby("user", sort=False).agg(new=("new", "sum"), top=("events", "max"))
    by_user = by_user.reindex(users)
    out = pd.DataFrame({
        "user": users,
        "events": old[:, 0] + per_user["n"].to_numpy(),
        "value_sum": old[:, 1] + per_user["s"].to_numpy(),
        "batches": old[:, 2] + 1,
        "kinds": old[:, 3] + by_user["new"].to_numpy(dtype=np.int64),
        "top_kind_events": np.maximum(old[:, 4], by_user["top"].to_numpy(dtype=np.int64)),
    })
    totals.update_many(users, out[["events", "value_sum", "batches", "kinds", "top_kind_events"]]
                       .to_numpy().tolist())
    return out


# --- the same processors written for PySpark 4.1+'s Row-based transformWithState ------------------
# (Rows in, Rows out; handleInitialState gets one Row per call). They emit exactly the rows of their
# pandas twins above, so the pandas references of tests/streaming_util.py apply to both.

class RowCountingProcessor(StatefulProcessor):
    """CountingProcessor for transformWithState: per user events and value sum (ValueState), one
    list entry per batch (ListState), events per kind (MapState); one Row per user and batch."""

    def init(self, handle: StatefulProcessorHandle) -> None:
        self.totals = handle.getValueState("totals", "events long, value_sum long")
        self.batches = handle.getListState("batches", "events long")
        self.kinds = handle.getMapState("kinds", "kind string", "events long")

    def handleInputRows(self, key, rows, timerValues) -> Iterator[Row]:
        events, value_sum = self.totals.get() if self.totals.exists() else (0, 0)
        n, per_kind = 0, {}
        for row in rows:
            n += 1
            value_sum += row.value
            per_kind[row.kind] = per_kind.get(row.kind, 0) + 1
        events += n
        self.totals.update((events, value_sum))
        self.batches.appendValue((n,))
        for kind, k_events in per_kind.items():
            old = self.kinds.getValue((kind,))
            self.kinds.updateValue((kind,), (old[0] + k_events if old else k_events,))
        counts = [v[0] for v in self.kinds.values()]
        yield Row(user=key[0], events=events, value_sum=value_sum,
                  batches=sum(1 for _ in self.batches.get()), kinds=len(counts), top_kind_events=max(counts))

    def close(self) -> None:
        pass


class RowTtlProcessor(StatefulProcessor):
    """TtlProcessor for transformWithState."""

    def init(self, handle: StatefulProcessorHandle) -> None:
        self.total = handle.getValueState("total", "n long", ttlDurationMs=LONG_TTL_MS)
        self.previous = handle.getValueState("previous", "n long", ttlDurationMs=SHORT_TTL_MS)

    def handleInputRows(self, key, rows, timerValues) -> Iterator[Row]:
        n = sum(1 for _ in rows)
        total = (self.total.get()[0] if self.total.exists() else 0) + n
        previous = self.previous.get()[0] if self.previous.exists() else -1
        self.total.update((total,))
        self.previous.update((n,))
        yield Row(user=key[0], total=total, previous=previous)

    def close(self) -> None:
        pass


class RowSessionProcessor(StatefulProcessor):
    """SessionProcessor for transformWithState: event-time timers, emitted from handleExpiredTimer.
    It reads `ts` (a timestamp: an aware datetime in Row mode) as well as `ts_ms` and checks they
    agree, so a wrong timestamp conversion fails loudly."""

    def init(self, handle: StatefulProcessorHandle) -> None:
        self.handle = handle
        self.session = handle.getValueState("session", "first_ms long, last_ms long, events long")

    def handleInputRows(self, key, rows, timerValues) -> Iterator[Row]:
        ts = []
        for row in rows:
            if row.ts is None or round(row.ts.timestamp() * 1000) != row.ts_ms:
                raise ValueError(f"ts {row.ts!r} is not ts_ms {row.ts_ms}")
            ts.append(row.ts_ms)
        first, last, events = min(ts), max(ts), len(ts)
        if self.session.exists():
            old_first, old_last, old_events = self.session.get()
            self.handle.deleteTimer(old_last + SESSION_GAP_MS)
            first, last, events = min(first, old_first), max(last, old_last), events + old_events
        self.session.update((first, last, events))
        self.handle.registerTimer(last + SESSION_GAP_MS)
        return iter([])

    def handleExpiredTimer(self, key, timerValues, expiredTimerInfo) -> Iterator[Row]:
        first, last, events = self.session.get()
        self.session.clear()
        yield Row(user=key[0], first_ms=first, last_ms=last, events=events,
                  fired_at_ms=expiredTimerInfo.getExpiryTimeInMs())

    def close(self) -> None:
        pass


INITIAL_OUTPUT = "user string, events long, seeded long"


class RowSeededCounter(StatefulProcessor):
    """Counts events per user on top of a seed from the initial state (one Row per seed row: two
    rows for one user add up). Emits events so far and the seed."""

    def init(self, handle: StatefulProcessorHandle) -> None:
        self.count = handle.getValueState("count", "events long, seeded long")

    def handleInitialState(self, key, initialState, timerValues) -> None:
        old = self.count.get()
        seed = (old[1] if old else 0) + initialState.seed
        self.count.update(((old[0] if old else 0) + initialState.seed, seed))

    def handleInputRows(self, key, rows, timerValues) -> Iterator[Row]:
        old = self.count.get() or (0, 0)
        events = old[0] + sum(1 for _ in rows)
        self.count.update((events, old[1]))
        yield Row(user=key[0], events=events, seeded=old[1])

    def close(self) -> None:
        pass
