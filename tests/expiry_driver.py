"""A StatefulStream job with a TTL'd state, a map state and processing-time timers, on an injected
clock (batch b runs at ``T0 + STEP * b``), for the state-as-data end-to-end tests; and the same
job's expected live state, timers and fired timers computed with pandas.

    python expiry_driver.py BASE INPUT_DIR SPARK_CHECKPOINT PARALLELISM SINK_LOG

runs a JSON file stream (one file per micro-batch, `availableNow`) through it, then exits 0; faults
come from DSTL_FAULTS (dstl.spark.faults), e.g. ``stream.after_checkpoint@2=kill``. The sink appends
`batch_id rows` to SINK_LOG once per call.
"""
from __future__ import annotations

import json
import os
import sys
from typing import Dict, List, Tuple

import numpy as np
import pandas as pd
from pyspark.sql.streaming.stateful_processor import StatefulProcessor

OUT = "user string, kind string, total long, hits long, expiry long"
INPUT_SCHEMA = "user string, v long"
T0, STEP = 10_000, 1_000
TTL_MS, TIMER_MS = 3_000, 2_000
#: which keys have input in batch b (keys stop arriving, so values expire and timers fire)
KEYS = [range(8), [0, 1, 2, 3, 8, 9], [0, 1, 2], [0, 4], [0, 1], [0, 5], [0]]


def batch_time(batch_id: int) -> int:
    return T0 + STEP * batch_id


class Expiring(StatefulProcessor):
    """Per user: `total` (sum of v since the value last expired; TTL 3 s), `hits` (rows per parity
    since the last timer) and one timer 2 s after the user's latest input, which clears `hits`."""

    def init(self, handle):
        self.handle = handle
        self.total = handle.getValueState("total", "n long", ttlDurationMs=TTL_MS)
        self.hits = handle.getMapState("hits", "parity string", "c long")

    def handleInputRows(self, key, rows, timerValues):
        now = timerValues.getCurrentProcessingTimeInMs()
        v = [int(x) for pdf in rows for x in pdf["v"]]
        old = self.total.get()
        total = (old[0] if old else 0) + sum(v)
        self.total.update((total,))
        for x in v:
            p = ("even",) if x % 2 == 0 else ("odd",)
            c = self.hits.getValue(p)
            self.hits.updateValue(p, ((c[0] if c else 0) + 1,))
        for ts in list(self.handle.listTimers()):
            self.handle.deleteTimer(ts)
        self.handle.registerTimer(now + TIMER_MS)
        n = sum(c for (c,) in self.hits.values())
        yield pd.DataFrame({"user": [key[0]], "kind": ["input"], "total": [total], "hits": [n], "expiry": [-1]})

    def handleExpiredTimer(self, key, timerValues, expiredTimerInfo):
        self.hits.clear()
        yield pd.DataFrame({"user": [key[0]], "kind": ["timer"], "total": [-1], "hits": [-1],
                            "expiry": [expiredTimerInfo.getExpiryTimeInMs()]})

    def close(self):
        pass


def batches(seed: int = 3) -> List[pd.DataFrame]:
    rng = np.random.default_rng(seed)
    out = []
    for keys in KEYS:
        users = [f"k{k}" for k in keys for _ in range(2)]
        out.append(pd.DataFrame({"user": users, "v": rng.integers(0, 100, len(users)).astype(np.int64)}))
    return out


Row = Tuple[int, str, int, int]


def expected(frames: List[pd.DataFrame]) -> Tuple[pd.DataFrame, pd.DataFrame, pd.DataFrame,
                                                 List[Tuple[int, str, int]], List[Row]]:
    """(live totals, live hits, registered timers, fired timers as (batch, user, expiry)) after all
    batches, judged at the last batch's time, and the input rows' output as (batch, user, total,
    hits), computed with pandas over the input."""
    total: Dict[str, Tuple[int, int]] = {}   # user -> (value, written at)
    hits: Dict[str, Dict[str, int]] = {}
    timer: Dict[str, int] = {}
    fired, rows = [], []
    for b, pdf in enumerate(frames):
        now = batch_time(b)
        sums = pdf.groupby("user")["v"].sum()
        parity = pdf.assign(p=np.where(pdf.v % 2 == 0, "even", "odd")).groupby(["user", "p"]).size()
        for user in sorted(sums.index):
            old = total.get(user)
            alive = old is not None and old[1] + TTL_MS > now
            total[user] = ((old[0] if alive else 0) + int(sums[user]), now)
            for p, c in parity[user].items():
                hits.setdefault(user, {})[p] = hits.get(user, {}).get(p, 0) + int(c)
            timer[user] = now + TIMER_MS
            rows.append((b, user, total[user][0], sum(hits[user].values())))
        for user, ts in sorted(timer.items(), key=lambda kv: (kv[1], kv[0])):
            if ts <= now:
                fired.append((b, user, ts))
                hits.pop(user, None)
                del timer[user]
    now = batch_time(len(frames) - 1)
    live = pd.DataFrame([(u, v) for u, (v, at) in total.items() if at + TTL_MS > now], columns=["key", "n"])
    h = pd.DataFrame([(u, p, c) for u, m in hits.items() for p, c in m.items()], columns=["key", "parity", "c"])
    t = pd.DataFrame(sorted(timer.items()), columns=["key", "timestamp_ms"])
    return (live.sort_values("key").reset_index(drop=True), h.sort_values(["key", "parity"]).reset_index(drop=True),
            t, fired, rows)


def write_inputs(directory: str, frames: List[pd.DataFrame]) -> None:
    os.makedirs(directory)
    for i, pdf in enumerate(frames):
        path = os.path.join(directory, f"part-{i:02d}.json")
        with open(path, "w") as fh:
            for rec in pdf.to_dict("records"):
                fh.write(json.dumps({"user": rec["user"], "v": int(rec["v"])}) + "\n")
        os.utime(path, (1_700_000_000 + i, 1_700_000_000 + i))  # file order = batch order


def make_stream(base: str, parallelism: int, **kw):
    from dstl.spark import StatefulStream

    holder = []
    stream = StatefulStream(base, Expiring(), OUT, key="user", parallelism=parallelism,
                            time_mode="ProcessingTime", clock=lambda: batch_time(holder[0].open().next_batch),
                            materialize_every=8, **kw)
    holder.append(stream)
    return stream


def main(argv) -> int:
    base, input_dir, ckpt, parallelism, sink_log = argv
    os.environ["PYSPARK_PYTHON"] = sys.executable
    from streaming_util import drain_file_stream, driver_session

    spark = driver_session("dstl-expiry-driver")

    def sink(df, batch_id):
        n = df.count()
        with open(sink_log, "a") as f:
            f.write(f"{batch_id} {n}\n")

    drain_file_stream(spark, make_stream(base, int(parallelism), sink=sink), INPUT_SCHEMA, input_dir, ckpt)
    return 0


if __name__ == "__main__":
    sys.exit(main(sys.argv[1:]))
