"""The cyclic GC's share of a slot's CPU per event, without Spark: one process per measurement holds
N keys in a KeyedStateBackend (a value state of [events, sum] lists, as bench/scale.py's grid), then
runs update-only batches of B held keys the way a slot runs a task: `user_totals_fn`'s get_many +
update_many, snapshot, confirm, then (mode "freeze") dstl.spark.heap.after_task.

    python bench/slot_gc.py cpu [--keys 1000000,2000000] [--modes default,freeze] [--rounds 3]
    python bench/slot_gc.py leak [--keys 200000] [--batches 240]

cpu: CPU seconds (time.process_time) per batch, split into fn (get_many + update_many), snapshot and
after_task, with each GC generation's collections and CPU in the batch (gc.callbacks). Modes run in
alternating child processes, round after round; medians over the update batches of all rounds.
Mode "nogc" is `gc.disable()` for the whole run (the floor the collector's cost is measured from).

leak: a long stream in one process per (mode, workload): RSS sampled every 10 batches. Workloads:
"update" (the same keys updated), "churn" (a tenth of the batch's keys cleared, as many new keys
added), "cycles" (fn also builds and drops a cyclic structure of 10,000 objects per batch) and
"cyclic-values" (the state's values are objects in reference cycles, replaced every batch: the case
freezing cannot free by refcounting, bounded by the full collection every REGROW of growth).
"""
from __future__ import annotations

import argparse
import gc
import json
import os
import statistics
import subprocess
import sys
import tempfile
import time

HERE = os.path.dirname(os.path.abspath(__file__))
ROOT = os.path.dirname(HERE)
sys.path.insert(0, ROOT)
sys.path.insert(1, HERE)

from _driver_proc import loadavg  # noqa: E402


def _rss_mb() -> float:
    with open("/proc/self/status") as f:
        for line in f:
            if line.startswith("VmRSS:"):
                return int(line.split()[1]) / 1024
    return 0.0


class _GcMeter:
    """Collections and their CPU per generation, via gc.callbacks."""

    def __init__(self):
        self.t = 0.0
        self.reset()
        gc.callbacks.append(self._cb)

    def reset(self):
        self.n = [0, 0, 0]
        self.cpu = [0.0, 0.0, 0.0]

    def _cb(self, phase, info):
        if phase == "start":
            self.t = time.process_time()
        else:
            g = info["generation"]
            self.n[g] += 1
            self.cpu[g] += time.process_time() - self.t


class _Node:
    __slots__ = ("other", "data")


def _cycle_value(a, b):
    x, y = _Node(), _Node()
    x.other, y.other = y, x
    x.data = [a, b]
    return x


def child(a) -> dict:
    import numpy as np

    from dstl.changelog.storage import open_storage
    from dstl.spark import heap
    from dstl.state.backend import KeyedStateBackend
    from dstl.state.serializers import PickleSerializer
    from dstl.types import KeyGroupRange

    if a.mode == "nogc":
        gc.disable()
    freeze = a.mode == "freeze"
    if freeze:
        heap.own_process()
    meter = _GcMeter()
    maxp = 128
    n_keys, size = a.keys, a.batch
    out = {"mode": a.mode, "keys": n_keys, "batch": size, "workload": a.workload, "batches": []}
    with tempfile.TemporaryDirectory(prefix="dstl-slot-gc-") as d:
        st = open_storage(os.path.join(d, "cl"), upload_mode="direct")
        b = KeyedStateBackend(st, "op", KeyGroupRange(0, maxp - 1), maxp,
                              serializer=PickleSerializer() if a.workload == "cyclic-values" else None,
                              materialize_every_changes=a.materialize_every or None)
        totals = b.value_state("totals")
        users = np.array([f"u{i}" for i in range(n_keys)], dtype=object)
        next_key = n_keys
        cp = 0

        def fn(keys):
            if a.workload == "cyclic-values":
                old = [v.data if v is not None else [0, 0] for v in totals.get_many(keys)]
                new = np.asarray(old, dtype=np.int64) + 1
                totals.update_many(keys, np.array([_cycle_value(int(x), int(y)) for x, y in new], dtype=object))
                return
            old = np.array([t if t is not None else (0, 0) for t in totals.get_many(keys)],
                           dtype=np.int64).reshape(-1, 2)
            totals.update_many(keys, (old + 1).tolist())
            if a.workload == "cycles":  # the user's own garbage: dropped on return, reachable only from itself
                ring = [_Node() for _ in range(10_000)]
                for i, x in enumerate(ring):
                    x.other = ring[i - 1]

        def task(keys, record):
            nonlocal cp
            meter.reset()
            c0 = time.process_time()
            fn(keys)
            c1 = time.process_time()
            cp += 1
            b.snapshot(cp).result()
            b.confirm(cp)
            c2 = time.process_time()
            if freeze:
                heap.after_task()
            c3 = time.process_time()
            if record:
                out["batches"].append({
                    "fn_us_per_key": (c1 - c0) / len(keys) * 1e6, "snapshot_s": c2 - c1, "after_task_s": c3 - c2,
                    "task_us_per_key": (c3 - c0) / len(keys) * 1e6,
                    "collections": list(meter.n), "gc_cpu_s": [round(x, 4) for x in meter.cpu],
                    "frozen": gc.get_freeze_count(), "threshold": list(gc.get_threshold()),
                    "full": heap.stats["full"], "blocks": sys.getallocatedblocks(),
                    "rss_mb": round(_rss_mb(), 1), "load": loadavg()})

        for s in range(0, n_keys, size):  # the stream's first batches: every key new
            task(users[s:s + size], False)
        rng = np.random.default_rng(7)
        for i in range(a.batches):
            if a.workload == "churn":
                idx = rng.choice(len(users), size // 10, replace=False)
                totals.update_many(users[idx], [None] * len(idx))
                users[idx] = [f"u{k}" for k in range(next_key, next_key + len(idx))]
                next_key += len(idx)
            task(users[rng.choice(len(users), size, replace=False)], True)
            if a.progress:
                print(json.dumps(out["batches"][-1]), file=sys.stderr, flush=True)
        out["heap"] = dict(heap.stats) if freeze else None
        b.close()
        st.close()
    return out


def _run_child(args) -> dict:
    cmd = [sys.executable, os.path.abspath(__file__), "child", *args]
    res = subprocess.run(cmd, stdout=subprocess.PIPE, check=True, cwd=ROOT)
    return json.loads(res.stdout)


def _med(xs):
    return round(statistics.median(xs), 3) if xs else None


def cpu(a) -> dict:
    runs = []
    modes = a.modes.split(",")
    for r in range(a.rounds):
        for keys in [int(k) for k in a.keys.split(",")]:
            # alternate which mode goes first, so a load change does not favour one
            for mode in (modes if r % 2 == 0 else modes[::-1]):
                res = _run_child(["--mode", mode, "--keys", str(keys), "--batch", str(a.batch),
                                  "--batches", str(a.batches), "--workload", "update",
                                  "--materialize-every", str(a.materialize_every)])
                res["round"] = r
                runs.append(res)
                bs = res["batches"][1:]  # the first update batch follows the fill: left out
                print(json.dumps({"round": r, "mode": mode, "keys": keys,
                                  "fn_us_per_key": [round(x["fn_us_per_key"], 2) for x in bs],
                                  "task_us_per_key": [round(x["task_us_per_key"], 2) for x in bs],
                                  "gen2": [x["collections"][2] for x in bs],
                                  "gen2_cpu_s": [x["gc_cpu_s"][2] for x in bs],
                                  "after_task_s": [round(x["after_task_s"], 3) for x in bs],
                                  "load": bs[-1]["load"] if bs else None}), flush=True)
    summary = {}
    for keys in sorted({r["keys"] for r in runs}):
        for mode in modes:
            bs = [x for r in runs if r["keys"] == keys and r["mode"] == mode for x in r["batches"][1:]]
            summary[f"{keys}/{mode}"] = {
                "batches": len(bs),
                "fn_us_per_key": _med([x["fn_us_per_key"] for x in bs]),
                "task_us_per_key": _med([x["task_us_per_key"] for x in bs]),
                "gen2_per_batch": _med([x["collections"][2] for x in bs]),
                "gc_cpu_s_per_batch": _med([sum(x["gc_cpu_s"]) for x in bs]),
                "after_task_s": _med([x["after_task_s"] for x in bs]),
                "rss_mb": _med([x["rss_mb"] for x in bs])}
    return {"runs": runs, "summary": summary}


def leak(a) -> dict:
    rows = {}
    for workload in a.workloads.split(","):
        for mode in a.modes.split(","):
            res = _run_child(["--mode", mode, "--keys", str(a.keys), "--batch", str(a.batch),
                              "--batches", str(a.batches), "--workload", workload])
            rss = [x["rss_mb"] for x in res["batches"]]
            rows[f"{workload}/{mode}"] = {
                "rss_mb_every_10": rss[::10] + [rss[-1]], "frozen_every_10": [x["frozen"] for x in res["batches"]][::10],
                "rss_first_last": [rss[0], rss[-1]], "rss_max": max(rss), "heap": res.get("heap"),
                "task_us_per_key_median": _med([x["task_us_per_key"] for x in res["batches"]])}
            print(json.dumps({workload + "/" + mode: rows[f"{workload}/{mode}"]}), flush=True)
    return rows


def main(argv) -> int:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("what", choices=["cpu", "leak", "child"])
    ap.add_argument("--keys", default=None)
    ap.add_argument("--modes", default="default,freeze")
    ap.add_argument("--rounds", type=int, default=3)
    ap.add_argument("--batch", type=int, default=None)
    ap.add_argument("--batches", type=int, default=None)
    ap.add_argument("--mode", default="default")
    ap.add_argument("--workload", default="update")
    ap.add_argument("--workloads", default="update,churn,cycles,cyclic-values")
    ap.add_argument("--progress", action="store_true")
    ap.add_argument("--materialize-every", type=int, default=0,
                    help="the backend's materialize_every_changes (StatefulStream's default: 1,000,000)")
    ap.add_argument("--out", default=None)
    a = ap.parse_args(argv)
    if a.what == "child":
        a.keys = int(a.keys)
        print(json.dumps(child(a)))
        return 0
    if a.what == "cpu":
        a.keys = a.keys or "1000000,2000000"
        a.batch = a.batch or 375_000
        a.batches = a.batches or 5
        res = cpu(a)
    else:
        a.keys = int(a.keys or 200_000)
        a.batch = a.batch or 50_000
        a.batches = a.batches or 240
        res = leak(a)
    res["load_end"] = loadavg()
    print(json.dumps({k: v for k, v in res.items() if k != "runs"}, indent=1))
    if a.out:
        with open(a.out, "w") as f:
            json.dump(res, f, indent=1)
    return 0


if __name__ == "__main__":
    sys.exit(main(sys.argv[1:]))
