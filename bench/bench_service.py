"""pytest-benchmark: the upload-service workload, `thread` vs `process` mode (smaller by default).

Run: .venv/bin/python -m pytest bench/bench_service.py --benchmark-only
(`bench/service_report.py` runs the full issue-4 workload and prints the ratios.)
Each round starts fresh writer processes; the measured time includes their start-up, so compare the
`extra_info` fields (wall time of the append/persist loop, CPU per MB) rather than the raw timings.
"""
import os
import sys

import pytest

sys.path.insert(0, os.path.dirname(os.path.abspath(__file__)))
from _service_workload import run_mode  # noqa: E402

WRITERS = int(os.environ.get("DSTL_BENCH_WRITERS", 4))
CHANGES = int(os.environ.get("DSTL_BENCH_CHANGES", 250_000))
EVERY = int(os.environ.get("DSTL_BENCH_EVERY", 50_000))


@pytest.mark.parametrize("compression", [False, True], ids=["raw", "snappy"])
@pytest.mark.parametrize("mode", ["thread", "process"])
def test_service_workload(benchmark, mode, compression):
    result = benchmark.pedantic(run_mode, args=(mode, WRITERS, CHANGES, EVERY, 100, compression, "records"),
                                rounds=1, iterations=1)
    benchmark.extra_info.update(result)
    assert result["files"] <= result["persists"]
