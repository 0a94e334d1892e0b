"""StatefulStream and checkpoints on local Spark: `resume_from` rolls back to a retained checkpoint
(later batches' output under `_rolled_back/`, their sink markers dropped, so the redone batches reach
the sink once more, and the result is exact); `retain` is honoured; a job bootstrapped by
`bootstrap_state` (checkpoint 1, batch -1) continues with Spark's batch 0; checkpoint ids that run
ahead of batch ids (bootstrap, offline rescale) map through the recorded Spark batch id."""
from __future__ import annotations

import glob
import os
import sys

import pandas as pd
import pytest

from conftest import heavy, heavy_twins

pytest.importorskip("pyspark")

from pyspark import cloudpickle  # noqa: E402

from dstl.spark import StatefulStream  # noqa: E402
from dstl.spark.coordinator import JobConflictError  # noqa: E402
from dstl.spark.stream import StreamGapError  # noqa: E402
from dstl.state.metadata import latest_checkpoint, list_checkpoints  # noqa: E402

import stream_driver  # noqa: E402
from stream_driver import OUT, Counting  # noqa: E402

cloudpickle.register_pickle_by_value(stream_driver)

pytestmark = pytest.mark.spark

SCHEMA = "user string, v long"


def _batch(b: int, users=6, rows=12, salt=0) -> pd.DataFrame:
    return pd.DataFrame({"user": [f"u{(b * 5 + i) % users}" for i in range(rows)],
                         "v": [salt + b * 1000 + i for i in range(rows)]})


def _counts(frames) -> dict:
    """What Counting's `count` state holds after these input frames (pandas)."""
    return pd.concat(frames).groupby("user").size().to_dict()


@heavy
def test_resume_from_rolls_back_and_redoes_later_batches_once(spark, tmp_path):
    from dstl.state import read_state_pandas

    base = str(tmp_path / "job")
    calls = []

    def sink(df, batch_id):
        calls.append((batch_id, df.count()))

    s = StatefulStream(base, Counting(), OUT, key="user", parallelism=2, sink=sink, retain=10)
    first = [_batch(b) for b in range(6)]
    for b, pdf in enumerate(first):
        assert s(spark.createDataFrame(pdf, SCHEMA), b).batch_id == b  # as a query's foreachBatch
    s.close()
    assert list_checkpoints(base) == [1, 2, 3, 4, 5, 6]
    assert [b for b, _ in calls] == [0, 1, 2, 3, 4, 5]

    # roll back to checkpoint 3 (batch 2), at another parallelism; batches 3.. get other input
    r = StatefulStream(base, Counting(), OUT, key="user", parallelism=3, sink=sink, retain=10, resume_from=3)
    coord = r.open()
    assert coord.rolled_back.abandoned == [4, 5, 6] and sorted(coord.rolled_back.moved_batches) == [3, 4, 5]
    assert list_checkpoints(base) == [1, 2, 3] and coord.next_batch == 3
    moved = sorted(os.path.basename(p) for p in glob.glob(base + "/output/_rolled_back/*/batch_id=*"))
    assert moved == ["batch_id=3", "batch_id=4", "batch_id=5"]
    assert sorted(os.path.basename(p) for p in glob.glob(base + "/output/batch_id=*")) == \
        ["batch_id=0", "batch_id=1", "batch_id=2"]
    # a replayed id changes nothing; an id beyond the next one is a gap
    assert r(spark.createDataFrame(first[1], SCHEMA), 1).replayed
    with pytest.raises(StreamGapError, match="was rolled back to checkpoint 3 .* must deliver batch 3 next"):
        r(spark.createDataFrame(first[5], SCHEMA), 5)
    again = [_batch(b, salt=7) for b in range(3, 6)]
    for b, pdf in zip(range(3, 6), again):
        res = r(spark.createDataFrame(pdf, SCHEMA), b)
        assert (res.batch_id, res.checkpoint_id, res.sink_called) == (b, b + 1, True)
    r.close()
    assert [b for b, _ in calls] == [0, 1, 2, 3, 4, 5, 3, 4, 5]  # each redone batch delivered once more

    # the output and the state are exactly those of batches 0..2 then the new 3..5
    out = spark.read.parquet(base + "/output").toPandas()
    assert sorted(out.batch_id.unique().tolist()) == [0, 1, 2, 3, 4, 5]
    final = out.sort_values("batch_id").groupby("user")["n"].last().to_dict()
    expected = _counts(first[:3] + again)
    assert final == expected
    state = read_state_pandas(base, "count")
    assert dict(zip(state.key, state.n)) == expected

    # retain is honoured: with 2, only the last two checkpoints stay, and an older one cannot be chosen
    k = StatefulStream(base, Counting(), OUT, key="user", parallelism=2, retain=2)
    k.run(spark.createDataFrame(_batch(6), SCHEMA))
    k.close()
    assert list_checkpoints(base) == [6, 7]
    with pytest.raises(JobConflictError, match="retains 6, 7"):
        StatefulStream(base, Counting(), OUT, key="user", parallelism=2, resume_from=3).open()
    with pytest.raises(JobConflictError, match="no job to roll back"):
        StatefulStream(str(tmp_path / "none"), Counting(), OUT, key="user", parallelism=2, resume_from=1).open()


@heavy_twins
def test_bootstrapped_job_continues_with_batch_0_and_ids_map_through_spark_batch_ids(spark, tmp_path):
    from dstl.spark import bootstrap_state
    from dstl.state import read_state_pandas
    from dstl.state.rescale import rescale_checkpoint

    base = str(tmp_path / "job")
    initial = pd.DataFrame({"user": [f"u{i}" for i in range(8)], "n": [10 * i for i in range(8)]})
    meta = bootstrap_state(spark, spark.createDataFrame(initial), base, key="user", state_name="count",
                           schema="n long", max_parallelism=128, parallelism=3,
                           operator_id=StatefulStream.operator_id)
    assert (meta.checkpoint_id, meta.properties["batch"]) == (1, -1)
    assert meta.properties["state_schemas"]["count"]["value_ddl"] == "n bigint"
    shown = read_state_pandas(base, "count")  # the recorded schema gives the value its column
    assert dict(zip(shown.key, shown.n)) == dict(zip(initial.user, initial.n))

    s = StatefulStream(base, Counting(), OUT, key="user", parallelism=2)
    assert s.open().next_batch == 0
    with pytest.raises(StreamGapError, match="has completed no batch yet"):
        s(spark.createDataFrame(_batch(0), SCHEMA), 1)
    batches = [_batch(b, users=10) for b in range(3)]
    res = s(spark.createDataFrame(batches[0], SCHEMA), 0)
    assert (res.batch_id, res.checkpoint_id, res.evolved_states) == (0, 2, [])
    res = s(spark.createDataFrame(batches[1], SCHEMA), 1)
    assert (res.batch_id, res.checkpoint_id) == (1, 3)
    s.close()

    # an offline rescale adds checkpoint 4 for batch 1: ids run two ahead of batch ids from here on
    rescale_checkpoint(base, 256, parallelism=4)
    assert latest_checkpoint(base).properties["spark_batch_id"] == 1
    t = StatefulStream(base, Counting(), OUT, key="user", parallelism=3)
    assert t(spark.createDataFrame(batches[1], SCHEMA), 1).replayed  # Spark replays batch 1: no change
    res = t(spark.createDataFrame(batches[2], SCHEMA), 2)
    assert (res.batch_id, res.checkpoint_id) == (2, 5)
    t.close()
    assert latest_checkpoint(base).properties["spark_batch_id"] == 2

    expected = {u: n + c for u, n in zip(initial.user, initial.n) for c in [_counts(batches).get(u, 0)]}
    expected.update({u: c for u, c in _counts(batches).items() if u not in expected})
    got = read_state_pandas(base, "count")
    assert dict(zip(got.key, got.n)) == expected
    out = spark.read.parquet(base + "/output").toPandas()
    last = out.sort_values("batch_id").groupby("user")["n"].last().to_dict()
    assert last == {u: expected[u] for u in pd.concat(batches).user.unique()}


@heavy
def test_rolled_back_stream_and_rewound_query_redo_the_later_batches(spark, tmp_path):
    """A real file-stream query: 4 batches, roll the job back to batch 1's checkpoint, rewind the
    query's checkpoint location to batch 1, restart: batches 2 and 3 are read from their files again,
    processed and delivered once more; output and state are exact."""
    import json as _json

    from dstl.spark import rewind_query_checkpoint
    from dstl.state import read_state_pandas

    base, inbox, ckpt = (str(tmp_path / n) for n in ("job", "in", "spark-ckpt"))
    os.makedirs(inbox)
    frames = [_batch(b, users=5, rows=7) for b in range(4)]
    for i, pdf in enumerate(frames):
        path = os.path.join(inbox, f"part-{i}.json")
        with open(path, "w") as fh:
            fh.writelines(_json.dumps({"user": u, "v": int(v)}) + "\n" for u, v in zip(pdf.user, pdf.v))
        os.utime(path, (1_700_000_000 + i,) * 2)
    calls = []

    def sink(df, batch_id):
        calls.append(batch_id)

    def run_query(stream):
        events = spark.readStream.schema(SCHEMA).option("maxFilesPerTrigger", 1).json(inbox)
        q = (events.writeStream.foreachBatch(stream).option("checkpointLocation", ckpt)
             .trigger(availableNow=True).start())
        try:
            q.awaitTermination()
        finally:
            q.stop()
        stream.close()

    run_query(StatefulStream(base, Counting(), OUT, key="user", parallelism=2, sink=sink, retain=5))
    assert calls == [0, 1, 2, 3]
    with pytest.raises(ValueError, match="no offsets of batch 9"):
        rewind_query_checkpoint(ckpt, 9)
    back = StatefulStream(base, Counting(), OUT, key="user", parallelism=2, sink=sink, retain=5, resume_from=2)
    assert back.open().next_batch == 2
    removed = rewind_query_checkpoint(ckpt, 1)
    assert removed["offsets"] == 2 and removed["commits"] == 2 and removed["sources/0"] == 2
    run_query(back)
    assert calls == [0, 1, 2, 3, 2, 3]
    expected = _counts(frames)
    state = read_state_pandas(base, "count")
    assert dict(zip(state.key, state.n)) == expected
    out = spark.read.parquet(base + "/output").toPandas()
    assert sorted(out.batch_id.unique().tolist()) == [0, 1, 2, 3]
    assert out.sort_values("batch_id").groupby("user")["n"].last().to_dict() == expected
    assert len(glob.glob(base + "/output/_rolled_back/*/batch_id=*")) == 2
