"""Slots (dstl.spark.slot_client): the process per subtask and host that keeps the state warm whichever
Python worker runs the task. Without Spark: the real task body (`run_placed` -> the slot ->
`run_subtask`) against a real CheckpointCoordinator on a local base path, real slot processes,
stopped by PID. The Spark side is tests/test_spark_routing.py (fast tier) and
tests/test_spark_placement.py (killed slots and workers)."""
from __future__ import annotations

import os
import signal
import socket
import subprocess
import sys
import textwrap
import threading
import time

import pandas as pd
import pyarrow as pa
import pytest

from conftest import heavy_twins
from dstl.runtime_dir import pid_alive
from dstl.spark import slot_client
from dstl.spark.coordinator import CheckpointCoordinator, JobSpec
from dstl.spark.report import TaskReport
from dstl.spark.task import run_placed

SCHEMA = pa.schema([("key", pa.int64()), ("count", pa.int64())])


def count_fn(rows, state):
    """Per key: how many rows so far (a value state), emitted for the keys of this batch."""
    counts = state.value_state("n")
    out = []
    for key, n in rows.groupby("key").size().items():
        total = (counts.get(int(key)) or 0) + int(n)
        counts.update(int(key), total)
        out.append((int(key), total))
    return pd.DataFrame(out, columns=["key", "count"])


def failing_fn(rows, state):
    raise KeyError("no such column in the user's function")


def _wait_gone(pid: int, timeout_s: float = 10.0) -> bool:
    deadline = time.monotonic() + timeout_s
    while time.monotonic() < deadline:
        if not pid_alive(pid):
            return True
        time.sleep(0.05)
    return False


def _slot_pids():
    d = slot_client.slots_dir()
    pids = []
    for name in os.listdir(d):
        if name.endswith(".pid"):
            try:
                with open(os.path.join(d, name)) as f:
                    pids.append(int(f.read().strip()))
            except (OSError, ValueError):
                pass
    return pids


@pytest.fixture
def slot_env(monkeypatch, tmp_path):
    """A runtime directory of the test's own; every slot started in it is SIGKILLed by PID after."""
    monkeypatch.setenv("DSTL_RUNTIME_DIR", str(tmp_path / "rt"))
    monkeypatch.delenv(slot_client.ENV_SWITCH, raising=False)
    yield
    from dstl.spark import cache

    cache.shutdown()  # what a task ran in this process (slots off) keeps its storage and threads
    for pid in _slot_pids():
        try:
            os.kill(pid, signal.SIGKILL)
        except ProcessLookupError:
            pass
        _wait_gone(pid)


def _job(tmp_path, name="counts"):
    base = str(tmp_path / name)
    opts = {"upload.mode": "thread"}
    return CheckpointCoordinator.open(base, JobSpec.new(name, 8, base + "/output"), opts, resume=False)


def _batch(coord, batch: int, keys, fn=count_fn, watch=None, subtask: int = 0):
    plan = coord.plan(batch, 1)
    rows = pd.DataFrame({"key": pd.array(keys, dtype="int64")})
    if watch is None:
        report = TaskReport(**run_placed(plan, fn, rows, subtask, 0, SCHEMA))
    else:
        payload = slot_client.dumps(dict(plan=plan, fn=fn, rows=rows, subtask=subtask, attempt=0, arrow_schema=SCHEMA),
                              by_value=True)
        report = TaskReport(**slot_client.call(slot_client.slot_name(plan.job_id, plan.operator_id, subtask), payload,
                                         (None, "driver"), subtask, watch=watch))
    report.output = pd.read_parquet(report.staged) if report.staged else None  # before the commit moves it
    coord.complete(plan, [report])
    return report


def test_the_state_stays_in_one_slot_process_across_batches(slot_env, tmp_path):
    import dstl

    coord = _job(tmp_path)
    first = _batch(coord, 0, [1, 2, 2])
    second = _batch(coord, 1, [2, 3])
    assert first.pid == second.pid != os.getpid()           # the slot, not this process
    assert first.restore_source == "new" and not first.continued
    assert second.continued and second.restore_source == "memory" and second.restore_ms == 0
    assert second.hop_ms > 0 and second.start_ms >= 0
    out = second.output.sort_values("key")
    assert out.to_dict("list") == {"key": [2, 3], "count": [3, 1]}
    # the slot runs the implementation this process runs (its name includes it)
    assert slot_client.slot_name("j", "op", 0) != slot_client.slot_name("j", "op", 1)
    assert dstl.IMPLEMENTATION in ("cython", "python")


def test_off_runs_the_task_in_this_process(slot_env, tmp_path, monkeypatch):
    monkeypatch.setenv(slot_client.ENV_SWITCH, "off")
    assert not slot_client.enabled()
    coord = _job(tmp_path)
    report = _batch(coord, 0, [1])
    assert report.pid == os.getpid() and report.hop_ms == 0


def test_the_functions_exception_is_raised_in_the_worker_with_the_slots_traceback(slot_env, tmp_path):
    coord = _job(tmp_path)
    plan = coord.plan(0, 1)
    with pytest.raises(KeyError, match="no such column") as info:
        run_placed(plan, failing_fn, pd.DataFrame({"key": [1]}), 0, 0, SCHEMA)
    cause = info.value.__cause__
    assert isinstance(cause, slot_client.RemoteTraceback) and "failing_fn" in cause.tb and "slot process" in str(cause)
    # the failed task's state was thrown away, not cached: the next attempt starts from the checkpoint
    report = TaskReport(**run_placed(plan, count_fn, pd.DataFrame({"key": [1]}), 0, 1, SCHEMA))
    assert not report.continued


def test_a_different_forwarded_environment_gets_a_slot_of_its_own(monkeypatch):
    before = slot_client.slot_name("job", "op", 0)
    monkeypatch.setenv("DSTL_SOMETHING_FOR_THE_WORKERS", "1")
    assert slot_client.slot_name("job", "op", 0) != before
    monkeypatch.setenv("UNRELATED_VARIABLE", "1")  # not forwarded to workers: the same slot
    monkeypatch.delenv("DSTL_SOMETHING_FOR_THE_WORKERS")
    assert slot_client.slot_name("job", "op", 0) == before


@heavy_twins  # starts extra processes: the full tier, under both builds
def test_a_slot_exits_when_the_process_it_watches_is_gone(slot_env, tmp_path):
    watched = subprocess.Popen([sys.executable, "-c", "import time; time.sleep(600)"])
    try:
        coord = _job(tmp_path)
        report = _batch(coord, 0, [1], watch=watched.pid)
        assert pid_alive(report.pid)
    finally:
        watched.kill()
        watched.wait()
    assert _wait_gone(report.pid), "the slot outlived the daemon of the worker it served"
    # it cleaned up: no socket, pid file or log left for its name
    name = slot_client.slot_name(coord.spec.job_id, coord.spec.operator_id, 0)
    assert not [f for f in os.listdir(slot_client.slots_dir()) if f.startswith(name) and not f.endswith(".lock")]


def test_a_slot_exits_when_its_socket_is_removed(slot_env, tmp_path):
    coord = _job(tmp_path)
    report = _batch(coord, 0, [1])
    name = slot_client.slot_name(coord.spec.job_id, coord.spec.operator_id, 0)
    os.unlink(slot_client.paths(name)["sock"])  # a temp cleaner
    assert _wait_gone(report.pid)
    # the next task starts a new slot, which restores the subtask from the checkpoint
    again = _batch(coord, 1, [1])
    assert again.pid != report.pid and again.restored and again.restore_source == "dfs"


@heavy_twins  # starts extra processes: the full tier, under both builds
def test_a_slot_whose_worker_dies_mid_task_exits_without_its_state(slot_env, tmp_path):
    coord = _job(tmp_path)
    first = _batch(coord, 0, [1, 1])
    plan = coord.plan(1, 1)
    import pickle

    worker = subprocess.Popen([sys.executable, "-c", textwrap.dedent("""
        import pickle, sys, time
        import pandas as pd
        from dstl.spark.task import run_placed
        plan, schema, marker = pickle.loads(sys.stdin.buffer.read())
        def slow(rows, state):
            state.value_state("n").update(1, 1000)
            open(marker, "w").close()
            time.sleep(60)
        run_placed(plan, slow, pd.DataFrame({"key": [1]}), 0, 0, schema)
    """)], stdin=subprocess.PIPE, env=dict(os.environ, PYTHONPATH=os.pathsep.join(sys.path)))
    marker = str(tmp_path / "inside-slow")
    worker.stdin.write(pickle.dumps((plan, SCHEMA, marker)))
    worker.stdin.close()
    try:
        deadline = time.monotonic() + 60
        while not os.path.exists(marker):  # the slot is inside `slow` now
            assert time.monotonic() < deadline and worker.poll() is None, "the task never reached the slot"
            time.sleep(0.05)
        assert pid_alive(first.pid)
    finally:
        worker.kill()
        worker.wait()
    assert _wait_gone(first.pid, 5.0), "the slot kept running a task nobody waits for"
    # the retry restores the last checkpoint: the dead task's update never happened
    retry = TaskReport(**run_placed(plan, count_fn, pd.DataFrame({"key": [1]}), 0, 1, SCHEMA))
    assert retry.restored and retry.pid != first.pid
    assert pd.read_parquet(retry.staged).to_dict("list") == {"key": [1], "count": [3]}
    coord.complete(plan, [retry])


@heavy_twins  # starts extra processes: the full tier, under both builds
def test_too_many_slots_ask_the_longest_idle_to_exit(slot_env, tmp_path, monkeypatch):
    monkeypatch.setenv("DSTL_SPARK_SLOTS_MAX", "2")
    monkeypatch.setattr(slot_client, "EVICTABLE_IDLE_S", 0.0)
    a = _batch(_job(tmp_path, "a"), 0, [1])
    time.sleep(0.05)
    b = _batch(_job(tmp_path, "b"), 0, [1])
    assert pid_alive(a.pid) and pid_alive(b.pid)   # two: at the limit, nobody asked yet
    c = _batch(_job(tmp_path, "c"), 0, [1])          # a third: the longest idle (a) goes
    assert _wait_gone(a.pid) and pid_alive(b.pid) and pid_alive(c.pid)


def test_a_slot_that_cannot_start_says_why(slot_env, monkeypatch, tmp_path):
    """An interpreter that cannot run the slot: the task fails at once, with the slot's log."""
    broken = tmp_path / "python"
    broken.write_text(f"#!/bin/sh\nexec {sys.executable} -c 'import sys; sys.exit(\"no dstl for this interpreter\")'\n")
    broken.chmod(0o755)
    monkeypatch.setattr(slot_client.sys, "executable", str(broken))
    with pytest.raises(slot_client.SlotError, match="could not start the slot process.*no dstl for this interpreter"):
        slot_client.connect("0123456789abcdef")


# ------------------------------------------------------------------ the collector in a slot (dstl.spark.heap)

#: what gc_fn keeps in the slot process between tasks: a weak reference to a cycle made and dropped
#: in a task, a cycle kept alive across a freeze, then dropped, and objects that grow the heap
_GC: dict = {}


class _Cycle:
    def __init__(self):
        self.me = self


def gc_fn(rows, state):
    """count_fn, plus per batch (rows' "key" column holds the step) one step of the
    scenario below, reporting what the slot's collector did through task_metrics(); other
    numbers are warm-up steps."""
    import gc
    import sys
    import weakref

    from dstl.spark import heap
    from dstl.spark.task import task_metrics

    step = int(rows["key"].iloc[0])
    m = task_metrics()
    m["frozen"] = gc.get_freeze_count()  # what the previous task's end froze
    m["threshold2"] = gc.get_threshold()[2]
    m["full"] = heap.stats["full"]
    if step == 0:  # a cycle made and dropped in the task: found by a young collection
        _GC["young"] = weakref.ref(_Cycle())
    elif step == 1:
        m["young_alive"] = int(_GC["young"]() is not None)
        _GC["kept"] = _Cycle()  # alive when this task ends: frozen with the state
    elif step == 2:
        m["kept_frozen"] = int(not any(o is _GC["kept"] for o in gc.get_objects()))
        _GC["dropped"] = weakref.ref(_GC.pop("kept"))  # cyclic garbage now, but frozen
    elif step == 3:
        m["dropped_alive"] = int(_GC["dropped"]() is not None)
        # more than REGROW of new live objects: this task's end collects everything
        _GC["grow"] = [[i] for i in range(int(sys.getallocatedblocks() * heap.REGROW * 2))]
    elif step == 4:
        m["dropped_alive"] = int(_GC["dropped"]() is not None)
    return count_fn(rows, state)


def _gc_steps(coord, steps):
    return [_batch(coord, coord.next_batch, [step], fn=gc_fn) for step in steps]


def test_a_slot_freezes_its_state_and_still_collects_cyclic_garbage(slot_env, tmp_path):
    coord = _job(tmp_path)
    _gc_steps(coord, [10, 11])  # warm-up: what the first tasks import is frozen by the first full collection
    reports = _gc_steps(coord, [0, 1, 2, 3, 4])
    assert len({r.pid for r in reports}) == 1 and reports[0].pid != os.getpid()
    m = [{k: r.metric(k) for k in ("frozen", "threshold2", "full", "young_alive", "kept_frozen", "dropped_alive")}
         for r in reports]
    assert all(x["frozen"] > 0 for x in m)               # every task found the previous one's heap frozen
    assert m[1]["young_alive"] == 0                      # the task's own cycle: collected
    assert m[2]["kept_frozen"] == 1                      # what outlived a task: out of the collector's way
    # frozen, a dropped cycle waits (no full collection happened in between)...
    assert m[3]["full"] == m[2]["full"] and m[3]["dropped_alive"] == 1
    # ...until the heap grew by REGROW: then everything was collected once, the cycle with it
    assert m[4]["full"] == m[3]["full"] + 1 and m[4]["dropped_alive"] == 0
    assert m[4]["threshold2"] >= 10


def test_the_freeze_can_be_switched_off(slot_env, tmp_path, monkeypatch):
    from dstl.spark import heap

    monkeypatch.setenv(heap.ENV_SWITCH, "off")
    coord = _job(tmp_path)
    reports = _gc_steps(coord, [10, 11])
    assert reports[1].pid == reports[0].pid != os.getpid() and reports[1].metric("frozen") == 0


def test_a_task_run_in_a_process_that_is_no_slot_or_worker_leaves_its_heap_alone(slot_env, tmp_path, monkeypatch):
    import gc

    monkeypatch.setenv(slot_client.ENV_SWITCH, "off")
    before = gc.get_freeze_count()
    coord = _job(tmp_path)
    report = _batch(coord, 0, [1])
    assert report.pid == os.getpid() and gc.get_freeze_count() == before


def test_the_watch_of_a_running_task_stops_at_once_and_sees_its_worker_go(monkeypatch):
    """The slot's watch of the task's worker: stopping it (the task ended) ends its thread while the
    worker is still connected, killing nothing; a worker that goes away mid-task makes it end the
    slot. (How long a task's reply waited for the old timed poll is measured by the benchmarks.)"""
    from dstl.spark.slot_process import _ClientWatch

    died = threading.Event()
    monkeypatch.setattr(_ClientWatch, "_die", lambda self: died.set())
    listener = socket.socket(socket.AF_UNIX, socket.SOCK_STREAM)
    try:
        slot_end, worker_end = socket.socketpair()
        watch = _ClientWatch(slot_end, listener)
        watch.stop()
        assert not watch._thread.is_alive() and not died.is_set()
        worker_end.close()  # after the task: no longer the watch's business
        slot_end.close()
        slot_end, worker_end = socket.socketpair()
        watch = _ClientWatch(slot_end, listener)
        worker_end.close()  # the worker goes away while the task runs
        assert died.wait(10.0), "a closed worker went unnoticed"
        watch.stop()
        slot_end.close()
    finally:
        listener.close()
