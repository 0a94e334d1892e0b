"""How a batch's rows reach their subtask's task (dstl.spark.routing, dstl.spark.session): a Spark
DataFrame is shuffled executor to executor into the placed stage, never collected or broadcast by
the driver; only a small pandas batch the driver holds is broadcast. The Spark scenarios check
Spark's own records (event log: plans, tasks, locality), not dstl's reports alone.

The Spark scenarios are heavy (driver processes with their own JVMs): Cython build only.
"""
from __future__ import annotations

import json

import numpy as np
import pandas as pd
import pytest

from conftest import heavy
from driver_util import run_driver
from eventlog_util import batch_plan_nodes, batch_stages, successful
from streaming_util import read_output

from dstl.spark import routing


# ------------------------------------------------------------------ the route choice (no Spark)

def test_a_small_pandas_batch_is_broadcast_and_a_large_one_shuffled(monkeypatch):
    monkeypatch.setattr(routing, "BROADCAST_MAX_BYTES", 64_000)
    small = pd.DataFrame({"user": [f"u{i}" for i in range(100)], "value": np.arange(100)})
    assert routing.choose_route(small) == routing.BROADCAST
    # the size counts the strings' characters, not only the column pointers
    wide = pd.DataFrame({"user": ["x" * 1000] * 100, "value": np.arange(100)})
    assert wide.memory_usage(index=False, deep=False).sum() < 64_000
    assert routing.choose_route(wide) == routing.SHUFFLE
    assert routing.choose_route(pd.DataFrame({"v": np.arange(10_000)})) == routing.SHUFFLE


def test_anything_but_a_pandas_batch_is_shuffled_and_a_given_route_is_checked():
    class SparkLikeFrame:  # a Spark DataFrame's size is unknown without evaluating it
        pass

    assert routing.choose_route(SparkLikeFrame()) == routing.SHUFFLE
    small = pd.DataFrame({"v": [1]})
    assert routing.choose_route(small, "shuffle") == routing.SHUFFLE
    with pytest.raises(ValueError, match="route must be one of shuffle, broadcast, got 'hash'"):
        routing.choose_route(small, "hash")


def test_salts_send_each_subtask_to_its_partition():
    for p in (1, 2, 3, 4, 7, 128):
        salts = routing.partition_salts(p)
        assert [routing.spark_hash_int(s) % p for s in salts] == list(range(p))


# ------------------------------------------------------------------ Spark's records

ROWS, KEYS, PAYLOAD = 24_000, 600, 256   # about 7 MB a batch (3+ MB compressed): over the driver's 1 MB limit


def _drive(tmp_path, name, master, parallelism, batches, conf):
    result, eventlog = str(tmp_path / f"{name}.json"), str(tmp_path / f"events-{name}")
    base = str(tmp_path / name)
    conf = ["spark.driver.maxResultSize=1m", "spark.sql.adaptive.enabled=true"] + conf
    rc, out = run_driver("route_driver.py", [
        result, "--master", master, "--parallelism", str(parallelism), "--batches", str(batches),
        "--base", base, "--rows", str(ROWS), "--keys", str(KEYS), "--payload", str(PAYLOAD),
        "--eventlog", eventlog, "--probe-broadcast"] + [a for kv in conf for a in ("--conf", kv)],
        None, timeout=600)
    assert rc == 0, out[-4000:]
    with open(result) as f:
        got = json.load(f)
    return got, base, eventlog


def _check_output(base, batches):
    """Every key is in every batch (ROWS a multiple of KEYS, 7919 coprime to KEYS): after the last
    batch each key has counted ROWS/KEYS events per batch and the exact sum of its values."""
    ids = np.arange(batches * ROWS)
    users = ids * 7919 % KEYS
    value_sum = np.bincount(users, weights=ids % 10, minlength=KEYS).astype(np.int64)
    out = read_output(f"{base}/output")
    last = out[out["batch_id"] == batches - 1].set_index("user").sort_index()
    assert len(last) == KEYS
    assert (last["events"] == batches * ROWS // KEYS).all()
    assert (last["batches"] == batches).all()
    expected = pd.Series(value_sum, index=[f"u{i}" for i in range(KEYS)]).sort_index()
    assert last["value_sum"].to_numpy().tolist() == expected.to_numpy().tolist()


def _check_records(got, eventlog, parallelism):
    """The batch could not have been broadcast; no batch's plan broadcast anything; each batch ran
    one stage of P tasks, one per subtask, each on the executor its report names and local to it."""
    assert "maxResultSize" in got["probe"], got["probe"]   # the old route fails on this driver
    stages, plans = batch_stages(eventlog), batch_plan_nodes(eventlog)
    for b in got["batches"]:
        n = b["batch"]
        assert b["route"] == "shuffle"
        nodes = plans[n]
        assert nodes and not [x for x in nodes if "Broadcast" in x], (n, sorted(set(nodes)))
        assert "SortMergeJoin" in nodes and any(x.startswith("Exchange") for x in nodes), sorted(set(nodes))
        runs = stages[n]
        ok = successful(runs)
        assert sorted(ok) == list(range(parallelism)), (n, runs)   # P tasks: nothing coalesced or split
        assert len([r for r in runs if r.success]) == parallelism
        assert all(r.locality == "PROCESS_LOCAL" for r in ok.values()), (n, runs)
        for rep in b["reports"]:
            assert rep["executor"] == ok[rep["subtask"]].executor, (n, rep)
        assert sum(rep["rows_in"] for rep in b["reports"]) == ROWS


@heavy
def test_local_mode_shuffles_a_batch_the_driver_could_not_broadcast(tmp_path):
    """local[2], P=4, AQE on and tempted to coalesce (a 1 KB advisory partition size): the batch is
    shuffled into one stage of 4 tasks each batch."""
    conf = ["spark.sql.adaptive.coalescePartitions.enabled=true",
            "spark.sql.adaptive.advisoryPartitionSizeInBytes=1k",
            "spark.sql.adaptive.coalescePartitions.minPartitionSize=1k"]
    got, base, eventlog = _drive(tmp_path, "local", "local[2]", 4, 3, conf)
    _check_records(got, eventlog, 4)
    _check_output(base, 3)


@heavy
def test_local_cluster_shuffled_batches_keep_each_subtask_on_its_executor(tmp_path):
    """local-cluster[2,1,1024]: two executor JVMs with one core each (one Python worker each), P=2
    for 4 batches: subtask i runs PROCESS_LOCAL on the same executor every batch and continues its
    state from memory after the first."""
    got, base, eventlog = _drive(tmp_path, "cluster", "local-cluster[2,1,1024]", 2, 4,
                                 ["spark.locality.wait=30s"])
    _check_records(got, eventlog, 2)
    execs = [[rep["executor"] for rep in sorted(b["reports"], key=lambda r: r["subtask"])] for b in got["batches"]]
    assert len(set(execs[0])) == 2 and all(e == execs[0] for e in execs), execs
    later = [rep for b in got["batches"][1:] for rep in b["reports"]]
    assert all(rep["continued"] for rep in later), later
    _check_output(base, 4)
