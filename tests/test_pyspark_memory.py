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
from state_helpers import storage  # noqa: E402,F401 - fixture


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
def test_heap_table_of_400k_keys_runs_under_1g(own_runtime, tmp_path):
    """400,000 keys in batches of 200,000 rows (200,000, then 100,000 new keys each, the rest
    updates) under pyspark.memory=1g on local[1]: the first batch and the later ones pass, output exact."""
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
    same job rerun under 1g resumes at that batch and the output is exact. The slot exits with its
    state."""
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
    assert failed["slots_alive"] == 0, failed  # the slot left with its state, freeing its memory

    code, lines, out = _run(base, "1g", failed["batch"], failed["batch"] + 2, per)
    assert code == 0, out[-4000:]
    assert [x["ok"] for x in lines] == [True, True]
    pd.testing.assert_frame_equal(_output(base), _expected(range(failed["batch"] + 2), per))


# --- the parts, without Spark (both implementations) -------------------------------------------------

_BOUNDED_CHILD = """
import os, resource, sys, threading
from dstl.spark import memory_limit
limit = memory_limit.bound_process()
import pyarrow as pa
arr = pa.array(range(200_000))  # the pool's first allocation
done = threading.Event()
errors = []
def work():
    try:
        [bytes(4096) for _ in range(1000)]  # each thread allocates (glibc: an arena of its own if it may)
    except BaseException as exc:
        errors.append(repr(exc))
    done.wait()
threads = [threading.Thread(target=work) for _ in range(16)]
for t in threads:
    t.start()
done.set()
for t in threads:
    t.join()
print(limit, pa.default_memory_pool().backend_name, threading.stack_size(), len(errors), arr.sum().as_py())
"""


def _child(code: str, env: dict, limit: int):
    import resource
    import subprocess

    def cap():
        resource.setrlimit(resource.RLIMIT_AS, (limit, limit))

    return subprocess.run([sys.executable, "-c", code], env=env, preexec_fn=cap, capture_output=True,
                          text=True, timeout=120)


def test_a_process_under_a_limit_starts_bounded_and_its_threads_and_pool_fit():
    """What a slot gets under pyspark.memory: started with `bounded_env` under a 700 MiB address
    space, it loads pyarrow, allocates from its pool and runs 16 allocating threads."""
    from dstl.spark import memory_limit

    limit = 700 << 20
    env = memory_limit.bounded_env({k: v for k, v in os.environ.items() if k not in memory_limit.BOUNDED_ENV},
                                   limit)
    assert env["MALLOC_ARENA_MAX"] == "2" and env["ARROW_DEFAULT_MEMORY_POOL"] == "system"
    proc = _child(_BOUNDED_CHILD, env, limit)
    assert proc.returncode == 0, proc.stderr[-2000:]
    got = proc.stdout.split()
    assert got == [str(limit), "system", str(memory_limit.THREAD_STACK), "0", str(sum(range(200_000)))]


def test_bounded_env_keeps_what_the_user_set_and_changes_nothing_without_a_limit():
    from dstl.spark import memory_limit

    env = {"MALLOC_ARENA_MAX": "4", "PATH": "/bin"}
    assert memory_limit.bounded_env(env, None) is env
    out = memory_limit.bounded_env(env, 1 << 30)
    assert out["MALLOC_ARENA_MAX"] == "4" and out["OPENBLAS_NUM_THREADS"] == "1" and out["PATH"] == "/bin"
    assert env == {"MALLOC_ARENA_MAX": "4", "PATH": "/bin"}  # not changed in place
    assert memory_limit.address_space_limit() is None or memory_limit.address_space_limit() > 0


def _backend_with(storage, n: int):
    from dstl.state.backend import KeyedStateBackend
    from state_helpers import FULL, MAXP

    backend = KeyedStateBackend(storage, "op", FULL, MAXP)
    backend.value_state("count").update_many(list(range(n)), [1] * n)
    backend.value_state("other").update_many(list(range(7)), [2] * 7)
    return backend


def test_the_check_fails_a_task_near_the_limit_naming_size_limit_and_setting(storage, monkeypatch):
    from dstl.spark import memory_limit
    from dstl.spark.memory_limit import SlotMemoryError

    backend = _backend_with(storage, 1234)
    entries = memory_limit.state_entries([backend])
    assert entries == {"count": 1234, "other": 7}
    peak = memory_limit.address_space()["VmPeak"]
    memory_limit.check_after_task(0, peak + (1 << 30), entries, 5 << 20)  # far from the limit: nothing
    memory_limit.check_after_task(0, None, entries)  # no limit: nothing
    near = ((peak >> 20) + 16) << 20  # 16-17 MiB above the peak, a whole number of MiB
    with pytest.raises(SlotMemoryError) as info:
        memory_limit.check_after_task(3, near, entries, 5 << 20)
    msg = str(info.value)
    assert msg.startswith("subtask 3's state outgrows its slot's memory limit: it holds 1,234 keys "
                          "('count': 1,234, 'other': 7), 5.0 MiB in its checkpoint's changelog"), msg
    assert f"of its {near >> 20:,} MiB limit (spark.executor.pyspark.memory)" in msg
    assert f"(now {near >> 20:,} MiB)" in msg
    assert "raise spark.executor.pyspark.memory" in msg and "\n" not in msg
    monkeypatch.setenv(memory_limit.ENV_CHECK, "off")
    memory_limit.check_after_task(3, near, entries)


def test_a_failed_allocation_under_a_limit_becomes_the_clear_error(storage):
    from dstl.spark import memory_limit

    entries = memory_limit.state_entries([_backend_with(storage, 10)])
    for exc in (MemoryError(), RuntimeError("can't start new thread")):
        err = memory_limit.out_of_memory(1, 512 << 20, exc, entries)
        assert isinstance(err, memory_limit.SlotMemoryError)
        assert str(err).startswith(f"subtask 1's slot ran out of its memory limit during the task "
                                   f"({type(exc).__name__}"), str(err)
        assert "10 keys ('count': 10, 'other': 7)" in str(err) and "512 MiB limit (spark.executor.pyspark.memory)" in str(err)
    assert memory_limit.out_of_memory(1, 512 << 20, ValueError("x"), entries) is None
    assert memory_limit.out_of_memory(1, None, MemoryError(), entries) is None  # no limit: not ours


def test_the_driver_raises_the_slot_error_with_its_message_first():
    from dstl.spark.errors import raise_from_worker
    from dstl.spark.memory_limit import SlotMemoryError

    worker = RuntimeError("An exception was thrown from the Python worker:\nTraceback (most recent call last):\n"
                          '  File "slots.py", line 345, in call\n    raise exc from remote\n'
                          "dstl.spark.memory_limit.SlotMemoryError: subtask 0's state outgrows it\n")
    with pytest.raises(SlotMemoryError, match="^subtask 0's state outgrows it$") as info:
        raise_from_worker(worker)
    assert info.value.__cause__ is worker
    assert raise_from_worker(RuntimeError("ValueError: something else")) is None
