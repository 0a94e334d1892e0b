"""A running StatefulStream rescaled between two micro-batches (`rescale`), in the same object and
Spark application: exact output across 2 -> 3 -> 1, the new parallelism in the results and the
checkpoint, and the bounds checked before anything changes."""
from __future__ import annotations

import sys

import pandas as pd
import pytest

pytest.importorskip("pyspark")
pytest.importorskip("pyspark.sql.streaming.stateful_processor",
                    reason="StatefulProcessor needs PySpark 4 (its transformWithState API)")

from pyspark import cloudpickle  # noqa: E402

from conftest import heavy  # noqa: E402

from dstl.spark import StatefulJob, StatefulStream  # noqa: E402
from dstl.spark.coordinator import CheckpointCoordinator, JobSpec  # noqa: E402
from dstl.state.metadata import latest_checkpoint  # noqa: E402

import stream_driver  # noqa: E402
from stream_driver import OUT, Counting  # noqa: E402
from test_stream import _batch, _expected_counting, _read_output, _sdf  # noqa: E402

cloudpickle.register_pickle_by_value(sys.modules[__name__])
cloudpickle.register_pickle_by_value(stream_driver)


def test_live_rescale_2_3_1_exact_output(spark, tmp_path):
    base = str(tmp_path / "job")
    batches = [(b, _batch(b, users=11, rows=30)) for b in range(6)]
    stream = StatefulStream(base, Counting(), OUT, key="user", parallelism=2, max_parallelism=16)
    plan = {2: 3, 4: 1}  # before batch b: rescale to p
    results = []
    for b, pdf in batches:
        if b in plan:
            stream.rescale(plan[b])
        results.append(stream(_sdf(spark, pdf), b))
    assert [r.parallelism for r in results] == [2, 2, 3, 3, 1, 1]
    assert [r.rescaled_from for r in results] == [None, None, 2, None, 3, None]
    assert [len(r.reports) for r in results] == [2, 2, 3, 3, 1, 1]
    # the batch that moves state restores every subtask (new key-group ranges); the next one goes on
    assert results[2].restored == 3 and results[4].restored == 1
    assert all(rep.continued or rep.restored for r in results[1:] for rep in r.reports)
    assert latest_checkpoint(base).parallelism == 1
    stream.close()
    got = _read_output(spark, base + "/output")
    pd.testing.assert_frame_equal(got, _expected_counting(batches), check_dtype=False)

    # a restart after the live rescale resumes at the recorded parallelism's state
    again = StatefulStream(base, Counting(), OUT, key="user", parallelism=1)
    assert again.open().latest.parallelism == 1


def test_rescale_bounds_checked_before_anything_changes(spark, tmp_path):
    stream = StatefulStream(str(tmp_path / "job"), Counting(), OUT, key="user", parallelism=2, max_parallelism=8)
    for bad in (0, 9, -1, "3", 2.0, True, None):
        with pytest.raises(ValueError, match=r"rescale\(.*\): parallelism must be an int in 1\.\.8"):
            stream.rescale(bad)
        assert stream.parallelism == 2
    stream.rescale(8)
    assert stream.parallelism == 8
    with pytest.raises(ValueError, match='parallelism="auto" needs autoscale'):
        StatefulStream(str(tmp_path / "a"), Counting(), OUT, key="user", parallelism="auto")
    with pytest.raises(ValueError, match='needs parallelism="auto"'):
        StatefulStream(str(tmp_path / "a"), Counting(), OUT, key="user", parallelism=2, autoscale=(1, 4))
    with pytest.raises(ValueError, match="autoscale maximum 9 exceeds max_parallelism 8"):
        StatefulStream(str(tmp_path / "a"), Counting(), OUT, key="user", parallelism="auto",
                       autoscale=(1, 9), max_parallelism=8)
    auto = StatefulStream(str(tmp_path / "a"), Counting(), OUT, key="user", parallelism="auto", autoscale=(2, 4))
    assert auto.parallelism == 2 and auto.autoscale.max_parallelism == 4


@heavy
def test_job_rescale_between_batches(spark, tmp_path):
    base = str(tmp_path / "job")
    coord = CheckpointCoordinator.open(base, JobSpec.new("count", 8, base + "/output"),
                                       {"dstl.dfs.base-path": base}, resume=False)

    def fn(rows, state):
        count = state.value_state("n")
        sizes = rows.groupby("user").size()
        users = [str(u) for u in sizes.index]
        new = [(v or 0) + int(s) for v, s in zip(count.get_many(users), sizes.tolist())]
        count.update_many(users, new)
        return pd.DataFrame({"user": users, "n": new})

    job = StatefulJob(coord, fn, "user string, n long", key="user", parallelism=3, spark=spark)
    with pytest.raises(ValueError, match=r"rescale\(9\): parallelism must be an int in 1\.\.8"):
        job.rescale(9)
    totals = {}
    try:
        for b, p in enumerate((3, 3, 2, 4)):
            job.rescale(p)
            pdf = _batch(b, users=7, rows=20)
            for u in pdf["user"]:
                totals[u] = totals.get(u, 0) + 1
            res = job.run_batch(pdf)
            assert len(res.reports) == p
    finally:
        job.close()
    out = pd.concat([pd.read_parquet(f"{base}/output/batch-{b:06d}") for b in range(4)])
    assert out.groupby("user")["n"].max().to_dict() == totals
    assert latest_checkpoint(base).parallelism == 4
