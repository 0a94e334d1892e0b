"""StatefulStream on real Spark (local mode): a StatefulProcessor with all three state kinds, exactly
once with Spark's batch ids (crashes at the two worst moments, then resume at another parallelism),
timers and TTL across rescales 2 -> 3 -> 1, and the friction cases of the trial."""
from __future__ import annotations

import sys

import pandas as pd
import pytest

from conftest import heavy, heavy_twins

pytest.importorskip("pyspark")

from pyspark import cloudpickle  # noqa: E402
StatefulProcessor = pytest.importorskip(  # noqa: E402
    "pyspark.sql.streaming.stateful_processor",
    reason="StatefulProcessor needs PySpark 4 (its transformWithState API)").StatefulProcessor

from dstl.spark import StatefulStream  # noqa: E402
from dstl.spark import faults  # noqa: E402
from dstl.spark.coordinator import JobConflictError  # noqa: E402
from dstl.spark.stream import NullKeyError, StreamGapError  # noqa: E402

import stream_driver  # noqa: E402
from stream_driver import OUT, Counting  # noqa: E402

# the processors live in test modules, which Spark's Python workers cannot import
cloudpickle.register_pickle_by_value(sys.modules[__name__])
cloudpickle.register_pickle_by_value(stream_driver)


def _batch(b: int, users=8, rows=24) -> pd.DataFrame:
    return pd.DataFrame({"user": [f"u{(b * 5 + i) % users}" for i in range(rows)],
                         "v": [b * 1000 + i for i in range(rows)]})


def _expected_counting(batches) -> pd.DataFrame:
    """What Counting emits, computed with pandas over all input."""
    out = []
    seen = pd.DataFrame(columns=["user", "v"])
    for b, pdf in batches:
        seen = pd.concat([seen, pdf], ignore_index=True)
        for user in sorted(pdf["user"].unique()):
            mine = seen[seen["user"] == user]["v"].astype(int)
            out.append({"batch_id": b, "user": user, "n": len(mine), "items": len(mine),
                        "buckets": int(mine.mod(2).nunique()), "evens": int((mine % 2 == 0).sum())})
    return pd.DataFrame(out)


def _read_output(spark, path) -> pd.DataFrame:
    got = spark.read.parquet(path).toPandas()
    cols = ["batch_id", "user", "n", "items", "buckets", "evens"]
    return got[cols].sort_values(["batch_id", "user"]).reset_index(drop=True).astype(
        {c: "int64" for c in cols if c != "user"})


def _sdf(spark, pdf):
    return spark.createDataFrame(pdf, "user string, v long")


@heavy
def test_processor_runs_unchanged_rescales_and_replays_change_nothing(spark, tmp_path):
    base = str(tmp_path / "job")
    batches = [(b, _batch(b)) for b in range(5)]
    stream = StatefulStream(base, Counting(), OUT, key="user", parallelism=2)
    results = [stream(_sdf(spark, pdf), b) for b, pdf in batches[:3]]  # as foreachBatch calls it
    assert [r.batch_id for r in results] == [0, 1, 2]
    assert results[0].restored == 0  # a fresh job restores nothing
    # one task per subtask, in local mode all on the driver's executor; after the first batch each
    # continues from its worker's memory or (another of the executor's Python workers) restores
    later = [rep for r in results[1:] for rep in r.reports]
    assert [rep.subtask for r in results for rep in r.reports] == [0, 1] * 3
    assert all(rep.executor == "driver" for r in results for rep in r.reports)
    assert all(rep.continued != rep.restored for rep in later)
    assert all(r.stats.placement["warm"] + r.stats.placement["restored"] == 2 for r in results[1:])

    # a replayed batch id (Spark re-running batch 2) changes no state
    replay = stream(_sdf(spark, batches[2][1]), 2)
    assert replay.replayed and replay.rows_in == 0
    with pytest.raises(StreamGapError, match="batch 4 arrived.*batches up to 2"):
        stream(_sdf(spark, batches[4][1]), 4)

    # another process resumes at another parallelism: rescale, timers and all
    rescaled = StatefulStream(base, Counting(), OUT, key="user", parallelism=3)
    r3 = rescaled.run(_sdf(spark, batches[3][1]))
    assert r3.batch_id == 3 and r3.restored == 3
    r4 = StatefulStream(base, Counting(), OUT, key="user", parallelism=1).run(_sdf(spark, batches[4][1]))
    assert r4.restored == 1
    # after run(), a query whose ids start over would skip rows silently: an error instead
    with pytest.raises(StreamGapError, match="from run\\(\\)"):
        StatefulStream(base, Counting(), OUT, key="user", parallelism=1)(_sdf(spark, batches[0][1]), 0)

    got = _read_output(spark, base + "/output")
    pd.testing.assert_frame_equal(got, _expected_counting(batches), check_dtype=False)
    # the state schemas are recorded with each checkpoint (for tools that read state)
    from dstl.state.metadata import latest_checkpoint

    schemas = latest_checkpoint(base).properties["state_schemas"]
    assert schemas["count"]["value_ddl"] == "n bigint" and schemas["parity"]["user_key_ddl"] == "p string"
    assert latest_checkpoint(base).properties["spark_batch_id"] == 4


@heavy_twins
def test_exactly_once_across_crashes_at_the_two_worst_moments(spark, tmp_path):
    """In-process crashes (the SIGKILL version, with timers and TTL, is in test_state_e2e.py): after
    the checkpoint is durable and before the sink; after the sink and before Spark commits. Each
    restart is a new StatefulStream (a new driver) at another parallelism, and Spark replays the
    batch id."""
    base = str(tmp_path / "job")
    batches = [(b, _batch(b)) for b in range(4)]
    calls = []

    def sink(df, batch_id):
        calls.append((batch_id, df.toPandas()))

    def stream(p):
        return StatefulStream(base, Counting(), OUT, key="user", parallelism=p, sink=sink)

    s = stream(2)
    s(_sdf(spark, batches[0][1]), 0)
    with faults.armed("stream.after_checkpoint@1=raise"):
        with pytest.raises(faults.InjectedFault):
            s(_sdf(spark, batches[1][1]), 1)
    assert [b for b, _ in calls] == [0]  # checkpoint 2 durable, batch 1 not delivered

    s = stream(3)  # restart; Spark replays batch 1
    r = s(_sdf(spark, batches[1][1]), 1)
    assert r.replayed and r.sink_called
    with faults.armed("stream.after_sink@2=raise"):
        with pytest.raises(faults.InjectedFault):
            s(_sdf(spark, batches[2][1]), 2)

    s = stream(1)  # restart; Spark replays batch 2, whose sink already returned
    r = s(_sdf(spark, batches[2][1]), 2)
    assert r.replayed and not r.sink_called
    s(_sdf(spark, batches[3][1]), 3)
    s.close()

    assert [b for b, _ in calls] == [0, 1, 2, 3]  # each batch delivered exactly once
    delivered = pd.concat([df.assign(batch_id=b) for b, df in calls], ignore_index=True)
    cols = ["batch_id", "user", "n", "items", "buckets", "evens"]
    delivered = delivered[cols].sort_values(["batch_id", "user"]).reset_index(drop=True)
    expected = _expected_counting(batches)
    pd.testing.assert_frame_equal(delivered, expected, check_dtype=False)
    pd.testing.assert_frame_equal(_read_output(spark, base + "/output"), expected, check_dtype=False)


class TimerTtl(StatefulProcessor):
    """Processing-time timers and TTL: each input (re)arms the key's timer 1 s after the batch time;
    a fired timer emits a row. `last` has a 1 s TTL; the output says whether it was still there."""

    def init(self, handle):
        self.handle = handle
        self.last = handle.getValueState("last", "v long", ttlDurationMs=1000)
        self.hist = handle.getListState("hist", "v long", ttlDurationMs=1000)
        self.tags = handle.getMapState("tags", "t string", "v long", ttlDurationMs=1000)

    def handleInputRows(self, key, rows, timerValues):
        now = timerValues.getCurrentProcessingTimeInMs()
        had = self.last.exists()
        hist = len(list(self.hist.get()))
        tags = len(list(self.tags.keys()))
        for pdf in rows:
            v = int(pdf["v"].iloc[-1])
        for ts in list(self.handle.listTimers()):
            self.handle.deleteTimer(ts)
        self.handle.registerTimer(now + 1000)
        self.last.update((v,))
        self.hist.appendValue((v,))
        self.tags.updateValue((f"t{v % 2}",), (v,))
        yield pd.DataFrame({"user": [key[0]], "kind": ["input"], "now": [now], "expiry": [-1],
                            "had": [had], "hist": [hist], "tags": [tags]})

    def handleExpiredTimer(self, key, timerValues, expiredTimerInfo):
        yield pd.DataFrame({"user": [key[0]], "kind": ["timer"], "now": [timerValues.getCurrentProcessingTimeInMs()],
                            "expiry": [expiredTimerInfo.getExpiryTimeInMs()], "had": [self.last.exists()],
                            "hist": [-1], "tags": [-1]})

    def close(self):
        pass


TIMER_OUT = "user string, kind string, now long, expiry long, had boolean, hist long, tags long"


@heavy_twins
def test_timers_and_ttl_across_rescale_2_3_1(spark, tmp_path):
    base = str(tmp_path / "job")
    clock = {"now": 10_000}
    keys = [f"k{i}" for i in range(10)]

    def run(p, users):
        s = StatefulStream(base, TimerTtl(), TIMER_OUT, key="user", parallelism=p,
                           time_mode="ProcessingTime", clock=lambda: clock["now"])
        pdf = pd.DataFrame({"user": users, "v": list(range(len(users)))})
        return s.run(spark.createDataFrame(pdf, "user string, v long")), s

    r0, _ = run(2, keys)                      # t=10 000: every key armed for 11 000
    clock["now"] = 10_500
    r1, _ = run(3, keys[:5])                  # k0..k4 re-armed for 11 500 (their 11 000 timers deleted)
    clock["now"] = 11_200
    r2, _ = run(1, [])                        # k5..k9 fire (11 000); the deleted ones must not
    clock["now"] = 12_000
    r3, _ = run(2, ["k0"])                    # k1..k4 fire (11 500); k0 re-armed first (data before timers)
    clock["now"] = 13_000
    r4, s = run(2, [])                        # k0 fires (13 000)
    assert [r.timers_fired for r in (r0, r1, r2, r3, r4)] == [0, 0, 5, 4, 1]

    out = s.spark_output = spark.read.parquet(base + "/output").toPandas()
    fired = out[out.kind == "timer"].sort_values(["batch_id", "user"])
    assert list(zip(fired.batch_id, fired.user, fired.expiry, fired.now)) == (
        [(2, k, 11_000, 11_200) for k in keys[5:]] + [(3, k, 11_500, 12_000) for k in keys[1:5]]
        + [(4, "k0", 13_000, 13_000)])
    # each timer fired exactly once
    assert not fired.duplicated(["user", "expiry"]).any()
    inputs = out[out.kind == "input"].set_index(["batch_id", "user"])
    # TTL 1 s: at 10 500 the values written at 10 000 are alive; at 12 000 k0's (10 500) expired
    assert inputs.loc[(1, "k0")].tolist()[3:] == [True, 1, 1]
    assert inputs.loc[(3, "k0")].tolist()[3:] == [False, 0, 0]
    # a timer at 11 200 sees k5's value of 10 000 expired; k1's at 12 000 too
    assert not fired.had.any()


class Sessions(StatefulProcessor):
    """Event-time sessions: a session closes when the watermark passes its last event + 10 s."""

    GAP = 10_000

    def init(self, handle):
        self.handle = handle
        self.state = handle.getValueState("session", "start long, last long, n long")

    def handleInputRows(self, key, rows, timerValues):
        start, last, n = self.state.get() if self.state.exists() else (None, None, 0)
        for pdf in rows:
            ts = pdf["t"].astype("int64").tolist()
            start = min(ts) if start is None else min(start, min(ts))
            last = max(ts) if last is None else max(last, max(ts))
            n += len(ts)
        for old in list(self.handle.listTimers()):
            self.handle.deleteTimer(old)
        self.handle.registerTimer(last + self.GAP)
        self.state.update((start, last, n))
        return iter([])

    def handleExpiredTimer(self, key, timerValues, expiredTimerInfo):
        start, last, n = self.state.get()
        self.state.clear()
        yield pd.DataFrame({"user": [key[0]], "start": [start], "last": [last], "n": [n],
                            "watermark": [timerValues.getCurrentWatermarkInMs()]})

    def close(self):
        pass


@heavy
def test_event_time_sessions_watermark_and_late_rows(spark, tmp_path):
    base = str(tmp_path / "job")

    def run(p, rows):
        s = StatefulStream(base, Sessions(), "user string, start long, last long, n long, watermark long",
                           key="user", parallelism=p, time_mode="EventTime", event_time_column="t",
                           watermark_delay="5 seconds")
        return s.run(spark.createDataFrame(pd.DataFrame(rows, columns=["user", "t"]), "user string, t long"))

    # Spark's rule: rows at or before the previous batch's watermark are late; timers fire against this one's
    r0 = run(2, [("a", 100_000), ("a", 101_000), ("b", 100_500)])
    assert r0.watermark_ms == 96_000 and r0.timers_fired == 0          # 101 000 - 5 s
    r1 = run(3, [("a", 104_000), ("b", 95_000), ("c", 120_000)])       # late-events watermark 0: b's 95 000 counts
    assert r1.late_rows == 0 and r1.watermark_ms == 115_000
    r2 = run(1, [("c", 121_000)])                                     # wm 115 000: a (114 000) and b (110 500) close
    assert r2.timers_fired == 2
    r3 = run(2, [("d", 140_000), ("e", 115_000)])                     # e is at the late-events watermark: late
    r4 = run(2, [("d", 141_000)])                                     # wm 135 000: c closes
    assert (r3.timers_fired, r4.timers_fired, r3.late_rows) == (0, 1, 1)
    out = spark.read.parquet(base + "/output").toPandas().sort_values(["batch_id", "user"])
    assert list(zip(out["batch_id"], out["user"], out["start"], out["last"], out["n"], out["watermark"])) == [
        (2, "a", 100_000, 104_000, 3, 115_000), (2, "b", 95_000, 100_500, 2, 115_000),
        (4, "c", 120_000, 121_000, 2, 135_000)]
    from dstl.state.metadata import latest_checkpoint

    assert latest_checkpoint(base).properties["watermark_ms"] == 136_000


@heavy  # argument and conflict checks: the same Python under both builds
def test_friction_null_keys_conflicts_and_errors(spark, tmp_path):
    base = str(tmp_path / "job")
    pdf = pd.DataFrame({"user": ["a", None, "b", None], "v": [1, 2, 3, 4]})
    s = StatefulStream(base, Counting(), OUT, key="user", parallelism=2)
    with pytest.raises(NullKeyError, match=r"key column 'user' has 2 null value\(s\) in batch 0"):
        s.run(_sdf(spark, pdf))
    dropping = StatefulStream(base, Counting(), OUT, key="user", parallelism=2, null_keys="drop")
    r = dropping.run(_sdf(spark, pdf))
    assert r.batch_id == 0 and r.null_rows == 2 and r.rows_in == 2 and r.rows_out == 2

    with pytest.raises(JobConflictError, match="max parallelism 128"):
        StatefulStream(base, Counting(), OUT, key="user", parallelism=2, max_parallelism=256).open()
    with pytest.raises(JobConflictError, match="key='user'"):
        StatefulStream(base, Counting(), OUT, key="v", parallelism=2).open()
    with pytest.raises(JobConflictError, match="exceeds the job's max parallelism"):
        StatefulStream(base, Counting(), OUT, key="user", parallelism=200).open()
    with pytest.raises(ValueError, match="key column 'nope'"):
        StatefulStream(str(tmp_path / "j2"), Counting(), OUT, key="nope", parallelism=1).run(_sdf(spark, pdf))
    with pytest.raises(ValueError, match="needs event_time_column"):
        StatefulStream(base, Counting(), OUT, key="user", parallelism=1, time_mode="EventTime")
    with pytest.raises(ValueError, match="time_mode"):
        StatefulStream(base, Counting(), OUT, key="user", parallelism=1, time_mode="Wallclock")
    with pytest.raises(ValueError, match="parallelism 4 exceeds max_parallelism 2"):
        StatefulStream(base, Counting(), OUT, key="user", parallelism=4, max_parallelism=2)
    with pytest.raises(ValueError, match="output_schema"):
        StatefulStream(base, Counting(), "user strang", key="user", parallelism=1)
    with pytest.raises(StreamGapError, match="has completed no batch yet"):
        StatefulStream(str(tmp_path / "j3"), Counting(), OUT, key="user", parallelism=1)(_sdf(spark, pdf), 3)


# the fast tier's end-to-end StatefulStream (FAST_SPARK in conftest.py)
def test_vectorised_function_and_initial_state(spark, tmp_path):
    """The vectorised contract fn(rows, state) and handleInitialState from initial_state=."""
    base = str(tmp_path / "vec")

    def totals(rows, state):
        sums = rows.groupby("user")["v"].sum()
        st = state.value_state("total")
        new = [st.get(u, 0) + int(v) for u, v in sums.items()]
        st.update_many(list(sums.index), new)
        return pd.DataFrame({"user": list(sums.index), "total": new})

    s = StatefulStream(base, totals, "user string, total long", key="user", parallelism=2)
    s.run(_sdf(spark, pd.DataFrame({"user": ["a", "b", "a"], "v": [1, 2, 3]})))
    s.run(pd.DataFrame({"user": ["a"], "v": [10]}))  # a pandas batch works too
    out = spark.read.parquet(base + "/output").toPandas().sort_values(["batch_id", "user"])
    assert list(zip(out.batch_id, out.user, out.total)) == [(0, "a", 4), (0, "b", 2), (1, "a", 14)]

    class Seeded(Counting):
        def handleInitialState(self, key, initialState, timerValues):
            self.count.update((int(initialState["n"].sum()),))

    base2 = str(tmp_path / "seeded")
    init = spark.createDataFrame(pd.DataFrame({"user": ["u0", "zz"], "n": [100, 7]}))
    s2 = StatefulStream(base2, Seeded(), OUT, key="user", parallelism=2, initial_state=init)
    s2.run(_sdf(spark, pd.DataFrame({"user": ["u0"], "v": [1]})))
    s2.run(_sdf(spark, pd.DataFrame({"user": ["u0", "zz"], "v": [2, 3]})))  # not applied twice
    got = spark.read.parquet(base2 + "/output").toPandas().sort_values(["batch_id", "user"])
    assert list(zip(got.batch_id, got.user, got.n)) == [(0, "u0", 101), (1, "u0", 102), (1, "zz", 8)]
