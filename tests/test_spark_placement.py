"""One Spark stage of P concurrent tasks per batch, subtasks that stay on their executors, and lost
Python workers and executors that change nothing in the output (dstl.spark.session, docs/spark.md
"Placement"). Checked from Spark's own event log, not only from dstl's reports.

Heavy (driver processes with their own JVMs; local-cluster starts two executor JVMs): runs under
the Cython build only; the pure-Python twins run the same tasks in tests/test_stream.py.
"""
from __future__ import annotations

import json
import os

import pandas as pd

from conftest import heavy
from dstl import cli
from driver_util import run_driver
from eventlog_util import batch_plan_nodes, batch_stages, overlapping, successful
from streaming_util import make_batches, normalize, read_output, reference_counts

pytestmark = heavy

EVENTS, KEYS = 400, 60
COLUMNS = ["batch_id", "user", "events", "value_sum", "batches", "kinds", "top_kind_events"]


def _drive(tmp_path, name, master, parallelism, batches, base, first=0, faults=None, conf=()):
    result, eventlog = str(tmp_path / f"{name}.json"), str(tmp_path / f"events-{name}")
    rc, out = run_driver("placement_driver.py", [
        result, "--master", master, "--parallelism", str(parallelism), "--batches", str(batches),
        "--first-batch", str(first), "--base", base, "--events", str(EVENTS), "--keys", str(KEYS),
        "--eventlog", eventlog] + [a for kv in conf for a in ("--conf", kv)], faults, timeout=480)
    assert rc == 0, out[-4000:]
    with open(result) as f:
        results = json.load(f)
    assert [r["batch"] for r in results] == list(range(first, batches))
    return results, batch_stages(eventlog), out


def _check_exact(base, n_batches):
    expected = reference_counts(make_batches(n_batches, EVENTS, KEYS))
    got = read_output(os.path.join(base, "output"))
    pd.testing.assert_frame_equal(normalize(got, COLUMNS), normalize(expected, COLUMNS))


def _check_stages(results, stages, parallelism):
    """Every batch: one stage whose P partitions each succeeded once, on the executor the report names."""
    for r in results:
        runs = stages[r["batch"]]
        ok = successful(runs)
        assert sorted(ok) == list(range(parallelism)), (r["batch"], runs)
        assert len([x for x in runs if x.success]) == parallelism
        for rep in r["reports"]:
            assert rep["executor"] == ok[rep["subtask"]].executor, (r["batch"], rep)


def _warm(results):
    reps = [rep for r in results for rep in r["reports"]]
    return sum(rep["continued"] for rep in reps), len(reps)


def test_local_mode_keeps_every_subtask_warm_in_its_slot_and_survives_a_killed_slot_and_worker(
        tmp_path, capsys, monkeypatch):
    """local[2,4], P=4: the tasks of a batch run in several Python workers of the one executor, and
    every subtask continues from memory in its slot process (dstl.spark.slot_client) whichever worker Spark
    picked. Batch 1: the Python worker of subtask 0 is SIGKILLed while its slot runs the task (the
    slot must exit and never be used again). Batch 2: subtask 1's slot itself is SIGKILLed half-way
    through its rows. Each retry restores; the output is exact."""
    base = str(tmp_path / "job")
    # a local base path gets no local copies by default (they would only double the writes); the
    # variable turns them on, so this test sees the same-host restores a remote base path gets
    monkeypatch.setenv("DSTL_LOCAL_RECOVERY_DIR", str(tmp_path / "local-recovery"))
    # the slot of subtask 0 stalls in batch 1, so that its worker surely dies while the task runs
    monkeypatch.setenv("DSTL_FAULTS_STALL_S", "4")
    m1, m2, m3 = (str(tmp_path / f"fired-{n}") for n in ("worker", "slot", "stall"))
    results, stages, out = _drive(tmp_path, "local", "local[2,4]", 4, 4, base, faults=(
        f"task.mid_batch@1/0=stall:once={m3},task.worker_wait@1/0=kill:once={m1},"
        f"task.mid_batch@2/1=kill:once={m2}"))
    _check_stages(results, stages, 4)
    for r in results:
        assert overlapping(stages[r["batch"]]), r["batch"]       # two cores busy at once
        assert {rep["executor"] for rep in r["reports"]} == {"driver"}
        assert all(rep["hop_ms"] > 0 for rep in r["reports"])   # each task went through its slot
    by = {(r["batch"], rep["subtask"]): rep for r in results for rep in r["reports"]}
    # each killed task failed once in Spark's records and its retry restored the subtask in a new slot
    for batch, subtask in ((1, 0), (2, 1)):
        assert any(x.partition == subtask and not x.success for x in stages[batch]), (batch, subtask)
        retried = by[batch, subtask]
        assert retried["attempt"] >= 1 and retried["restored"] and not retried["continued"], retried
        # from the dead slot's copies on this host (kept for DSTL_LOCAL_RECOVERY_GRACE_S after it died)
        assert retried["restore_source"] == "local", retried
        assert retried["pid"] != by[batch - 1, subtask]["pid"]
    # every other subtask-batch after the first continued in the same slot process
    for (batch, subtask), rep in by.items():
        if batch == 0 or (batch, subtask) in ((1, 0), (2, 1)):
            continue
        assert rep["continued"] and rep["restore_source"] == "memory", rep
        assert rep["pid"] == by[batch - 1, subtask]["pid"], (batch, subtask)
    # the slots whose task was killed are gone (the worker's slot exited by itself)
    from dstl.runtime_dir import pid_alive

    assert not pid_alive(by[0, 0]["pid"]) and not pid_alive(by[1, 1]["pid"])
    # one INFO line per batch, naming each subtask's executor
    lines = [ln for ln in out.splitlines() if "dstl.spark.placement INFO batch" in ln]
    assert len(lines) == 4 and all("0@driver:" in ln for ln in lines)
    _check_exact(base, 4)
    # `dstl state ls` shows the figures the checkpoints recorded
    capsys.readouterr()
    assert cli.main(["state", "ls", base, "--json"]) == 0
    last = json.loads(capsys.readouterr().out)["checkpoints"][-1]["placement"]
    assert last == {k: results[-1]["placement"][k] for k in last} and last["executors"] == ["driver"] * 4
    assert last["warm"] == 4 and last["restored"] == 0


def test_local_cluster_subtasks_stay_on_their_executors_and_move_once_when_one_is_lost(tmp_path):
    """local-cluster[2,1,1024]: two executor JVMs with one core each. P=2 for 8 batches of rows from
    a Spark DataFrame (the shuffle route), the executor of subtask 0 SIGKILLed half-way through batch 3. (The rescale to P=4 on a cluster, and its warm
    rate, are tests/test_cluster.py's.)"""
    base = str(tmp_path / "job")
    marker = str(tmp_path / "fired")
    cluster = "local-cluster[2,1,1024]"
    # docs/spark.md recommends a locality wait above the longest task: on this loaded 2-core machine
    # a restore-heavy batch can outlast the default 3 s, and an idle executor then takes a subtask
    # for one batch
    wait = ["spark.locality.wait=30s"]
    first, stages1, out1 = _drive(tmp_path, "p2", cluster, 2, 8, base, conf=wait,
                                  faults=f"task.mid_batch@3/0=kill-executor:once={marker}")
    _check_stages(first, stages1, 2)
    # the rows were shuffled to their subtasks, never broadcast, and until the kill every task ran
    # PROCESS_LOCAL: where its subtask's anchor block is cached
    plans = batch_plan_nodes(str(tmp_path / "events-p2"))
    for r in first:
        nodes = plans[r["batch"]]
        assert r["route"] == "shuffle" and nodes, (r["batch"], r.get("route"))
        assert not [x for x in nodes if "Broadcast" in x], (r["batch"], sorted(set(nodes)))
        assert "SortMergeJoin" in nodes and any(x.startswith("Exchange") for x in nodes), sorted(set(nodes))
    for b in range(3):
        assert all(x.locality == "PROCESS_LOCAL" for x in successful(stages1[b]).values()), stages1[b]
    execs = [[rep["executor"] for rep in r["reports"]] for r in first]
    # both executors work at once: subtasks 0 and 1 on different executors, overlapping in time
    assert all(len(set(e)) == 2 for e in execs[:3]), execs
    assert all(overlapping(stages1[b]) for b in range(3))
    # subtask 0 stays put until its executor dies ...
    assert execs[0][0] == execs[1][0] == execs[2][0]
    lost = execs[2][0]
    assert any(x.partition == 0 and not x.success and x.executor == lost for x in stages1[3])
    # ... then moves once (its retry restores the state) and stays on its new executor
    [moved] = [rep for rep in first[3]["reports"] if rep["subtask"] == 0]
    # (its attempt number can be 0: the lost executor's shuffle output goes with it, and Spark
    # resubmits the stage, whose attempts count from 0 again; the failed attempt is asserted above)
    assert moved["restored"] and moved["executor"] != lost
    assert first[3]["placement"]["moved"] >= 1 and 0 in first[3]["placement"]["moved_subtasks"]
    assert len({e[0] for e in execs[3:]}) == 1, execs
    # warm continuations after the first batch, the lost executor's batch aside
    warm, total = _warm(first[1:3] + first[4:])
    assert warm >= 0.9 * total, (warm, total, execs)
    _check_exact(base, 8)
