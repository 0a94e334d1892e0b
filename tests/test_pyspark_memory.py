"""StatefulStream under `spark.executor.pyspark.memory` (an address-space limit on Spark's Python
workers and everything they start, the slots included), on real Spark in local mode.

Each run is a driver process of its own (tests/pyspark_memory_driver.py): the setting applies to a
new SparkContext only. Its slots and upload services live in a private runtime directory and are
stopped by PID afterwards."""
from __future__ import annotations

import json
import os
import signal
import sys
import tempfile
import time

import pandas as pd
import pytest

from conftest import heavy
from driver_util import HERE, run_driver

pytest.importorskip("pyspark")
sys.path.insert(0, HERE)
from pyspark_memory_driver import keys_of  # noqa: E402


def _slot_pids(root: str):
    """Slot processes whose pid files are under `root` and that still run a slot."""
    pids = []
    for d, _, files in os.walk(root):
        for name in files:
            if not name.endswith(".pid") or os.path.basename(d) != "_slots":
                continue
            try:
                with open(os.path.join(d, name)) as f:
                    pid = int(f.read().strip())
                with open(f"/proc/{pid}/cmdline", "rb") as f:
                    if b"dstl.spark.slot" in f.read():
                        pids.append(pid)
            except (OSError, ValueError):
                continue
    return pids


@pytest.fixture
def own_runtime(monkeypatch):
    """A runtime directory for the drivers' slots and services, emptied by PID afterwards."""
    from service_util import stop_services_under

    root = tempfile.mkdtemp(prefix="dpm", dir="/tmp")  # short: it holds Unix sockets
    monkeypatch.setenv("DSTL_RUNTIME_DIR", root)
    try:
        yield root
    finally:
        deadline = time.monotonic() + 10  # a slot exits on its own once its pyspark daemon is gone
        while _slot_pids(root) and time.monotonic() < deadline:
            time.sleep(0.2)
        for pid in _slot_pids(root):
            os.kill(pid, signal.SIGKILL)
        stop_services_under(root)
        import shutil

        shutil.rmtree(root, ignore_errors=True)


def _run(base: str, memory: str, first: int, last: int, per_batch: int):
    code, out = run_driver("pyspark_memory_driver.py", [base, memory, str(first), str(last), str(per_batch)],
                           None, timeout=900)
    lines = [json.loads(line) for line in out.splitlines() if line.startswith('{"batch"')]
    return code, lines, out


def _expected(batches, per_batch: int) -> pd.DataFrame:
    seen: dict = {}
    out = []
    for b in batches:
        for k in keys_of(b, per_batch, "int"):
            seen[k] = seen.get(k, 0) + 1
            out.append((b, k, seen[k]))
    return pd.DataFrame(out, columns=["batch_id", "k", "n"])


def _output(base: str) -> pd.DataFrame:
    got = pd.read_parquet(os.path.join(base, "output"))
    got["batch_id"] = got["batch_id"].astype("int64")
    return got[["batch_id", "k", "n"]].astype("int64").sort_values(["batch_id", "k"]).reset_index(drop=True)


@heavy
@pytest.mark.spark
def test_heap_table_of_300k_keys_runs_under_1g(own_runtime, tmp_path):
    """300,000 keys in batches of 200,000 rows (100,000-200,000 new keys each) under
    pyspark.memory=1g on local[1]: the first batch and the later ones pass, output exact."""
    base, per = str(tmp_path / "job"), 200_000
    code, lines, out = _run(base, "1g", 0, 3, per)
    assert code == 0, out[-4000:]
    assert [(x["batch"], x["ok"]) for x in lines] == [(0, True), (1, True), (2, True)]
    pd.testing.assert_frame_equal(_output(base), _expected(range(3), per))


@heavy
@pytest.mark.spark
def test_state_outgrowing_the_limit_fails_clearly_and_resumes_with_a_larger_one(own_runtime, tmp_path):
    """Under a 600m limit the state grows until a batch fails with SlotMemoryError, its message the
    driver's first line, naming the state's size, the limit and the setting; nothing is lost: the
    same job rerun under 1g resumes at that batch and the output is exact."""
    # batches of 300,000 rows keep Spark's own worker well inside 600m (500,000 took it to 552 MiB)
    base, per, planned = str(tmp_path / "job"), 300_000, 12
    code, lines, out = _run(base, "600m", 0, planned, per)
    assert code == 3, out[-4000:]
    failed = lines[-1]
    assert not failed["ok"] and all(x["ok"] for x in lines[:-1]), lines
    assert failed["batch"] >= 1, lines  # the slot itself fits: the state outgrew it
    assert failed["type"] == "SlotMemoryError", failed
    first = failed["first_line"]
    assert first.startswith("subtask 0's state outgrows its slot's memory limit") or \
        first.startswith("subtask 0's slot ran out of its memory limit"), first
    assert "keys ('count': " in first and "600 MiB" in first and "spark.executor.pyspark.memory" in first, first
    assert "spark.executor.memoryOverhead" in first, first

    code, lines, out = _run(base, "1g", failed["batch"], failed["batch"] + 2, per)
    assert code == 0, out[-4000:]
    assert [x["ok"] for x in lines] == [True, True]
    pd.testing.assert_frame_equal(_output(base), _expected(range(failed["batch"] + 2), per))
