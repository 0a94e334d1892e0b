"""Offline max-parallelism change: `dstl state rescale` rewrites the latest checkpoint's state into a
new checkpoint with the new key groups; the job continues from it."""
from __future__ import annotations

import argparse
import io
import json
import os

import pytest

from conftest import heavy
from dstl import cli
from dstl.keygroups import assign_to_key_group
from dstl.state import read_state_pandas, read_timers_pandas
from dstl.state.metadata import latest_checkpoint
from dstl.state.rescale import rescale_checkpoint
from state_job import StateJob, frame_rows


def test_rescale_128_256_64_keeps_every_value(tmp_path):
    job = StateJob(str(tmp_path / "job"))
    try:
        for i in range(3):
            if i == 2:  # timers are keyed state (dstl.state.timers: the _dstl_timers map state)
                for n, key in enumerate(("u1", "u2", "u9")):
                    job._b(key).map_state("_dstl_timers").put(key, 1000 + n, 1)
                job._b("u2").map_state("_dstl_timers").remove("u2", 1001)   # a deletion survives too
            job.step(materialize=(i == 1))
    finally:
        job.close()
    expected = job.expected_rows()
    timers = [("u1", 1000), ("u9", 1002)]
    assert list(zip(*[read_timers_pandas(job.base)[c] for c in ("key", "timestamp_ms")])) == timers
    meta = rescale_checkpoint(job.base, 256, parallelism=3)
    assert (meta.checkpoint_id, meta.max_parallelism, meta.parallelism) == (4, 256, 3)
    assert meta.properties["rescaled_from"] == 3 and meta.properties["batch"] == 2
    df = read_state_pandas(job.base)
    assert frame_rows(df) == expected
    assert all(assign_to_key_group(k, 256) == g for k, g in zip(df["key"], df["key_group"]))
    meta = rescale_checkpoint(job.base, 64)
    assert (meta.checkpoint_id, meta.max_parallelism, meta.parallelism) == (5, 64, 3)
    df = read_state_pandas(job.base)
    assert frame_rows(df) == expected
    assert all(assign_to_key_group(k, 64) == g for k, g in zip(df["key"], df["key_group"]))
    t = read_timers_pandas(job.base)
    assert list(zip(t.key, t.timestamp_ms)) == timers
    assert all(assign_to_key_group(k, 64) == g for k, g in zip(t.key, t.key_group))
    with pytest.raises(ValueError, match="--parallelism must be in 1..64"):
        rescale_checkpoint(job.base, 64, parallelism=65)


def test_cli_rescale(tmp_path, capsys):
    job = StateJob(str(tmp_path / "job"))
    try:
        job.step()
    finally:
        job.close()
    assert cli.main(["state", "rescale", job.base, "--max-parallelism", "256", "--json"]) == 0
    assert json.loads(capsys.readouterr().out) == {"checkpoint_id": 2, "max_parallelism": 256, "parallelism": 2}
    assert cli.main(["state", "rescale", job.base, "--max-parallelism", "100000"]) == 2
    err = capsys.readouterr().err
    assert len(err.strip().splitlines()) == 1 and "--max-parallelism must be in 1..32768" in err
    assert cli.main(["state", "rescale", str(tmp_path / "none"), "--max-parallelism", "64"]) == 2
    assert "holds no checkpoints" in capsys.readouterr().err


@pytest.mark.spark
@heavy  # test_rescale_128_256_64_keeps_every_value covers the logic under both
def test_pipeline_continues_after_128_256_64(spark, tmp_path):
    from dstl.app import pipeline

    base = str(tmp_path / "job")
    small = ["--events", "3000", "--batches", "4", "--users", "150", "--items", "30", "--materialize-every", "700",
             "--base-path", base, "--quiet"]

    def run(*extra):
        p = argparse.ArgumentParser()
        pipeline.add_arguments(p)
        return pipeline.run_pipeline(pipeline.check_options(p.parse_args([*small, *extra])), spark=spark,
                                     stream=io.StringIO())

    run("--max-parallelism", "128", "--stop-at", "1")
    before = frame_rows(read_state_pandas(base))
    assert cli.main(["state", "rescale", base, "--max-parallelism", "256", "--parallelism", "3"]) == 0
    assert cli.main(["state", "rescale", base, "--max-parallelism", "64"]) == 0
    assert frame_rows(read_state_pandas(base)) == before
    with open(os.path.join(base, "_dstl_job.json")) as f:
        assert json.load(f)["max_parallelism"] == 64
    report = run("--resume", "--parallelism", "2")
    assert report.max_parallelism == 64 and report.first_batch == 2 and report.batches == 2
    assert report.verify is None
    report = run("--resume", "--verify")  # nothing left to run: verifies the final state and all output
    assert report.verify == [], report.render()
    assert latest_checkpoint(base).max_parallelism == 64
