"""pytest-benchmark: reading 1,000,000 × 100-byte changes back through StateChangelogReader
(local raw and snappy files; objects and vectorised arrays).

Run: .venv/bin/python -m pytest bench/bench_reader.py --benchmark-min-rounds=3
Ratios (reader vs bare in-memory decode) are printed by bench/reader_report.py.
"""
from __future__ import annotations

import os
import shutil
import sys

import pytest

sys.path.insert(0, os.path.dirname(__file__))
import _reader_data as rd  # noqa: E402

N = 1_000_000


@pytest.fixture(scope="module")
def handles():
    d = rd.tmpdir()
    try:
        yield {c or "raw": rd.write_file(d, N, c) for c in (None, "snappy")}
    finally:
        shutil.rmtree(d, ignore_errors=True)


@pytest.mark.parametrize("kind", ["raw", "snappy"])
def test_read_objects(benchmark, handles, kind):
    assert benchmark.pedantic(rd.read_objects, args=(handles[kind],), rounds=3, iterations=1) == N


@pytest.mark.parametrize("kind", ["raw", "snappy"])
def test_read_arrays(benchmark, handles, kind):
    assert benchmark.pedantic(rd.read_arrays, args=(handles[kind],), rounds=3, iterations=1) == N


def test_decode_in_memory_floor(benchmark, handles):
    logical = rd.load_logical(handles["raw"])
    assert benchmark.pedantic(rd.decode_in_memory, args=(handles["raw"], logical), rounds=3, iterations=1) == N
