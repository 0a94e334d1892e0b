"""StatefulProcessor subclasses written as a PySpark user writes them for `transformWithStateInPandas`.

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
from pyspark.sql.streaming import StatefulProcessor, StatefulProcessorHandle

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
