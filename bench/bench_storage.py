"""pytest-benchmark: the storage write path through the public API, to a local directory.

One writer with 1,000,000 x 100-byte changes (append_many in 10,000-row calls, and one append per
change), persist(initial) and wait; 8 writers persisting concurrently through the batching
scheduler; reading the result back; the plain open().write of the same number of bytes (ceiling).
Run: .venv/bin/python -m pytest bench/bench_storage.py --benchmark-min-rounds=3
Ratios against the ceiling and persist latency percentiles: bench/storage_report.py.
"""
from __future__ import annotations

import itertools
import os
import sys

import pytest

sys.path.insert(0, os.path.dirname(__file__))
import _storage_data as sd  # noqa: E402

N = 1_000_000


@pytest.fixture(scope="module")
def workload():
    return sd.make_data(N)


@pytest.fixture
def root():
    d = sd.tmpdir()
    yield d
    sd.cleanup(d)


def _fresh(root):
    counter = itertools.count()
    return lambda: os.path.join(root, f"run-{next(counter)}")


@pytest.mark.parametrize("mode", ["thread", "direct"])
def test_one_writer_vectorised(benchmark, workload, root, mode):
    kgs, data, offs = workload
    base = _fresh(root)
    _, h, disk = benchmark.pedantic(lambda: sd.write_vectorised(base(), kgs, data, offs, mode),
                                    rounds=3, iterations=1)
    assert h.state_size == N * sd.VALUE and disk > N * sd.VALUE


def test_one_writer_per_change(benchmark, workload, root):
    kgs, data, _ = workload
    base = _fresh(root)
    _, h, _ = benchmark.pedantic(lambda: sd.write_per_change(base(), kgs, data), rounds=1, iterations=1)
    assert h.state_size == N * sd.VALUE


def test_eight_writers_concurrently(benchmark, workload, root):
    kgs, data, offs = workload
    base = _fresh(root)
    _, handles, metrics = benchmark.pedantic(lambda: sd.concurrent_writers(base(), kgs, data, offs),
                                             rounds=3, iterations=1)
    assert sum(h.state_size for h in handles) == N * sd.VALUE
    assert metrics["ChangelogStorage.uploadBatchSizes"]["max"] >= 1


def test_read_back(benchmark, workload, root):
    kgs, data, offs = workload
    base = os.path.join(root, "written")
    _, h, _ = sd.write_vectorised(base, kgs, data, offs)
    _, count = benchmark.pedantic(lambda: sd.read_back(base, h), rounds=3, iterations=1)
    assert count == N


def test_plain_write_ceiling(benchmark, root):
    benchmark.pedantic(lambda: sd.plain_write_ceiling(os.path.join(root, "plain"), int(N * sd.VALUE * 1.04)),
                       rounds=3, iterations=1)


def test_small_checkpoint_persist_latency(benchmark, root):
    lat = benchmark.pedantic(lambda: sd.persist_latencies(os.path.join(root, "lat"), 50), rounds=1, iterations=1)
    assert len(lat) == 50
