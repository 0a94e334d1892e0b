"""One function gives a row its subtask (dstl.spark.routing.subtask_of): Flink's key-group
assignment (dstl.keygroups), and the one null-key rule (a null key rides with subtask 0). Every route
uses it: the executors' column (with_subtask), the driver's keying of a pandas batch (the batch loop
of dstl.spark.batch) and `stateful_map_in_pandas`; the tasks of each see exactly those rows."""
from __future__ import annotations

import numpy as np
import pandas as pd
import pytest

from conftest import heavy
from dstl.config import StorageConfig
from dstl.keygroups import assign_key_groups, operator_indices_for_key_groups
from dstl.spark import NullKeyError, StatefulJob, current_subtask, stateful_map_in_pandas, subtask_of, with_subtask
from dstl.spark.batch import keyed_frame
from dstl.spark.coordinator import CheckpointCoordinator, JobSpec
from dstl.spark.keys import pack_columns
from dstl.spark.report import TaskReport
from dstl.spark.routing import SUBTASK_COL

MAXP = 128


def _flink(keys, parallelism):
    """Flink's assignment of non-null keys, straight from dstl.keygroups."""
    return operator_indices_for_key_groups(assign_key_groups(keys, MAXP), MAXP, parallelism)


def _key_sets():
    rng = np.random.default_rng(7)
    ints = rng.integers(-2**62, 2**62, 3_000)
    strs = [f"user-{i}" for i in rng.integers(0, 10**9, 3_000)]
    packed = pack_columns([pd.Series(strs), pd.Series(ints)])
    return {"int": list(ints), "str": strs, "packed": packed}


@pytest.mark.parametrize("parallelism", [1, 2, 3, 7, 128])
@pytest.mark.parametrize("kind", ["int", "str", "packed"])
def test_subtask_of_is_flinks_assignment_and_null_keys_ride_with_subtask_0(kind, parallelism):
    keys = _key_sets()[kind]
    expected = _flink(keys, parallelism)
    assert expected.min() >= 0 and expected.max() < parallelism
    assert subtask_of(pd.Series(keys), MAXP, parallelism).tolist() == expected.tolist()
    with_nulls = pd.Series(keys[:50] + [None] + keys[50:100] + [None], dtype=object)
    got = subtask_of(with_nulls, MAXP, parallelism)
    assert got.dtype == np.int32
    assert got[50] == 0 and got[-1] == 0
    assert np.delete(got, [50, len(got) - 1]).tolist() == _flink(keys[:100], parallelism).tolist()


def test_an_integer_column_with_nulls_arriving_as_float_keeps_its_integers():
    ints = list(range(-500, 500))
    as_float = pd.Series(ints + [None], dtype="float64")  # what Arrow hands a long column with nulls
    got = subtask_of(as_float, MAXP, 3)
    assert got[:-1].tolist() == _flink(ints, 3).tolist() and got[-1] == 0
    assert subtask_of(pd.Series([None, None]), MAXP, 3).tolist() == [0, 0]
    with pytest.raises(TypeError, match="float64"):  # a real float key has no key group
        subtask_of(pd.Series([1.5, 2.0]), MAXP, 3)


# ------------------------------------------------------------------ every route, in Spark

def _frame(kind):
    keys = _key_sets()[kind][:400]
    return pd.DataFrame({"k": pd.Series(keys + [None, None], dtype=object), "n": np.arange(len(keys) + 2)})


@heavy  # starts Spark: the same under both builds
@pytest.mark.parametrize("kind", ["int", "str"])
def test_the_executors_column_and_the_drivers_keying_agree_with_subtask_of(spark, kind):
    pdf = _frame(kind)
    ddl = f"k {'long' if kind == 'int' else 'string'}, n long"
    expected = dict(zip(pdf["n"], subtask_of(pdf["k"], MAXP, 3).tolist()))
    executors = with_subtask(spark.createDataFrame(pdf, ddl), "k", MAXP, 3).select("n", SUBTASK_COL).collect()
    driver = keyed_frame(spark, pdf, "k", MAXP, 3, ddl).select("n", SUBTASK_COL).collect()
    assert {r.n: r[SUBTASK_COL] for r in executors} == expected
    assert {r.n: r[SUBTASK_COL] for r in driver} == expected
    assert sum(1 for n, s in expected.items() if s == 0) >= 2  # the null keys among subtask 0's rows


def _seen_fn():
    """fn(rows, state) -> what its task saw: its subtask and its rows' keys (defined here so that
    Spark ships it by value: the workers cannot import a test module)."""
    def seen(rows, state):
        return pd.DataFrame({"subtask": [current_subtask()] * len(rows), "k": rows["k"].astype(str)})

    return seen


@heavy  # starts Spark: the same under both builds
def test_every_route_hands_each_task_exactly_its_subtasks_rows(spark, tmp_path):
    pdf = _frame("str").iloc[:-2]  # no null keys: stateful_map_in_pandas refuses them
    expected = dict(zip(pdf["k"], subtask_of(pdf["k"], MAXP, 3).tolist()))
    seen = {}
    for name, run in (("stateful_map_in_pandas", _via_map_in_pandas), ("job, Spark batch", _via_job_spark),
                      ("job, pandas batch", _via_job_pandas)):
        out = run(spark, tmp_path / name.replace(" ", "_").replace(",", ""), pdf)
        seen[name] = dict(zip(out["k"], out["subtask"]))
        assert seen[name] == expected, name


def _coordinator(base):
    base = str(base)
    return CheckpointCoordinator.open(base, JobSpec.new("op", MAXP, base + "/output", {}),
                                      StorageConfig(base_path=base).to_mapping(), resume=False)


def _via_map_in_pandas(spark, base, pdf):
    coord = _coordinator(base)
    plan = coord.plan(0, 3)
    rows = stateful_map_in_pandas(spark.createDataFrame(pdf, "k string, n long"), _seen_fn(), "subtask int, k string",
                                  key="k", checkpoint=plan).collect()
    coord.complete(plan, [TaskReport.from_row(r) for r in rows])
    return pd.read_parquet(str(base) + "/output")


def _via_job(spark, base, batch):
    coord = _coordinator(base)
    job = StatefulJob(coord, _seen_fn(), "subtask int, k string", key="k", parallelism=3, spark=spark)
    try:
        job.run_batch(batch)
    finally:
        job.close()
    return pd.read_parquet(str(base) + "/output")


def _via_job_spark(spark, base, pdf):
    return _via_job(spark, base, spark.createDataFrame(pdf, "k string, n long"))


def _via_job_pandas(spark, base, pdf):
    return _via_job(spark, base, pdf)


@heavy  # starts Spark: the same under both builds
def test_a_jobs_null_keys_fail_the_batch_or_are_dropped_and_counted(spark, tmp_path):
    pdf = _frame("str")
    coord = _coordinator(tmp_path / "error")
    job = StatefulJob(coord, _seen_fn(), "subtask int, k string", key="k", parallelism=2, spark=spark)
    with pytest.raises(NullKeyError, match=r"key column 'k' has 2 null value\(s\) in batch 0 \(of 402 rows\)"):
        job.run_batch(pdf)
    assert coord.latest is None  # nothing committed
    job.close()
    coord = _coordinator(tmp_path / "drop")
    job = StatefulJob(coord, _seen_fn(), "subtask int, k string", key="k", parallelism=2, spark=spark, null_keys="drop")
    result = job.run_batch(pdf)
    job.close()
    assert result.rows_in == 400 and result.rows_out == 400
    assert sum(r.metric("null_rows") for r in result.reports) == 2
    assert [r.metric("null_rows") for r in result.reports][0] == 2  # subtask 0's task counted them
