"""pytest-benchmark: keyed state (issue 5). ValueState bulk update with changelog appends, and restore
of a changelog into a quarter of the key groups with and without materialization.

Run: .venv/bin/pytest bench/bench_state.py --benchmark-min-rounds=3
Full-size numbers and the ratio to the goal (>= 2 M updates/s): bench/state_report.py.
"""
from __future__ import annotations

import os
import sys

import pytest

sys.path.insert(0, os.path.dirname(__file__))
import _state_data as sd  # noqa: E402

RESTORE_MB = int(os.environ.get("DSTL_BENCH_RESTORE_MB", "128"))


@pytest.mark.parametrize("string_keys", [False, True], ids=["int-keys", "str-keys"])
def test_value_update_many(benchmark, string_keys):
    keys, values = sd.update_workload(1_000_000, 1_000_000, string_keys)
    out = benchmark.pedantic(sd.run_updates, args=(keys, values), rounds=3, iterations=1)
    benchmark.extra_info["M updates/s"] = out["updates"] / out["update_s"] / 1e6
    assert out["updates"] == 1_000_000


@pytest.fixture(scope="module")
def changelog():
    cl = sd.build_changelog(RESTORE_MB, users=200_000)
    try:
        yield cl
    finally:
        sd.drop_changelog(cl)


@pytest.mark.parametrize("which", ["plain", "materialized"])
def test_restore_quarter(benchmark, changelog, which):
    out = benchmark.pedantic(sd.run_restore, args=(changelog, which), rounds=2, iterations=1)
    benchmark.extra_info["MB/s read"] = out["files_bytes"] / 2**20 / out["seconds"]
    benchmark.extra_info["changes applied/s"] = out["changes_applied"] / out["seconds"]
    assert out["keys"] > 0
    if which == "materialized":  # a quarter of the key groups' snapshots, plus the tail
        assert out["changes_read"] < changelog.changes // 10
