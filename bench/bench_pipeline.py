"""pytest-benchmark: the pipeline's operator on one subtask, dstl state vs in-memory state (no Spark).

What a pipeline task does per micro-batch besides Spark's own work: `user_activity` over the
subtask's events, then (dstl) the checkpoint snapshot and the confirm of the previous one.
The end-to-end Spark comparison is bench/pipeline_report.py.

    .venv/bin/python -m pytest bench/bench_pipeline.py --benchmark-only
"""
from __future__ import annotations

import itertools
import os
import sys

import pytest

sys.path.insert(0, os.path.dirname(os.path.dirname(os.path.abspath(__file__))))

from dstl.config import StorageConfig  # noqa: E402
from dstl.keygroups import assign_key_groups  # noqa: E402
from dstl.app.activity import user_activity  # noqa: E402
from dstl.spark.memory import MemoryState  # noqa: E402
from dstl.app.source import SyntheticSource  # noqa: E402
from dstl.state.backend import KeyedStateBackend  # noqa: E402
from dstl.changelog.storage import FsStateChangelogStorage  # noqa: E402
from dstl.types import KeyGroupRange  # noqa: E402

BATCHES = 6


@pytest.fixture(scope="module")
def batches():
    """Subtask 0 of 2 (key groups 0..63) of a 1M-event stream, 10 batches: ~60k events each."""
    src = SyntheticSource(1_000_000, 10, users=50_000, items=5_000)
    out = []
    for b in range(BATCHES):
        x = src.batch(b)
        out.append(x[assign_key_groups(x["user_id"], 128) < 64].reset_index(drop=True))
    return out


def test_operator_memory_state(benchmark, batches):
    state = MemoryState()
    it = itertools.cycle(batches)
    benchmark.pedantic(lambda: user_activity(next(it), state), rounds=BATCHES, iterations=1)


def test_operator_dstl_state(benchmark, batches, tmp_path):
    with FsStateChangelogStorage(StorageConfig(base_path=str(tmp_path)), job_id="e" * 32) as storage:
        backend = KeyedStateBackend(storage, "op", KeyGroupRange(0, 63), 128, materialize_every_changes=200_000)
        it = itertools.cycle(batches)
        cp = itertools.count(1)

        def one_batch():
            user_activity(next(it), backend)
            c = next(cp)
            backend.snapshot(c).result()
            if c > 1:
                backend.confirm(c - 1)

        benchmark.pedantic(one_batch, rounds=BATCHES, iterations=1)
        backend.close()
