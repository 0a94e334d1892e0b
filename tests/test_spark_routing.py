"""How a batch's rows reach their subtask's task (dstl.spark.routing, dstl.spark.session): a Spark
DataFrame is shuffled executor to executor into the placed stage, never collected or broadcast by
the driver; only a small pandas batch the driver holds is broadcast. The Spark scenarios check
Spark's own records (event log: plans, tasks, locality), not dstl's reports alone.

The local-mode scenario is the fast tier's check of the route and of warm state (Cython build
only); on a local-cluster, tests/test_spark_placement.py checks the same records with two executors.
"""
from __future__ import annotations

import json

import numpy as np
import pandas as pd
import pytest

from driver_util import run_driver
from eventlog_util import batch_plan_nodes, batch_stages, successful
from streaming_util import read_output

from dstl.spark import routing


# ------------------------------------------------------------------ the route choice (no Spark)

def test_a_small_pandas_batch_is_broadcast_and_a_large_one_shuffled(monkeypatch):
    monkeypatch.setattr(routing, "BROADCAST_MAX_BYTES", 64_000)
    small = pd.DataFrame({"user": [f"u{i}" for i in range(100)], "value": np.arange(100)})
    assert routing.choose_route(small) == routing.BROADCAST
    # the size counts the strings' characters, not only the column pointers (object strings, pandas
    # 2's default), and under pandas 3's str dtype, whose buffers hold the characters themselves
    wide = pd.DataFrame({"user": pd.Series(["x" * 1000] * 100, dtype=object), "value": np.arange(100)})
    assert wide.memory_usage(index=False, deep=False).sum() < 64_000
    assert routing.choose_route(wide) == routing.SHUFFLE
    assert routing.choose_route(pd.DataFrame({"user": ["x" * 1000] * 100})) == routing.SHUFFLE
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


def _drive(tmp_path, name, master, parallelism, batches, conf, growing=False):
    result, eventlog = str(tmp_path / f"{name}.json"), str(tmp_path / f"events-{name}")
    base = str(tmp_path / name)
    conf = ["spark.driver.maxResultSize=1m", "spark.sql.adaptive.enabled=true"] + conf
    rc, out = run_driver("route_driver.py", [
        result, "--master", master, "--parallelism", str(parallelism), "--batches", str(batches),
        "--base", base, "--rows", str(ROWS), "--keys", str(KEYS), "--payload", str(PAYLOAD),
        "--eventlog", eventlog, "--probe-broadcast"] + (["--growing"] if growing else [])
        + [a for kv in conf for a in ("--conf", kv)], None, timeout=600)
    assert rc == 0, out[-4000:]
    with open(result) as f:
        got = json.load(f)
    return got, base, eventlog


def _check_output(base, batches, growing=False):
    """Every batch's output row of a key holds its exact running figures (events, value sum,
    batches seen), computed here with pandas from the same ids."""
    from route_driver import batch_keys

    frames = []
    for b in range(batches):
        ids = np.arange(b * ROWS, (b + 1) * ROWS)
        frames.append(pd.DataFrame({"batch_id": b, "user": [f"u{u}" for u in ids * 7919 % batch_keys(b, KEYS, growing)],
                                    "value": ids % 10}))
    rows = pd.concat(frames, ignore_index=True)
    per = rows.groupby(["user", "batch_id"]).agg(events=("value", "size"), value_sum=("value", "sum")).reset_index()
    per = per.sort_values(["user", "batch_id"])
    g = per.groupby("user")
    per["events"], per["value_sum"] = g["events"].cumsum(), g["value_sum"].cumsum()
    per["batches"] = g.cumcount() + 1
    expected = per.set_index(["batch_id", "user"]).sort_index()[["events", "value_sum", "batches"]]
    out = read_output(f"{base}/output").set_index(["batch_id", "user"]).sort_index()
    assert len(out) == len(expected)
    assert (out.index == expected.index).all()
    for c in ("events", "value_sum", "batches"):
        assert out[c].to_numpy().tolist() == expected[c].to_numpy().tolist(), c


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


def test_local_mode_shuffles_big_batches_and_keeps_every_subtask_warm(tmp_path):
    """local[2] (one executor, two cores, so two Python workers), P=4, 8 batches whose keys grow
    (batch b over (b+1)*600 keys), AQE on and tempted to coalesce (a 1 KB advisory partition size):
    the batch, which the driver could not broadcast, is shuffled into one stage of 4 tasks each
    batch; every subtask-batch after the first continues from memory in its slot process
    (dstl.spark.slot_client), whichever of the two workers ran it. The start does not grow with the
    state: no continued subtask replays anything, at 2x and at 8x the keys. (Its time, at 100k to
    4M keys, is measured by `make bench-scale`.) The output is exact."""
    conf = ["spark.sql.adaptive.coalescePartitions.enabled=true",
            "spark.sql.adaptive.advisoryPartitionSizeInBytes=1k",
            "spark.sql.adaptive.coalescePartitions.minPartitionSize=1k"]
    got, base, eventlog = _drive(tmp_path, "local", "local[2]", 4, 8, conf, growing=True)
    _check_records(got, eventlog, 4)
    later = [rep for b in got["batches"][1:] for rep in b["reports"]]
    warm = [rep for rep in later if rep["continued"]]
    assert len(warm) >= 0.95 * len(later), [(b["batch"], [r["continued"] for r in b["reports"]]) for b in got["batches"]]
    assert all(rep["restore_ms"] == 0 and not rep["restored"] and rep["hop_ms"] > 0 for rep in warm)
    # two state sizes: each subtask's state after batch 7 is several times its state after batch 1
    size = {(b["batch"], r["subtask"]): r["state_size"] for b in got["batches"] for r in b["reports"]}
    assert all(size[7, s] > 3 * size[1, s] for s in range(4)), size
    # the Python workers that ran the tasks are not the processes that hold the state: 2 workers, 4 slots
    assert len({rep["pid"] for rep in later}) == 4
    _check_output(base, 8, growing=True)
