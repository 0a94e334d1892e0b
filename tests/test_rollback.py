"""Roll back: resume from an older retained checkpoint; later checkpoints are abandoned, their output
moves under <output>/_rolled_back/<time>/, and the run continues exactly once from there."""
from __future__ import annotations

import argparse
import io
import json
import os

import pytest

from conftest import heavy
from dstl.spark.rollback import ROLLBACK_FILE, finish_roll_back, roll_back
from dstl.state.metadata import list_checkpoints
from dstl.state.reader import StateReadError
from state_job import StateJob

SMALL = ["--events", "3000", "--batches", "8", "--users", "150", "--items", "30", "--materialize-every", "500",
         "--quiet"]


def _run(spark, *argv):
    from dstl.app import pipeline

    p = argparse.ArgumentParser()
    pipeline.add_arguments(p)
    return pipeline.run_pipeline(pipeline.check_options(p.parse_args([*SMALL, *argv])), spark=spark,
                                 stream=io.StringIO())


def test_roll_back_moves_later_checkpoints_and_output(tmp_path):
    job = StateJob(str(tmp_path / "job"))
    try:
        for _ in range(4):
            job.step()
    finally:
        job.close()
    out = tmp_path / "job" / "output"
    for b in range(4):
        (out / f"batch-{b:06d}").mkdir(parents=True)
        (out / f"batch-{b:06d}" / "_SUCCESS").write_text("x")
    with pytest.raises(StateReadError, match="retains 1, 2, 3, 4"):
        roll_back(job.base, 7, "output")
    res = roll_back(job.base, 2, "output")
    assert res.abandoned == [3, 4] and res.moved_batches == [2, 3]
    assert list_checkpoints(job.base) == [1, 2]
    assert sorted(os.listdir(out)) == ["_rolled_back", "batch-000000", "batch-000001"]
    assert sorted(os.listdir(out / "_rolled_back" / res.stamp)) == ["batch-000002", "batch-000003"]
    assert sorted(os.listdir(tmp_path / "job" / "checkpoints" / "_abandoned" / res.stamp)) == ["chk-3", "chk-4"]
    assert not (tmp_path / "job" / ROLLBACK_FILE).exists() and finish_roll_back(job.base) is None


def test_an_interrupted_roll_back_is_finished_by_the_next_open(tmp_path):
    job = StateJob(str(tmp_path / "job"))
    try:
        for _ in range(3):
            job.step()
    finally:
        job.close()
    plan = {"checkpoint_id": 1, "stamp": "T", "abandoned": [2, 3], "first_batch": 1, "output_path": None}
    (tmp_path / "job" / ROLLBACK_FILE).write_text(json.dumps(plan))  # as a crash after step 1 leaves it
    res = finish_roll_back(job.base)
    assert res.abandoned == [2, 3] and list_checkpoints(job.base) == [1]


@pytest.mark.spark
@heavy  # the roll-back steps are covered by the light tests under both builds
def test_pipeline_rolls_back_to_checkpoint_3_and_finishes_exactly_once(spark, tmp_path):
    base = tmp_path / "job"
    first = _run(spark, "--base-path", str(base), "--retain", "8", "--stop-at", "5")
    assert first.batches == 6 and list_checkpoints(str(base))[-1] == 6
    report = _run(spark, "--base-path", str(base), "--retain", "8", "--resume", "--from-checkpoint", "3", "--verify")
    assert report.rolled_back["checkpoint_id"] == 3 and report.rolled_back["abandoned"] == [4, 5, 6]
    assert report.first_batch == 3 and report.batches == 5
    assert report.verify == [], report.render()
    stamp = report.rolled_back["stamp"]
    moved = sorted(os.listdir(base / "output" / "_rolled_back" / stamp))
    assert moved == ["batch-000003", "batch-000004", "batch-000005"]
    assert all((base / "output" / "_rolled_back" / stamp / m / "_SUCCESS").exists() for m in moved)
    assert report.garbage_files == 0  # the abandoned checkpoints' changelog files were collected
