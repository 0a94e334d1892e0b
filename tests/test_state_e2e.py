"""Issue 12's end-to-end test: a StatefulStream job with a TTL'd state, a map state and timers runs
through driver crashes (replayed batches), parallelism changes and an offline max-parallelism
rescale on an injected clock, then `read_state` and `read_timers` equal the live state and timers
computed with pandas from the input (keys, values, TTL expiry), and each timer fired exactly once.

The in-process version (crashes raised at the fault points, Spark's replays done by hand) runs under
both implementations; the real thing (a Structured Streaming driver SIGKILLed twice, restarted at
other parallelisms) runs once, under the Cython build.
"""
from __future__ import annotations

import json
import os
import signal

import pandas as pd
import pytest

pytest.importorskip("pyspark")

from pyspark import cloudpickle  # noqa: E402

from conftest import heavy  # noqa: E402
from driver_util import run_driver  # noqa: E402

import expiry_driver  # noqa: E402
from expiry_driver import batch_time, batches, expected, make_stream  # noqa: E402

cloudpickle.register_pickle_by_value(expiry_driver)

pytestmark = pytest.mark.spark



def _check(spark, base, frames):
    """read_state / read_timers (Spark and pandas readers) and the output rows against pandas; returns
    the output."""
    from dstl.spark import read_state, read_timers
    from dstl.state import read_state_pandas, read_timers_pandas

    live, hits, timers, fired, rows = expected(frames)
    now = batch_time(len(frames) - 1)
    assert len(live) and len(live) < 10 and len(fired) and len(timers)  # expiry and timers did happen

    got = read_state(spark, base, "total", now_ms=now).toPandas()
    got = got[["key", "n"]].sort_values("key").reset_index(drop=True)
    pd.testing.assert_frame_equal(got, live, check_dtype=False)
    got = read_state_pandas(base, "total", now_ms=now)[["key", "n"]].sort_values("key").reset_index(drop=True)
    pd.testing.assert_frame_equal(got, live, check_dtype=False)
    # without the TTL filter at the last batch's time, expired values would show up (if not purged)
    everything = read_state_pandas(base, "total", now_ms=0)
    assert set(live.key) <= set(everything.key)

    h = read_state(spark, base, "hits", now_ms=now).toPandas()
    h = h.assign(parity=h.user_key.map(json.loads))[["key", "parity", "c"]]
    pd.testing.assert_frame_equal(h.sort_values(["key", "parity"]).reset_index(drop=True), hits, check_dtype=False)

    t = read_timers(spark, base).toPandas()[["key", "timestamp_ms"]].sort_values("key").reset_index(drop=True)
    pd.testing.assert_frame_equal(t, timers, check_dtype=False)
    t = read_timers_pandas(base)[["key", "timestamp_ms"]].sort_values("key").reset_index(drop=True)
    pd.testing.assert_frame_equal(t, timers, check_dtype=False)

    import pyarrow.dataset as ds

    out = ds.dataset(os.path.join(base, "output"), format="parquet", partitioning="hive").to_table().to_pandas()
    timer_rows, input_rows = out[out.kind == "timer"], out[out.kind == "input"]
    got_fired = sorted(zip(timer_rows.batch_id.astype(int), timer_rows.user, timer_rows.expiry.astype(int)))
    assert got_fired == sorted(fired)  # each timer fired once, in the batch pandas says
    got_rows = sorted(zip(input_rows.batch_id.astype(int), input_rows.user, input_rows.total.astype(int),
                          input_rows.hits.astype(int)))
    assert got_rows == sorted(rows)  # every input row's output exactly once
    assert len(out) == len(fired) + len(rows)
    return out


@heavy
def test_crashes_rescales_and_ttl_then_read_state_equals_pandas(spark, tmp_path):
    from dstl.spark import faults
    from dstl.state.rescale import rescale_checkpoint

    base = str(tmp_path / "job")
    frames = batches()
    sdf = [spark.createDataFrame(f, expiry_driver.INPUT_SCHEMA) for f in frames]

    s = make_stream(base, 2)
    s(sdf[0], 0)
    s(sdf[1], 1)
    with faults.armed("stream.after_checkpoint@2=raise"), pytest.raises(faults.InjectedFault):
        s(sdf[2], 2)                                 # checkpoint durable, output not committed
    s = make_stream(base, 3)                         # the restarted driver, another parallelism
    assert s(sdf[2], 2).replayed                     # Spark replays batch 2: output committed, no state change
    s(sdf[3], 3)
    with faults.armed("stream.after_sink@4=raise"), pytest.raises(faults.InjectedFault):
        s(sdf[4], 4)
    s.close()
    rescale_checkpoint(base, 256, parallelism=2)     # offline: 128 -> 256 key groups, timers included
    s = make_stream(base, 1)
    assert s(sdf[4], 4).replayed
    assert s.max_parallelism_in_use == 256
    s(sdf[5], 5)
    s(sdf[6], 6)
    s.close()
    _check(spark, base, frames)


@heavy
def test_sigkilled_driver_rescaled_then_read_state_and_timers_equal_pandas(spark, tmp_path):
    """A real Structured Streaming driver with timers and TTL, SIGKILLed once its checkpoint is durable
    but before its output commit and sink, then restarted at another parallelism and max
    parallelism: every output row exact, the sink called once per batch, state and timers exact.
    (A kill at every step of a batch, timers aside, is tests/test_kill_steps.py's chain.)"""
    from dstl.state.rescale import rescale_checkpoint

    base, inputs, ckpt, sink_log = (str(tmp_path / n) for n in ("job", "in", "spark-ckpt", "sink.log"))
    frames = batches()
    expiry_driver.write_inputs(inputs, frames)
    # 1: SIGKILL after batch 2's checkpoint is durable, before its output commit and sink
    rc, out = run_driver("expiry_driver.py", [base, inputs, ckpt, "2", sink_log], "stream.after_checkpoint@2=kill")
    assert rc == -signal.SIGKILL, out[-3000:]
    # 2: offline max-parallelism change, then restart at parallelism 3: Spark replays batch 2 (its
    # checkpoint is there: the output is committed and the sink called) and finishes
    rescale_checkpoint(base, 256, parallelism=2)
    rc, out = run_driver("expiry_driver.py", [base, inputs, ckpt, "3", sink_log], None)
    assert rc == 0, out[-3000:]
    out = _check(spark, base, frames)

    with open(sink_log) as fh:
        calls = [tuple(map(int, line.split())) for line in fh if line.strip()]
    assert [b for b, _ in calls] == list(range(len(frames)))  # every batch reached the sink once
    rows = out.batch_id.astype(int).value_counts()
    assert [n for _, n in calls] == [int(rows.get(b, 0)) for b in range(len(frames))]
    assert min(n for _, n in calls) > 0
