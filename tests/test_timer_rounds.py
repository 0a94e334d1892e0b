"""Timer rounds (dstl.spark.timer_rounds): timers fire on an idle stream, as Spark's no-data batches
fire them. The fast test runs a real file-stream query in local mode; the rules are unit tests."""
from __future__ import annotations

import os
import time

import pandas as pd
import pytest

from conftest import heavy

from dstl.spark.timer_rounds import round_due, spark_position
from idle_processors import IDLE_OUTPUT, IdleTimeout
from streaming_util import read_output, read_stream, write_json_batch


def test_spark_position_numbers_old_checkpoints_alike_and_follows_recorded_ones():
    assert spark_position(None) == (-1, -1)
    assert spark_position({"batch": 4}) == (4, 4)
    assert spark_position({"batch": 6, "last_spark_batch_id": 4, "last_spark_batch": 5}) == (4, 5)


def test_round_due_follows_spark_should_run_another_batch():
    assert round_due("ProcessingTime", {"batch": 0}) is True
    assert round_due("None", {"batch": 0}) is False
    assert round_due("ProcessingTime", None) is False
    assert round_due("EventTime", {"watermark_ms": 5000, "batch_watermark_ms": 0}) is True
    assert round_due("EventTime", {"watermark_ms": 5000, "batch_watermark_ms": 5000}) is False


def test_timer_interval_is_checked():
    from dstl.spark import StatefulStream

    with pytest.raises(ValueError, match="timer_interval needs time_mode"):
        StatefulStream("/tmp/x", IdleTimeout(), IDLE_OUTPUT, key="user", parallelism=1, timer_interval="1 second")
    with pytest.raises(ValueError, match="timer_interval must be a positive interval"):
        StatefulStream("/tmp/x", IdleTimeout(), IDLE_OUTPUT, key="user", parallelism=1,
                       time_mode="ProcessingTime", timer_interval=0)


def test_processing_time_timer_fires_on_an_idle_stream(spark, tmp_path):
    """One file, then nothing: the 3 s timeouts fire in a timer round, delivered once to the sink."""
    from dstl.spark import StatefulStream

    src = tmp_path / "in"
    src.mkdir()
    write_json_batch(str(src), 0, pd.DataFrame({"user": ["a", "a", "b"], "kind": ["x"] * 3,
                                                "value": [1, 2, 3], "ts_ms": [1000, 2000, 3000]}))
    calls = []
    base = str(tmp_path / "job")
    stream = StatefulStream(base, IdleTimeout(), IDLE_OUTPUT, key="user", parallelism=2,
                            time_mode="ProcessingTime", timer_interval="1 second",
                            sink=lambda df, b: calls.append((b, sorted(map(tuple, df.collect())))))
    query = (read_stream(spark, str(src)).writeStream.foreachBatch(stream)
             .option("checkpointLocation", str(tmp_path / "ckpt")).trigger(processingTime="1 second").start())
    try:
        deadline = time.monotonic() + 60
        while time.monotonic() < deadline and not any(rows for _, rows in calls):
            time.sleep(0.5)
    finally:
        query.stop()
        stream.close()
    assert not stream._rounds.running
    fired = [(b, rows) for b, rows in calls if rows]
    assert fired == [(fired[0][0], [("a", "timed out after 2"), ("b", "timed out after 1")])]
    ids = [b for b, _ in calls]
    assert ids == list(range(len(ids))), "one dstl batch number per Spark batch and timer round, in order"
    assert fired[0][0] >= 1  # a round after Spark's batch 0
    out = read_output(os.path.join(base, "output"))
    assert sorted(zip(out["batch_id"], out["user"], out["message"])) == [
        (fired[0][0], "a", "timed out after 2"), (fired[0][0], "b", "timed out after 1")]
    # a round's checkpoint records Spark's last batch: the query's next id is still 1
    from dstl.state.metadata import latest_checkpoint

    assert spark_position(latest_checkpoint(base).properties)[0] == 0


# ---------------------------------------------------------------- against Spark's operator (heavy)
IDLE_S = 14  # the idle period after the one input file


def _events(src) -> None:
    src.mkdir()
    write_json_batch(str(src), 0, pd.DataFrame({"user": ["a", "a", "b"], "kind": ["x"] * 3,
                                                "value": [1, 2, 3], "ts_ms": [1000, 2000, 3000]}))


def _collect_until_idle(query, seen, first_rows_at):
    """Let the query run IDLE_S seconds after its first batch; return (rows, seconds after the
    first batch each row arrived)."""
    deadline = time.monotonic() + 120
    while time.monotonic() < deadline and not first_rows_at:
        time.sleep(0.2)
    time.sleep(max(0.0, first_rows_at[0] + IDLE_S - time.monotonic()) if first_rows_at else 0)
    query.stop()
    return sorted((u, m) for _, u, m, _ in seen), [t - first_rows_at[0] for _, _, _, t in seen]


def _sink(seen, first):
    def sink(df, batch_id):
        now = time.monotonic()
        if not first:
            first.append(now)
        for r in df.collect():
            seen.append((batch_id, r["user"], r["message"], now))
    return sink


def _native(spark, src, processor, time_mode, api, ckpt):
    from streaming_util import NATIVE_CONF, spark_conf

    seen, first = [], []
    conf = dict(NATIVE_CONF, **{"spark.sql.streaming.noDataMicroBatches.enabled": "true"})
    with spark_conf(spark, conf):
        events = read_stream(spark, str(src))
        if time_mode == "EventTime":
            events = events.withWatermark("ts", "0 seconds")
        grouped = events.groupBy("user")
        op = grouped.transformWithState if api == "row" else grouped.transformWithStateInPandas
        out = op(processor, IDLE_OUTPUT, "Update", time_mode)
        query = (out.writeStream.foreachBatch(_sink(seen, first)).option("checkpointLocation", ckpt)
                 .trigger(processingTime="1 second").start())
        return _collect_until_idle(query, seen, first)


def _dstl(spark, src, processor, time_mode, api, base, ckpt):
    from dstl.spark import StatefulStream

    seen, first = [], []
    extra = {"event_time_column": "ts", "watermark_delay": 0} if time_mode == "EventTime" else {}
    stream = StatefulStream(base, processor, IDLE_OUTPUT, key="user", parallelism=2, time_mode=time_mode,
                            api=api, timer_interval="1 second", sink=_sink(seen, first), **extra)
    query = (read_stream(spark, str(src)).writeStream.foreachBatch(stream)
             .option("checkpointLocation", ckpt).trigger(processingTime="1 second").start())
    try:
        return _collect_until_idle(query, seen, first)
    finally:
        stream.close()


@heavy
@pytest.mark.parametrize("time_mode", ["ProcessingTime", "EventTime"])
@pytest.mark.parametrize("api", ["pandas", "row"])
def test_idle_stream_gives_spark_operator_rows(spark, tmp_path, time_mode, api):
    """One file, then 14 s of nothing under a 1 s trigger: the same timer rows as Spark's
    transformWithState(InPandas), and (ProcessingTime) within one trigger interval of Spark's time."""
    import idle_processors as ip

    name = {"ProcessingTime": "IdleTimeout", "EventTime": "IdleSessionClose"}[time_mode]
    processor = getattr(ip, ("Row" if api == "row" else "") + name)
    src = tmp_path / "in"
    _events(src)
    native_rows, native_at = _native(spark, src, processor(), time_mode, api, str(tmp_path / "native-ckpt"))
    dstl_rows, dstl_at = _dstl(spark, src, processor(), time_mode, api, str(tmp_path / "job"),
                               str(tmp_path / "dstl-ckpt"))
    assert native_rows == [("a", "timed out after 2"), ("b", "timed out after 1")]
    assert dstl_rows == native_rows
    import sys

    sys.stderr.write(f"\n{time_mode}/{api}: timer rows at +{max(native_at):.1f} s (Spark), "
                     f"+{max(dstl_at):.1f} s (dstl), after the first batch's sink call\n")
    # both measured from the first batch's sink call; one trigger interval plus a round's own time
    assert max(dstl_at) <= max(native_at) + 1.0 + 3.0, (dstl_at, native_at)
