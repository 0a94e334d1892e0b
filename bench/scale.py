"""StatefulStream at scale on one host (`local[2]`): does a batch's cost stay that of its own work as
the state grows, what does the driver hold, and how far ahead of Spark's native state is it.

    python bench/scale.py [--parts grid,engines,bigbatch,catchup] [--smoke] [--out bench/results]

Each Spark measurement runs in its own driver process (so each JVM's and driver's peak RSS is its
own); the load average is recorded before and after every part. Four parts:

1. **grid** (dstl only): the vectorised `user_totals_fn` through `StatefulStream.run(df)`, the batch
   generated on the executors (tests/route_driver.batch_df: batch b holds ids b*E..(b+1)*E-1, user
   ``u{id * 7919 % K}``, so the driver never holds it, and after b+1 batches min(K, (b+1)*E) keys
   are held), `local[2]`, K = 100k, 1M (400k events a batch) and 4M keys (1.5M events a batch),
   P = 2 and 4, 8 batches, a 2 GB driver. Per batch: wall time of `run`, subtasks restored and
   continued, the start (`TaskReport.start_ms`: taking the state, confirming, pruning; max over
   subtasks) and the hop (rows from the worker to the slot, `hop_ms`), peak RSS (VmHWM) of the driver
   JVM and the driver's Python, the slots' RSS (VmRSS of the reports' pids, summed) per key held, and
   each slot's CPU seconds in the batch (/proc/<pid>/stat; load-independent work).
2. **engines**: one driver, one JSON file stream per engine with the same files (make_batches:
   E events over K users a batch, K = 1M, E = 400k), P = 4 (`spark.sql.shuffle.partitions` for
   Spark): Spark's `transformWithState` (RowUserTotals) and `transformWithStateInPandas` (UserTotals)
   on RocksDB, and `StatefulStream` with the same RowUserTotals (`api="row"`) and `user_totals_fn`.
   Batches interleaved (round b feeds file b to each engine still running, order rotated); native
   pandas runs 2 batches (batch 0 is warm-up), native Row 3, dstl 8. Batch time = the query
   progress's `triggerExecution`; medians over batches 1..; every engine's output is checked
   against pandas.
3. **bigbatch**: one micro-batch of 3,000,000 rows with 256-character payloads, generated on the
   executors, with `spark.driver.memory=2g`: through `StatefulStream.run` (P = 4, the shuffle route),
   through a plain shuffle aggregation (`groupBy(user).agg(count, sum)` written to parquet) and
   through a plain shuffle of every row (`repartition(P, user)` to parquet), each in its own driver,
   on `local[2]` (the executor inside the driver JVM) and on `local-cluster[1,2,2048]` (the driver
   JVM alone): time and driver JVM / Python peak RSS.
4. **catchup** (no Spark): what a per-worker copy would replay to catch up. A KeyedStateBackend on a
   local directory holds N keys (materialized, checkpoint 1), then one batch updates C of them
   (checkpoint 2). Timed: a full restore of checkpoint 2, and replaying only checkpoint 2's new
   changes into a copy restored at checkpoint 1 (what catch-up replays per missed batch).

Writes `<out>/scale.json` and `<out>/scale.png`. The machine is shared: absolute times carry its
load, which is recorded; ratios compare engines measured in the same rounds.
"""
from __future__ import annotations

import argparse
import json
import os
import statistics
import sys
import tempfile
import time
from typing import Dict, List

HERE = os.path.dirname(os.path.abspath(__file__))
ROOT = os.path.dirname(HERE)
sys.path.insert(0, HERE)
sys.path.insert(1, os.path.join(ROOT, "tests"))

from _driver_proc import cpu_s, driver_session, loadavg, peak_mb, rss_mb, run_child, stop_slots  # noqa: E402

RESULTS = os.path.join(HERE, "results")
START_TARGET_MS = 50.0
WARM_TARGET = 0.95

FULL = {
    "grid": [(100_000, 400_000), (1_000_000, 400_000), (4_000_000, 1_500_000)],
    "grid_p": [2, 4], "grid_batches": 8,
    "engines": {"keys": 1_000_000, "events": 400_000, "parallelism": 4,
                "batches": {"native-pandas": 2, "native-row": 3, "dstl-row": 8, "dstl-fn": 8}},
    # local[2]: the executor is in the driver JVM; local-cluster: the driver JVM is the driver alone
    "bigbatch": {"rows": 3_000_000, "keys": 1_000_000, "payload": 256, "parallelism": 4, "driver_memory": "2g",
                 "runs": [["local[2]", "dstl"], ["local[2]", "shuffle-agg"], ["local[2]", "shuffle-write"],
                          ["local-cluster[1,2,2048]", "dstl"], ["local-cluster[1,2,2048]", "shuffle-agg"]]},
    "catchup": {"keys": [100_000, 1_000_000], "changes": [100_000, 400_000]},
}
SMOKE = {
    "grid": [(20_000, 20_000), (50_000, 30_000)],
    "grid_p": [2, 4], "grid_batches": 3,
    "engines": {"keys": 20_000, "events": 10_000, "parallelism": 4,
                "batches": {"native-pandas": 2, "native-row": 2, "dstl-row": 3, "dstl-fn": 3}},
    "bigbatch": {"rows": 100_000, "keys": 20_000, "payload": 256, "parallelism": 4, "driver_memory": "2g",
                 "runs": [["local[2]", "dstl"], ["local[2]", "shuffle-agg"], ["local[2]", "shuffle-write"],
                          ["local-cluster[1,2,2048]", "dstl"], ["local-cluster[1,2,2048]", "shuffle-agg"]]},
    "catchup": {"keys": [20_000], "changes": [5_000]},
}


# ================================================================== children (one driver each)

def child_grid(a) -> dict:
    from _streaming_workload import OUTPUT, user_totals_fn
    from dstl.spark import StatefulStream
    from route_driver import batch_df

    spark, jvm = driver_session("local[2]", f"dstl-scale-grid-{a.keys}-{a.parallelism}", a.driver_memory)
    out = {"keys": a.keys, "events": a.events, "parallelism": a.parallelism, "batches": [], "error": None}
    with tempfile.TemporaryDirectory(prefix="dstl-scale-grid-") as base:
        stream = StatefulStream(base, user_totals_fn, OUTPUT, key="user", parallelism=a.parallelism)
        known: List[int] = []  # the slots of the previous batch (a warm subtask keeps its slot)
        try:
            for b in range(a.batches):
                cpu0 = {p: cpu_s(p) for p in known}
                t0 = time.perf_counter()
                res = stream.run(batch_df(spark, b, a.events, a.keys, 0))
                wall = time.perf_counter() - t0
                pids = sorted({r.pid for r in res.reports})
                # the slots' CPU seconds in this batch (None for a slot new in it): load-independent work
                slot_cpu = [round(cpu_s(r.pid) - cpu0[r.pid], 2) if r.pid in cpu0 else None for r in res.reports]
                known = pids
                slot_rss = sum(rss_mb(p) for p in pids)
                held = min(a.keys, (b + 1) * a.events)
                out["batches"].append({
                    "batch": b, "wall_s": round(wall, 3), "stream_s": round(res.seconds, 3), "route": res.route,
                    "rows_in": sum(r.rows_in for r in res.reports), "rows_out": res.rows_out,
                    "restored": res.restored, "continued": sum(1 for r in res.reports if r.continued),
                    "start_ms": [round(r.start_ms, 1) for r in res.reports],
                    "hop_ms": [round(r.hop_ms, 1) for r in res.reports],
                    "restore_ms": [round(r.restore_ms, 1) for r in res.reports],
                    "process_ms": [round(r.process_ms, 1) for r in res.reports],
                    "snapshot_ms": [round(r.snapshot_ms, 1) for r in res.reports],
                    "sources": [r.restore_source for r in res.reports],
                    "pids": [r.pid for r in res.reports], "executors": [r.executor for r in res.reports],
                    "phases_ms": {k: round(v, 1) for k, v in res.phases_ms.items()},
                    "checkpoint_ms": round(res.checkpoint_ms, 1),
                    "slot_cpu_s": slot_cpu, "keys_held": held, "slot_rss_mb": round(slot_rss, 1),
                    "slot_rss_per_key_b": round(slot_rss * 2**20 / held, 1),
                    "driver_jvm_peak_mb": peak_mb(jvm), "driver_jvm_rss_mb": rss_mb(jvm),
                    "driver_python_peak_mb": peak_mb(os.getpid()), "load": loadavg()})
                print(json.dumps(out["batches"][-1]), flush=True)
                with open(a.child_out, "w") as f:  # kept if the run is cut short (timeout)
                    json.dump(out, f, default=str)
        except Exception as exc:  # noqa: BLE001 - a failed run is a result
            import traceback

            traceback.print_exc()
            out["error"] = f"{type(exc).__name__}: {str(exc).strip().splitlines()[0][:400] if str(exc).strip() else ''}"
        finally:
            try:
                stream.close()
            except Exception:  # noqa: BLE001
                pass
    out["driver_jvm_peak_mb"] = peak_mb(jvm)
    out["driver_python_peak_mb"] = peak_mb(os.getpid())
    spark.stop()
    return out


def child_engines(a) -> dict:
    import streaming_report as sr
    from streaming_util import make_batches, normalize, read_output

    from _streaming_workload import OUTPUT_COLS, reference

    plan = json.loads(a.plan)
    n_max = max(plan.values())
    batches = make_batches(n_max, a.events, a.keys, seed=11)
    work = tempfile.mkdtemp(prefix="dstl-scale-engines-")
    spark = sr._session(a.parallelism)
    jvm = spark.sparkContext._gateway.proc.pid
    engines = [sr.Engine(n, work) for n in plan]
    out: Dict[str, dict] = {n: {"batches": [], "error": None, "planned": plan[n]} for n in plan}
    stopped = set()
    slot_pids = set()

    def stop(e):
        if e.name not in stopped:
            stopped.add(e.name)
            if e.stream is not None:
                slot_pids.update(t.pid for r in e.stream.results for t in r.reports)
            e.stop()

    try:
        for e in engines:
            e.start(spark, a.parallelism)
        for b in range(n_max):
            live = [e for e in engines if b < plan[e.name] and out[e.name]["error"] is None]
            if not live:
                break
            k = b % len(live)
            for e in live[k:] + live[:k]:
                try:
                    rec = e.run_batch(b, batches[b])
                except Exception as exc:  # noqa: BLE001
                    out[e.name]["error"] = f"batch {b}: {type(exc).__name__}: {str(exc).strip()[:300]}"
                    print(e.name, out[e.name]["error"], flush=True)
                    stop(e)
                    continue
                keep = {"batch": b, "batch_s": rec["batch_ms"] / 1000, "wall_s": round(rec["wall_s"], 3),
                        "load": loadavg()}
                if e.name.startswith("dstl"):
                    r = e.stream.results[-1]
                    keep.update(restored=r.restored, continued=sum(1 for t in r.reports if t.continued),
                                start_ms=[round(t.start_ms, 1) for t in r.reports],
                                hop_ms=[round(t.hop_ms, 1) for t in r.reports],
                                process_ms=[round(t.process_ms, 1) for t in r.reports],
                                stream_s=round(r.seconds, 3), checkpoint_ms=round(r.checkpoint_ms, 1))
                else:
                    keep.update(state_commit_ms=rec["state_commit_ms"], rocksdb_load_ms=rec["rocksdb_load_ms"],
                                state_rows=rec["state_rows"])
                out[e.name]["batches"].append(keep)
                print(f"batch {b} {e.name:<14} {keep['batch_s']:8.2f} s  load {keep['load']}", flush=True)
                with open(a.child_out, "w") as f:  # kept if the run is cut short (timeout, kill)
                    json.dump(out, f, default=str)
                if b + 1 == plan[e.name]:
                    stop(e)
    finally:
        for e in engines:
            stop(e)
        out["_driver_jvm_peak_mb"] = peak_mb(jvm)
        out["_slot_pids"] = sorted(slot_pids)
        spark.stop()
    for n in plan:
        done = len(out[n]["batches"])
        print(f"verifying {n} ({done} batches)", flush=True)
        if not done:
            out[n]["output_matches_pandas"] = False
            continue
        try:
            expected = normalize(reference(batches[:done]), OUTPUT_COLS + ["batch_id"])
            got = read_output(os.path.join(work, n, "output"))
            out[n]["output_matches_pandas"] = bool(len(got) and normalize(got, OUTPUT_COLS + ["batch_id"]).equals(expected))
        except Exception as exc:  # noqa: BLE001 - keep the timings
            out[n]["output_matches_pandas"] = f"not checked: {type(exc).__name__}: {exc}"[:300]
    import shutil

    shutil.rmtree(work, ignore_errors=True)
    return out


def child_bigbatch(a) -> dict:
    from pyspark.sql import functions as F

    from route_driver import batch_df

    conf = [("spark.executor.memory", "1536m")] if a.master.startswith("local-cluster") else []
    spark, jvm = driver_session(a.master, f"dstl-scale-bigbatch-{a.mode}", a.driver_memory, conf)
    out = {"mode": a.mode, "master": a.master, "rows": a.events, "error": None}
    with tempfile.TemporaryDirectory(prefix="dstl-scale-big-") as base:
        df = batch_df(spark, 0, a.events, a.keys, a.payload)
        t0 = time.perf_counter()
        try:
            if a.mode == "dstl":
                from _streaming_workload import OUTPUT, user_totals_fn
                from dstl.spark import StatefulStream

                stream = StatefulStream(base, user_totals_fn, OUTPUT, key="user", parallelism=a.parallelism)
                try:
                    res = stream.run(df)
                    out.update(route=res.route, rows_in=sum(r.rows_in for r in res.reports),
                               rows_out=res.rows_out, restored=res.restored,
                               phases_ms={k: round(v, 1) for k, v in res.phases_ms.items()},
                               hop_ms=[round(r.hop_ms, 1) for r in res.reports],
                               process_ms=[round(r.process_ms, 1) for r in res.reports],
                               slot_peak_mb=[peak_mb(r.pid) for r in res.reports],
                               pids=[r.pid for r in res.reports])
                finally:
                    stream.close()
            elif a.mode == "shuffle-write":  # every row and column through one shuffle, as dstl's route
                df.repartition(a.parallelism, "user").write.parquet(os.path.join(base, "rows"))
            else:
                agg = df.groupBy("user").agg(F.count(F.lit(1)).alias("events"), F.sum("value").alias("value_sum"))
                agg.write.parquet(os.path.join(base, "agg"))
                out["rows_out"] = spark.read.parquet(os.path.join(base, "agg")).count()
        except Exception as exc:  # noqa: BLE001
            import traceback

            traceback.print_exc()
            lines = [ln.strip() for ln in str(exc).splitlines() if ln.strip()] or [type(exc).__name__]
            out["error"] = lines[0][:400]
        out["seconds"] = round(time.perf_counter() - t0, 2)
    out["driver_jvm_peak_mb"] = peak_mb(jvm)
    out["driver_python_peak_mb"] = peak_mb(os.getpid())
    spark.stop()
    return out


def child_catchup(a) -> dict:
    import numpy as np

    from dstl.changelog.storage import open_storage
    from dstl.state.backend import KeyedStateBackend
    from dstl.state.restore import replay_snapshots
    from dstl.state.snapshot import KeyedStateSnapshot
    from dstl.types import KeyGroupRange

    maxp = 128
    full = KeyGroupRange(0, maxp - 1)
    rows = []
    for n in json.loads(a.plan)["keys"]:
        for c in json.loads(a.plan)["changes"]:
            if c > n:  # a batch changes each key at most once (fn aggregates per key first)
                continue
            with tempfile.TemporaryDirectory(prefix="dstl-scale-catchup-") as d:
                st = open_storage(os.path.join(d, "cl"), upload_mode="direct")
                try:
                    users = np.array([f"u{i}" for i in range(n)], dtype=object)
                    b = KeyedStateBackend(st, "op", full, maxp)
                    totals = b.value_state("totals")
                    t0 = time.perf_counter()
                    totals.update_many(users, [[1, i % 10] for i in range(n)])
                    write_s = time.perf_counter() - t0
                    b.materialize()
                    s1 = b.snapshot(1).result()
                    b.confirm(1)
                    rng = np.random.default_rng(5)
                    hit = users[rng.choice(n, size=c, replace=False)]
                    totals.update_many(hit, [[2, 7]] * len(hit))
                    s2 = b.snapshot(2).result()
                    b.confirm(2)
                    b.close()
                    full_ms, replay_ms = [], []
                    applied_full = applied_tail = 0
                    for _ in range(a.rounds):
                        t0 = time.perf_counter()
                        r = KeyedStateBackend.restore(st, "op", full, maxp, [s2])
                        full_ms.append((time.perf_counter() - t0) * 1e3)
                        applied_full = r.restore_stats["changes_applied"]
                        r.close()
                        stale = KeyedStateBackend.restore(st, "op", full, maxp, [s1])
                        tail = KeyedStateSnapshot(full, [], s2.changelog, maxp, 2)
                        t0 = time.perf_counter()
                        replay_snapshots(stale, [tail], {})
                        replay_ms.append((time.perf_counter() - t0) * 1e3)
                        applied_tail = stale.restore_stats["changes_applied"]
                        assert stale.value_state("totals").get(hit[0]) == [2, 7]
                        stale.close()
                finally:
                    st.close()
            fm, rm = statistics.median(full_ms), statistics.median(replay_ms)
            row = {"keys": n, "changes": c, "write_keys_s": round(write_s, 2),
                   "full_restore_ms": round(fm, 1), "full_changes_applied": applied_full,
                   "full_us_per_change": round(fm * 1e3 / max(applied_full, 1), 3),
                   "full_us_per_key": round(fm * 1e3 / n, 3),
                   "catchup_ms": round(rm, 1), "catchup_changes_applied": applied_tail,
                   "catchup_us_per_change": round(rm * 1e3 / max(applied_tail, 1), 3),
                   "rounds": a.rounds, "load": loadavg()}
            rows.append(row)
            print(json.dumps(row), flush=True)
    return {"rows": rows}


# ================================================================== the parent

def _child(kind: str, args: List[str], out_dir: str, timeout: float) -> dict:
    fd, path = tempfile.mkstemp(suffix=".json", prefix=f"scale-{kind}-")
    os.close(fd)
    log = os.path.join(tempfile.gettempdir(), "dstl-scale-logs", f"{kind}.log")  # outside the checkout
    os.makedirs(os.path.dirname(log), exist_ok=True)
    with open(log, "a") as f:
        f.write(f"\n=== {kind} {' '.join(args)} ({time.strftime('%H:%M:%S')})\n")
    t0 = time.time()
    rc = run_child(os.path.abspath(__file__), ["--child", kind, "--child-out", path, *args], timeout, log)
    try:
        with open(path) as f:
            res = json.load(f)
    except (OSError, ValueError):
        res = {"error": f"child exited {rc} without a result (see {os.path.relpath(log, ROOT)})"}
    os.unlink(path)
    res["exit_code"] = rc
    res["elapsed_s"] = round(time.time() - t0, 1)
    return res


def part_grid(cfg, out_dir) -> dict:
    runs = []
    for keys, events in cfg["grid"]:
        for p in cfg["grid_p"]:
            print(f"grid: {keys:,} keys, {events:,} events/batch, P={p}", flush=True)
            r = _child("grid", ["--keys", str(keys), "--events", str(events), "--parallelism", str(p),
                                "--batches", str(cfg["grid_batches"]), "--driver-memory", "2g"], out_dir, 1200)
            pids = {pid for b in r.get("batches", []) for pid in b["pids"]}
            r["slots_stopped_by_bench"] = stop_slots(pids)
            summarize_grid_run(r)
            print("  " + json.dumps({k: v for k, v in r.items() if k != "batches"}), flush=True)
            runs.append(r)
    return {"runs": runs}


def _p(xs, q):
    xs = sorted(xs)
    return xs[min(len(xs) - 1, int(round(q * (len(xs) - 1))))] if xs else None


def summarize_grid_run(r: dict) -> None:
    bs = r.get("batches", [])
    later = bs[1:]
    if not later:
        return
    sub = [(s, c) for b in later for s, c in zip(b["start_ms"], [True] * len(b["start_ms"]))]
    starts = [s for s, _ in sub]
    r["summary"] = {
        "wall_s_median_after_first": round(statistics.median(b["wall_s"] for b in later), 2),
        "wall_s": [b["wall_s"] for b in bs],
        "warm": sum(b["continued"] for b in later), "subtask_batches": sum(len(b["start_ms"]) for b in later),
        "restored_after_first": sum(b["restored"] for b in later),
        "start_ms_max_per_batch": [max(b["start_ms"]) for b in bs],
        "start_ms_median": statistics.median(starts), "start_ms_max": max(starts),
        "start_ms_p90": _p(starts, 0.9),
        "hop_ms_max_median": statistics.median(max(b["hop_ms"]) for b in later),
        "process_ms_max_median": statistics.median(max(b["process_ms"]) for b in later),
        "slot_cpu_s_per_batch": [sum(c for c in b.get("slot_cpu_s") or [] if c is not None) or None for b in bs],
        "driver_jvm_peak_mb": r.get("driver_jvm_peak_mb"), "driver_python_peak_mb": r.get("driver_python_peak_mb"),
        "slot_rss_mb_last": bs[-1]["slot_rss_mb"], "slot_rss_per_key_b_last": bs[-1]["slot_rss_per_key_b"],
        "keys_held_last": bs[-1]["keys_held"],
    }
    s = r["summary"]
    s["warm_fraction"] = round(s["warm"] / s["subtask_batches"], 3) if s["subtask_batches"] else None
    # what one more key costs the slots: RSS growth between the first batch and the last over the keys added
    grown = bs[-1]["keys_held"] - bs[0]["keys_held"]
    if grown > 0:
        s["slot_rss_marginal_b_per_key"] = round((bs[-1]["slot_rss_mb"] - bs[0]["slot_rss_mb"]) * 2**20 / grown, 1)


def part_engines(cfg, out_dir) -> dict:
    e = cfg["engines"]
    print(f"engines: {e['keys']:,} keys, {e['events']:,} events/batch, P={e['parallelism']}, "
          f"batches {e['batches']}", flush=True)
    r = _child("engines", ["--keys", str(e["keys"]), "--events", str(e["events"]),
                           "--parallelism", str(e["parallelism"]), "--plan", json.dumps(e["batches"])], out_dir, 5400)
    summary = {}
    for name in e["batches"]:
        if name not in r:
            continue
        bs = r[name]["batches"]
        timed = [b["batch_s"] for b in bs[1:]]
        summary[name] = {"batch_s": [round(b["batch_s"], 2) for b in bs],
                         "median_s": round(statistics.median(timed), 2) if timed else None,
                         "timed_batches": len(timed), "output_matches_pandas": r[name].get("output_matches_pandas"),
                         "error": r[name].get("error")}
        if name.startswith("dstl") and len(bs) > 1:
            summary[name]["warm"] = f"{sum(b['continued'] for b in bs[1:])}/{sum(len(b['start_ms']) for b in bs[1:])}"
            summary[name]["start_ms_max"] = max(max(b["start_ms"]) for b in bs[1:])
    ratios = []
    for ours, native, goal in (("dstl-row", "native-row", 15.0), ("dstl-fn", "native-pandas", 60.0)):
        if summary.get(ours, {}).get("median_s") and summary.get(native, {}).get("median_s"):
            ratio = summary[native]["median_s"] / summary[ours]["median_s"]
            ratios.append({"engine": ours, "vs": native, "ratio": round(ratio, 1), "goal": goal, "met": ratio >= goal})
    r["summary"] = summary
    r["ratios"] = ratios
    r["slots_stopped_by_bench"] = stop_slots(r.get("_slot_pids", []))
    print("  " + json.dumps({"summary": summary, "ratios": ratios}), flush=True)
    return r


def part_bigbatch(cfg, out_dir) -> dict:
    bb = cfg["bigbatch"]
    out = {"config": bb}
    for master, mode in bb.get("runs", [("local[2]", "dstl"), ("local[2]", "shuffle-agg")]):
        print(f"bigbatch: {mode} on {master}, {bb['rows']:,} rows", flush=True)
        r = _child("bigbatch", ["--mode", mode, "--master", master, "--events", str(bb["rows"]),
                                "--keys", str(bb["keys"]), "--payload", str(bb["payload"]),
                                "--parallelism", str(bb["parallelism"]), "--driver-memory", bb["driver_memory"]],
                   out_dir, 3600)
        r["slots_stopped_by_bench"] = stop_slots(r.get("pids", []))
        print("  " + json.dumps(r), flush=True)
        out[mode if master == "local[2]" else f"{mode}@{master}"] = r
    return out


def part_catchup(cfg, out_dir) -> dict:
    print("catchup: KeyedStateBackend restore vs one batch's replay", flush=True)
    return _child("catchup", ["--plan", json.dumps(cfg["catchup"]), "--rounds", "3"], out_dir, 3600)


PARTS = {"grid": part_grid, "engines": part_engines, "bigbatch": part_bigbatch, "catchup": part_catchup}


def chart(report: dict, path: str) -> None:
    import matplotlib

    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    fig, axes = plt.subplots(2, 3, figsize=(16, 8.5))
    grid = report.get("parts", {}).get("grid", {}).get("runs", [])
    styles = {2: "-", 4: "--"}
    colors = {}
    palette = ["#1f77b4", "#2ca02c", "#d62728", "#9467bd", "#ff7f0e"]
    for r in grid:
        if not r.get("batches"):
            continue
        c = colors.setdefault(r["keys"], palette[len(colors) % len(palette)])
        label = f"{r['keys'] / 1e6:g}M keys, {r['events'] / 1e3:g}k ev, P={r['parallelism']}"
        xs = [b["batch"] for b in r["batches"]]
        axes[0, 0].plot(xs, [b["wall_s"] for b in r["batches"]], styles.get(r["parallelism"], "-"),
                        color=c, marker="o", ms=3, label=label)
        axes[0, 1].plot(xs, [max(max(b["start_ms"]), 0.1) for b in r["batches"]], styles.get(r["parallelism"], "-"),
                        color=c, marker="o", ms=3, label=label)
        axes[0, 2].plot(xs, [b["slot_rss_per_key_b"] for b in r["batches"]], styles.get(r["parallelism"], "-"),
                        color=c, marker="o", ms=3, label=label)
    ax = axes[0, 0]
    ax.set_title("grid: batch wall time (s)")
    ax.set_xlabel("batch")
    ax.legend(fontsize=6)
    ax = axes[0, 1]
    ax.set_title("grid: start ms, max over subtasks (log)")
    ax.set_yscale("log")
    ax.axhline(START_TARGET_MS, color="grey", lw=0.8, ls=":")
    ax.text(0, START_TARGET_MS * 1.1, "50 ms target", fontsize=7, color="grey")
    ax.set_xlabel("batch")
    ax = axes[0, 2]
    ax.set_title("grid: slots' RSS / keys held (bytes)")
    ax.set_yscale("log")
    ax.set_xlabel("batch")

    eng = report.get("parts", {}).get("engines", {}).get("summary", {})
    ax = axes[1, 0]
    names = [n for n in ("native-pandas", "native-row", "dstl-row", "dstl-fn") if eng.get(n, {}).get("median_s")]
    vals = [eng[n]["median_s"] for n in names]
    if names:
        ax.bar(names, vals, color=["#888888", "#bbbbbb", "#9467bd", "#2ca02c"][:len(names)])
        ax.set_yscale("log")
        ax.set_ylim(top=max(vals) * 5)
        for i, v in enumerate(vals):
            ax.text(i, v, f"{v:.1f} s", ha="center", va="bottom", fontsize=8)
        rat = report["parts"]["engines"].get("ratios", [])
        ax.set_title("engines: median batch (s, log); " + ", ".join(f"{x['engine']} {x['ratio']:g}x" for x in rat),
                     fontsize=8)
        ax.tick_params(axis="x", labelsize=7)

    bb = report.get("parts", {}).get("bigbatch", {})
    ax = axes[1, 1]
    modes = [m for m in bb if m != "config" and isinstance(bb[m], dict)]
    if modes:
        jvm = [bb[m].get("driver_jvm_peak_mb", 0) for m in modes]
        py = [bb[m].get("driver_python_peak_mb", 0) for m in modes]
        x = range(len(modes))
        ax.bar([i - 0.2 for i in x], jvm, 0.4, label="driver JVM peak", color="#1f77b4")
        ax.bar([i + 0.2 for i in x], py, 0.4, label="driver Python peak", color="#aec7e8")
        ax.set_xticks(list(x))
        ax.set_xticklabels([f"{m.replace('@', chr(10))}\n{bb[m].get('seconds', 0):.0f} s"
                            + (" FAILED" if bb[m].get("error") else "") for m in modes], fontsize=6)
        for i, v in enumerate(jvm):
            ax.text(i - 0.2, v, f"{v:,.0f}", ha="center", va="bottom", fontsize=8)
        ax.set_title(f"{bb['config']['rows'] / 1e6:g}M-row micro-batch, 2 GB driver: peak RSS (MB)", fontsize=9)
        ax.legend(fontsize=7)

    cu = report.get("parts", {}).get("catchup", {}).get("rows", [])
    ax = axes[1, 2]
    if cu:
        labels = [f"{r['keys'] / 1e6:g}M keys\n{r['changes'] / 1e3:g}k changes" for r in cu]
        x = range(len(cu))
        ax.bar([i - 0.2 for i in x], [r["full_restore_ms"] for r in cu], 0.4, label="full restore", color="#d62728")
        ax.bar([i + 0.2 for i in x], [r["catchup_ms"] for r in cu], 0.4, label="replay one batch (catch-up)",
               color="#ff9896")
        ax.axhline(START_TARGET_MS, color="grey", lw=0.8, ls=":")
        ax.set_yscale("log")
        ax.set_xticks(list(x))
        ax.set_xticklabels(labels, fontsize=7)
        for i, r in enumerate(cu):
            ax.text(i + 0.2, r["catchup_ms"], f"{r['catchup_ms']:.0f}", ha="center", va="bottom", fontsize=7)
            ax.text(i - 0.2, r["full_restore_ms"], f"{r['full_restore_ms']:.0f}", ha="center", va="bottom", fontsize=7)
        ax.set_title("per-worker copy (c): ms to restore / catch up (log)", fontsize=9)
        ax.legend(fontsize=7)
    setup = report.get("setup", {})
    fig.suptitle(f"dstl StatefulStream at scale, local[2] on a shared 2-core machine "
                 f"(load {setup.get('load_first', '?')} .. {setup.get('load_last', '?')}); {setup.get('when', '')}",
                 fontsize=10)
    fig.tight_layout()
    fig.savefig(path, dpi=100)


def main(argv: List[str]) -> int:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--parts", default="grid,engines,bigbatch,catchup")
    ap.add_argument("--smoke", action="store_true", help="small sizes, to check the script (minutes)")
    ap.add_argument("--out", default=RESULTS)
    ap.add_argument("--merge", action="store_true", help="keep the other parts of an existing scale.json")
    ap.add_argument("--engines-events", type=int, help="overrides part 2's events per batch")
    ap.add_argument("--engines-batches", help='JSON, e.g. {"native-pandas": 2, ...}: overrides part 2\'s batches')
    ap.add_argument("--child", help=argparse.SUPPRESS)
    ap.add_argument("--child-out", help=argparse.SUPPRESS)
    for k in ("--keys", "--events", "--parallelism", "--batches", "--rounds"):
        ap.add_argument(k, type=int, help=argparse.SUPPRESS)
    for k in ("--driver-memory", "--mode", "--plan"):
        ap.add_argument(k, help=argparse.SUPPRESS)
    ap.add_argument("--master", default="local[2]", help=argparse.SUPPRESS)
    ap.add_argument("--bigbatch-runs", help='JSON list of [master, mode]: overrides part 3\'s runs')
    ap.add_argument("--grid-batches", type=int, help="overrides the grid's batches per run")
    ap.add_argument("--grid-only", help="KEYS[,KEYS]: run only these key counts of the grid")
    ap.add_argument("--payload", type=int, default=0, help=argparse.SUPPRESS)
    a = ap.parse_args(argv)
    if a.child:
        os.environ["PYSPARK_PYTHON"] = sys.executable
        res = {"grid": child_grid, "engines": child_engines, "bigbatch": child_bigbatch,
               "catchup": child_catchup}[a.child](a)
        with open(a.child_out, "w") as f:
            json.dump(res, f, indent=1, default=str)
        return 0

    import dstl

    cfg = json.loads(json.dumps(SMOKE if a.smoke else FULL))
    if a.bigbatch_runs:
        cfg["bigbatch"]["runs"] = json.loads(a.bigbatch_runs)
    if a.grid_batches:
        cfg["grid_batches"] = a.grid_batches
    if a.grid_only:
        only = {int(k) for k in a.grid_only.split(",")}
        cfg["grid"] = [g for g in cfg["grid"] if g[0] in only]
    if a.engines_events:
        cfg["engines"]["events"] = a.engines_events
    if a.engines_batches:
        cfg["engines"]["batches"] = json.loads(a.engines_batches)
    parts = [p.strip() for p in a.parts.split(",") if p.strip()]
    os.makedirs(a.out, exist_ok=True)
    name = "scale-smoke" if a.smoke else "scale"
    report = {"setup": {"config": cfg, "parts": parts, "smoke": a.smoke, "implementation": dstl.IMPLEMENTATION,
                        "cpus": os.cpu_count(), "when": time.strftime("%Y-%m-%d %H:%M UTC", time.gmtime()),
                        "commit": _commit()},
              "load": {}, "parts": {}}
    target = os.path.join(a.out, name + ".json")
    earlier_bigbatch = None
    if a.merge and os.path.exists(target):  # another invocation ran the other parts: keep them
        with open(target) as f:
            old = json.load(f)
        report["load"] = {k: v for k, v in old.get("load", {}).items() if k not in parts}
        report["parts"] = {k: v for k, v in old.get("parts", {}).items() if k not in parts}
        if "bigbatch" in parts and "bigbatch" in old.get("parts", {}):
            earlier_bigbatch = old["parts"]["bigbatch"]  # runs of other (master, mode) pairs are kept
        report["setup"]["earlier_invocations"] = old["setup"].get("earlier_invocations", []) + [
            {k: old["setup"].get(k) for k in ("parts", "when", "commit", "elapsed_min")}]
    t0 = time.time()
    for p in parts:
        before = loadavg()
        t = time.time()
        try:
            report["parts"][p] = PARTS[p](cfg, a.out)
            if p == "bigbatch" and earlier_bigbatch:
                report["parts"][p] = {**earlier_bigbatch, **report["parts"][p]}
        except Exception as exc:  # noqa: BLE001 - keep the other parts
            import traceback

            traceback.print_exc()
            report["parts"][p] = {"error": f"{type(exc).__name__}: {exc}"[:500]}
        report["load"][p] = {"before": before, "after": loadavg(), "minutes": round((time.time() - t) / 60, 1)}
        print(f"{p}: load before {before}, after {report['load'][p]['after']}, "
              f"{report['load'][p]['minutes']} min", flush=True)
        with open(os.path.join(a.out, name + ".json"), "w") as f:  # after every part: a partial run is kept
            json.dump(report, f, indent=1, default=str)
    loads = [v for p in report["load"] for v in (report["load"][p]["before"], report["load"][p]["after"])]
    report["setup"]["load_first"] = loads[0].split()[0] if loads else "?"
    report["setup"]["load_last"] = loads[-1].split()[0] if loads else "?"
    report["setup"]["elapsed_min"] = round((time.time() - t0) / 60, 1)
    with open(os.path.join(a.out, name + ".json"), "w") as f:
        json.dump(report, f, indent=1, default=str)
    chart(report, os.path.join(a.out, name + ".png"))
    print_tables(report)
    return 0


def _commit() -> str:
    import subprocess

    try:
        return subprocess.run(["git", "-C", ROOT, "rev-parse", "--short", "HEAD"], capture_output=True,
                              text=True, check=True).stdout.strip()
    except (OSError, subprocess.CalledProcessError):
        return "?"


def print_tables(report: dict) -> None:
    parts = report["parts"]
    if "grid" in parts:
        print("\n| keys | events/batch | P | batch s, median (min-max) after the first | warm | restored | "
              "start ms median / max | hop ms (max, median) | driver JVM / Python peak MB | slots MB | B per key |")
        print("|---" * 11 + "|")
        for r in parts["grid"]["runs"]:
            s = r.get("summary")
            if not s:
                print(f"| {r.get('keys')} | {r.get('events')} | {r.get('parallelism')} | FAILED: {r.get('error')} |")
                continue
            w = s["wall_s"][1:]
            print(f"| {r['keys']:,} | {r['events']:,} | {r['parallelism']} | {s['wall_s_median_after_first']:.2f} "
                  f"({min(w):.2f}-{max(w):.2f}) | {s['warm']}/{s['subtask_batches']} | {s['restored_after_first']} | "
                  f"{s['start_ms_median']:.1f} / {s['start_ms_max']:.1f} | {s['hop_ms_max_median']:.0f} | "
                  f"{s['driver_jvm_peak_mb']:,.0f} / {s['driver_python_peak_mb']:,.0f} | {s['slot_rss_mb_last']:,.0f} | "
                  f"{s['slot_rss_per_key_b_last']:,.0f} |" + (f" error: {r['error']}" if r.get("error") else ""))
    if "engines" in parts:
        print()
        for n, s in parts["engines"].get("summary", {}).items():
            print(f"{n}: {s}")
        for g in parts["engines"].get("ratios", []):
            print(f"{g['engine']} vs {g['vs']}: {g['ratio']}x (goal {g['goal']:g}x: {'met' if g['met'] else 'MISSED'})")
    if "bigbatch" in parts:
        print()
        for m, r in parts["bigbatch"].items():
            if m == "config" or not isinstance(r, dict):
                continue
            print(f"{m}: {r.get('seconds')} s, driver JVM peak {r.get('driver_jvm_peak_mb')} MB, "
                  f"Python {r.get('driver_python_peak_mb')} MB, error {r.get('error')}")
    if "catchup" in parts:
        print()
        for r in parts["catchup"].get("rows", []):
            print(f"{r['keys']:,} keys, {r['changes']:,} changes: full restore {r['full_restore_ms']:.0f} ms "
                  f"({r['full_us_per_change']:.2f} us/change), one batch replayed {r['catchup_ms']:.0f} ms "
                  f"({r['catchup_us_per_change']:.2f} us/change)")
    for p, l in report["load"].items():
        print(f"load {p}: {l['before']} -> {l['after']} ({l['minutes']} min)")


if __name__ == "__main__":
    sys.exit(main(sys.argv[1:]))
