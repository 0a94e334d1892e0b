"""Timer rounds (dstl.spark.timer_rounds): timers fire on an idle stream, as Spark's no-data batches
fire them. The fast test runs a real file-stream query in local mode; the rules are unit tests."""
from __future__ import annotations

import os
import time

import pandas as pd
import pytest

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
