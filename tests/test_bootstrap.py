"""bootstrap_state: a job's first checkpoint from a Spark DataFrame, written by the executors; a
StatefulJob resumed there continues from it, and the result equals pandas."""
from __future__ import annotations

import json

import numpy as np
import pandas as pd
import pytest

from conftest import heavy

pytestmark = pytest.mark.spark


@heavy
def test_bootstrap_then_a_run_equals_pandas(spark, tmp_path):
    from dstl.spark import CheckpointCoordinator, JobConflictError, JobSpec, StatefulJob, bootstrap_state
    from dstl.state import read_state_pandas

    base = str(tmp_path / "job")
    initial = pd.DataFrame({"user": np.arange(0, 300, dtype=np.int64), "n": np.arange(300, dtype=np.int64) * 3})
    meta = bootstrap_state(spark, spark.createDataFrame(initial), base, key="user", state_name="count",
                           max_parallelism=128, parallelism=3, operator_id="counter")
    assert (meta.checkpoint_id, meta.parallelism, meta.max_parallelism) == (1, 3, 128)
    got = read_state_pandas(base, "count")
    assert dict(zip(got.key, got.value.map(json.loads))) == dict(zip(initial.user.tolist(), initial.n.tolist()))
    with pytest.raises(JobConflictError, match="already holds a job"):
        bootstrap_state(spark, spark.createDataFrame(initial), base, key="user", state_name="count", parallelism=2)

    def _counting(rows, state):
        """(defined here: Spark pickles it by value) Adds each batch's events to the user's count; outputs the new counts."""
        count = state.value_state("count")
        sizes = rows.groupby("user").size()
        users = [int(u) for u in sizes.index]
        new = np.asarray([v if v is not None else 0 for v in count.get_many(users)], dtype=np.int64) + sizes.to_numpy()
        count.update_many(users, new.tolist())
        return pd.DataFrame({"user": users, "n": new})

    rng = np.random.default_rng(1)
    events = pd.DataFrame({"user": rng.integers(0, 400, 2000).astype(np.int64)})
    coord = CheckpointCoordinator.open(base, JobSpec.new("counter", 0, base + "/output"),
                                       {"dstl.dfs.base-path": base}, resume=True)
    job = StatefulJob(coord, _counting, "user long, n long", key="user", parallelism=2, spark=spark)
    res = job.run_batch(events)
    assert res.checkpoint_id == 2 and res.batch == 0
    coord.finish()
    expected = initial.set_index("user")["n"].add(events.groupby("user").size(), fill_value=0).astype(np.int64)
    out = pd.read_parquet(base + "/output/batch-000000")
    assert dict(zip(out.user, out.n)) == {u: expected[u] for u in events.user.unique().tolist()}
    final = read_state_pandas(base, "count")
    assert dict(zip(final.key, final.value.map(json.loads))) == expected.to_dict()
