"""`dstl demo` (what `make demo` runs): the pipeline end to end with --verify, on the suite's shared
SparkSession, with fewer events than the default. A second run replaces the previous demo directory."""
from __future__ import annotations

import os

import pytest

from conftest import heavy
from dstl import cli
from dstl.state.metadata import list_checkpoints

# the pipeline's own tests run it under both builds
pytestmark = [pytest.mark.spark, heavy]


def test_demo_runs_the_pipeline_end_to_end_verified(spark, tmp_path, capsys):
    target = tmp_path / "demo-run"
    argv = ["demo", "--dir", str(target), "--events", "2000", "--batches", "2"]
    assert cli.main(argv) == 0
    out = capsys.readouterr().out
    assert "verify           OK" in out and "2,000 events" in out
    assert list_checkpoints(str(target / "state")) == [1, 2]
    assert sorted(os.listdir(target / "output")) == ["batch-000000", "batch-000001"]
    assert (target / "output" / "batch-000001" / "_SUCCESS").exists()
    # a previous demo run (marked) is replaced, not appended to or refused
    (target / "output" / "stale.txt").write_text("from the previous run")
    assert cli.main(argv) == 0
    assert "verify           OK" in capsys.readouterr().out
    assert not (target / "output" / "stale.txt").exists()
