"""The benchmark's per-user operator: a Spark StatefulProcessor for transformWithStateInPandas
(UserTotals), the same for the Row-based transformWithState (RowUserTotals), and a vectorised dstl
function (user_totals_fn).

All keep (events, value_sum) per user and emit one row per user and batch with the new totals, so
their outputs can be compared row for row.
"""
from __future__ import annotations

import sys
from typing import Iterator

import numpy as np
import pandas as pd
from pyspark import cloudpickle
from pyspark.sql import Row
from pyspark.sql.streaming import StatefulProcessor, StatefulProcessorHandle

OUTPUT = "user string, events long, value_sum long"
OUTPUT_COLS = ["user", "events", "value_sum"]

# Spark's Python workers cannot import bench/: ship these inside the pickled function
cloudpickle.register_pickle_by_value(sys.modules[__name__])


class UserTotals(StatefulProcessor):
    """Per user: events and value sum in one ValueState; emits the new totals."""

    def init(self, handle: StatefulProcessorHandle) -> None:
        self.totals = handle.getValueState("totals", "events long, value_sum long")

    def handleInputRows(self, key, rows, timerValues) -> Iterator[pd.DataFrame]:
        old = self.totals.get()
        events, value_sum = (int(old[0]), int(old[1])) if old else (0, 0)
        for pdf in rows:  # as in Spark's own examples: no concat of the row batches
            events += len(pdf)
            value_sum += int(pdf["value"].sum())
        self.totals.update((events, value_sum))
        yield pd.DataFrame({"user": [key[0]], "events": [events], "value_sum": [value_sum]})

    def close(self) -> None:
        pass


class RowUserTotals(StatefulProcessor):
    """UserTotals as PySpark 4.1+'s transformWithState runs it: Rows in, one Row out per user."""

    def init(self, handle: StatefulProcessorHandle) -> None:
        self.totals = handle.getValueState("totals", "events long, value_sum long")

    def handleInputRows(self, key, rows, timerValues) -> Iterator[Row]:
        old = self.totals.get()
        events, value_sum = (old[0], old[1]) if old else (0, 0)
        for row in rows:
            events += 1
            value_sum += row.value
        self.totals.update((events, value_sum))
        yield Row(user=key[0], events=events, value_sum=value_sum)

    def close(self) -> None:
        pass


def user_totals_fn(rows: pd.DataFrame, state) -> pd.DataFrame:
    """UserTotals vectorised: one bulk read and one bulk write per subtask and batch."""
    totals = state.value_state("totals")
    per_user = rows.groupby("user", sort=False)["value"].agg(["size", "sum"])
    users = per_user.index.to_numpy(dtype=object)
    old = np.array([t if t is not None else (0, 0) for t in totals.get_many(users)], dtype=np.int64).reshape(-1, 2)
    events = old[:, 0] + per_user["size"].to_numpy()
    value_sum = old[:, 1] + per_user["sum"].to_numpy()
    totals.update_many(users, np.stack([events, value_sum], axis=1).tolist())
    return pd.DataFrame({"user": users, "events": events, "value_sum": value_sum})


def reference(batches) -> pd.DataFrame:
    """The rows both must emit, with batch_id."""
    totals: dict = {}
    out = []
    for b, batch in enumerate(batches):
        g = batch.groupby("user")["value"].agg(["size", "sum"])
        for user, n, s in zip(g.index, g["size"], g["sum"]):
            t = totals.get(user, (0, 0))
            t = (t[0] + int(n), t[1] + int(s))
            totals[user] = t
            out.append((user, t[0], t[1], b))
    return pd.DataFrame(out, columns=OUTPUT_COLS + ["batch_id"])
