"""pytest-benchmark: the issue-2 format workload (1M changes of 100 bytes, key groups 0..127),
Cython and its pure-Python twin side by side.

Run: .venv/bin/pytest bench/bench_format.py --benchmark-min-rounds=3
Targets (checked by bench/format_report.py, which prints ratios): vectorised append+seal >= 1 GB/s,
per-record append >= 5M changes/s, vectorised decode >= 2 GB/s, Cython >= 10x twin on vectorised paths.
"""
from __future__ import annotations

import os
import sys

import pytest

sys.path.insert(0, os.path.dirname(__file__))
import _format_data as fd  # noqa: E402

IMPLS = fd.implementations()


@pytest.fixture(scope="module")
def workload():
    return fd.Workload()


@pytest.fixture(scope="module")
def body(workload):
    return fd.append_many_and_seal(IMPLS["python"], workload)


def _rounds(name):
    return dict(rounds=3 if name == "cython" else 2, iterations=1, warmup_rounds=1 if name == "cython" else 0)


@pytest.mark.parametrize("name", list(IMPLS))
def test_append_per_record_and_seal(benchmark, workload, body, name):
    out = benchmark.pedantic(fd.append_and_seal, args=(IMPLS[name], workload), **_rounds(name))
    assert out == body


@pytest.mark.parametrize("name", list(IMPLS))
def test_append_many_and_seal(benchmark, workload, body, name):
    out = benchmark.pedantic(fd.append_many_and_seal, args=(IMPLS[name], workload), **_rounds(name))
    assert out == body


@pytest.mark.parametrize("name", list(IMPLS))
def test_append_many_copying_and_seal(benchmark, workload, body, name):
    out = benchmark.pedantic(fd.append_many_copy_and_seal, args=(IMPLS[name], workload), **_rounds(name))
    assert out == body


@pytest.mark.parametrize("name", list(IMPLS))
def test_decode_objects(benchmark, workload, body, name):
    changes = benchmark.pedantic(fd.decode_objects, args=(IMPLS[name], body), **_rounds(name))
    assert len(changes) == workload.n


@pytest.mark.parametrize("name", list(IMPLS))
def test_decode_vectorised(benchmark, workload, body, name):
    kgs, offs, lens, end = benchmark.pedantic(fd.decode_arrays, args=(IMPLS[name], body), **_rounds(name))
    assert end == len(body) and len(kgs) == workload.n and int(lens.sum()) == workload.payload_bytes
