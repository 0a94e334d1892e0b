"""pytest-benchmark: vectorised key-group assignment, Cython kernels vs the pure-Python twin.

Run: .venv/bin/python -m pytest bench/bench_keygroups.py --benchmark-only
(`bench/keygroups_report.py` prints rows/s and ratios without pytest.)
"""
import os
import sys

import pytest

sys.path.insert(0, os.path.dirname(__file__))
from _keygroups_data import int_keys, kernels, string_keys  # noqa: E402

from dstl import keygroups  # noqa: E402

ROWS = int(os.environ.get("DSTL_BENCH_ROWS", 10_000_000))
KERNELS = kernels()


@pytest.fixture(scope="module")
def ints():
    return int_keys(ROWS)


@pytest.fixture(scope="module")
def strings():
    return string_keys(ROWS)


@pytest.fixture(params=sorted(KERNELS))
def impl(request, monkeypatch):
    monkeypatch.setattr(keygroups, "_kernels", KERNELS[request.param])
    return request.param


def test_int64_keys(benchmark, impl, ints):
    groups = benchmark.pedantic(keygroups.assign_key_groups, args=(ints, 128), rounds=3, iterations=1)
    assert len(groups) == ROWS
    benchmark.extra_info["rows_per_s"] = ROWS / benchmark.stats.stats.median


def test_arrow_string_keys(benchmark, impl, strings):
    groups = benchmark.pedantic(keygroups.assign_key_groups, args=(strings, 128), rounds=3, iterations=1)
    assert len(groups) == ROWS
    benchmark.extra_info["rows_per_s"] = ROWS / benchmark.stats.stats.median
