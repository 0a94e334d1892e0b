"""dstl.spark.read_state / read_changes: the same rows as the pandas readers and an independent
account, read by one Spark task per key-group range."""
from __future__ import annotations

import argparse
import io
import json

import pytest

from conftest import heavy, heavy_twins
from dstl.spark import read_changes, read_state
from dstl.state import StateReadError, read_changes_pandas
from state_job import StateJob, frame_rows

pytestmark = pytest.mark.spark


@heavy_twins
def test_read_state_and_changes_match_the_ops_applied(spark, tmp_path):
    job = StateJob(str(tmp_path / "job"))
    try:
        for i in range(3):
            job.step(materialize=(i == 1))
        df = read_state(spark, job.base, tasks=5)
        assert df.rdd.getNumPartitions() == 5
        assert df.schema.simpleString() == ("struct<key:string,key_group:int,state:string,kind:string,"
                                            "user_key:string,position:int,value:string>")
        assert frame_rows(df.toPandas()) == job.expected_rows()
        seen = read_state(spark, job.base, "seen").toPandas()
        assert set(seen["state"]) == {"seen"} and len(seen) == sum(1 for r in job.expected_rows() if r[1] == "seen")
        with pytest.raises(StateReadError, match="no state 'nope'"):
            read_state(spark, job.base, "nope")
        changes = read_changes(spark, job.base, 1, 3).toPandas()
        want = read_changes_pandas(job.base, 1, 3)
        key = ["checkpoint_id", "key", "state", "op", "user_key", "value"]
        norm = lambda d: sorted(map(tuple, d[key].astype(object).where(d[key].notna(), None).values.tolist()))
        assert norm(changes) == norm(want) == sorted(c for c in job.changes if c[0] > 1)
    finally:
        job.close()


@heavy  # test_read_state_and_changes_match_the_ops_applied covers the logic under both
def test_read_state_of_a_rescaled_pipeline_equals_pandas(spark, tmp_path):
    """The demo pipeline through a task failure and a rescale 2 -> 3; read_state then equals the
    pandas reference of every user's count, distinct items and last items."""
    from dstl.app import pipeline
    from dstl.app.activity import reference

    base = str(tmp_path / "job")
    small = ["--events", "3000", "--batches", "4", "--users", "150", "--items", "30", "--materialize-every", "700",
             "--base-path", base, "--quiet"]

    def run(*extra):
        p = argparse.ArgumentParser()
        pipeline.add_arguments(p)
        opts = pipeline.check_options(p.parse_args([*small, *extra]))
        return pipeline.run_pipeline(opts, spark=spark, stream=io.StringIO()), opts

    run("--parallelism", "2", "--stop-at", "1", "--fail-at", "1")
    report, opts = run("--parallelism", "3", "--resume")
    assert report.batches == 2
    expected, _ = reference(opts.source.all())
    df = read_state(spark, base).toPandas()
    count = df[df.state == "count"]
    assert dict(zip(count.key, count.value.map(json.loads))) == {u: s["events"] for u, s in expected.items()}
    items = df[df.state == "items"]
    got_items = {}
    for r in items.itertuples():
        got_items.setdefault(r.key, {})[json.loads(r.user_key)] = json.loads(r.value)
    assert got_items == {u: s["items"] for u, s in expected.items() if s["items"]}
    last = df[df.state == "last_items"].sort_values(["key", "position"])
    got_last = last.groupby("key")["value"].apply(lambda v: [json.loads(x) for x in v]).to_dict()
    assert got_last == {u: s["last_items"] for u, s in expected.items() if s["last_items"]}
