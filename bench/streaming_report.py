"""Spark's native transformWithState / transformWithStateInPandas (RocksDB state) vs dstl's
StatefulStream, in one run.

Usage: .venv/bin/python bench/streaming_report.py [--events 200000] [--keys 50000] [--batches 4]
       [--engines native-pandas,dstl-pandas,...]

One JSON file stream (`--events` per micro-batch file, `--keys` users, local[2]) feeds five
streaming queries in one Spark session, their batches interleaved (round b feeds file b to each query
in turn, rotating the order, and waits for it with processAllAvailable):
* native-pandas: `groupBy("user").transformWithStateInPandas(UserTotals(), ...)`, RocksDB state
  store, `spark.sql.shuffle.partitions` = parallelism, output written as parquet by foreachBatch;
* native-row: `groupBy("user").transformWithState(RowUserTotals(), ...)` (PySpark 4.1+'s Row API),
  the same way;
* dstl-pandas: the same UserTotals object through `foreachBatch(StatefulStream(...))`;
* dstl-row: the same RowUserTotals object through `StatefulStream(..., api="row")`;
* dstl-fn: the vectorised equivalent `user_totals_fn(rows, state)` through StatefulStream.
Both engines get `parallelism` concurrent tasks per batch on the same local[2] cores.
Batch time = the query progress's `triggerExecution` for the batch (same measure for all);
events/s = events per batch / median batch time of batches 1.. (batch 0 also starts Python workers).

Then a fresh driver process (a new JVM and new Python workers, as after a driver failure) restarts
each query from its checkpoint and runs one more batch (restore), and then restarts each again with
twice the parallelism for one more batch (rescale): Spark keeps the state partitions of the
checkpoint (the offset log pins spark.sql.shuffle.partitions), dstl rescales. Finally every engine's
committed output is compared with a pandas computation over all input.

Writes bench/results/streaming.json and bench/results/streaming.png. The machine is shared (2 cores),
so the numbers are noisy; the interleaving makes load hit the engines alike.
"""
from __future__ import annotations

import argparse
import json
import os
import shutil
import statistics
import subprocess
import sys
import tempfile
import time
from typing import Dict, List, Optional

HERE = os.path.dirname(os.path.abspath(__file__))
ROOT = os.path.dirname(HERE)
sys.path.insert(0, ROOT)
sys.path.insert(0, os.path.join(ROOT, "tests"))   # the file-stream generator and native runner
sys.path.insert(0, HERE)

os.environ.setdefault("SPARK_LOCAL_IP", "127.0.0.1")
os.environ["PYSPARK_PYTHON"] = sys.executable

from _streaming_workload import (OUTPUT, OUTPUT_COLS, RowUserTotals, UserTotals, reference,  # noqa: E402
                                 user_totals_fn)
from streaming_util import (NATIVE_CONF, make_batches, normalize, read_output, read_stream,  # noqa: E402
                            write_json_batch)

ENGINES = ("native-pandas", "native-row", "dstl-pandas", "dstl-row", "dstl-fn")
#: (dstl engine, the native engine it is compared with, the goal in x native events/s)
GOALS = (("dstl-row", "native-row", 10.0), ("dstl-pandas", "native-pandas", 5.0),
         ("dstl-fn", "native-pandas", 30.0), ("dstl-fn", "native-row", 30.0))
RESULTS = os.path.join(HERE, "results")


def _session(shuffle_partitions: int):
    from pyspark.sql import SparkSession

    spark = (SparkSession.builder.master("local[2]").appName("dstl-streaming-bench")
             .config("spark.driver.host", "127.0.0.1").config("spark.driver.bindAddress", "127.0.0.1")
             .config("spark.ui.enabled", "false").config("spark.ui.showConsoleProgress", "false")
             .config("spark.driver.memory", "4g")
             .config("spark.sql.shuffle.partitions", str(shuffle_partitions))
             .config("spark.sql.execution.arrow.pyspark.enabled", "true").getOrCreate())
    spark.sparkContext.setLogLevel("ERROR")
    for k, v in NATIVE_CONF.items():
        spark.conf.set(k, v)
    return spark


class Engine:
    """One streaming query over its own input directory (files are fed to it one at a time)."""

    def __init__(self, name: str, work: str):
        self.name = name
        self.dir = os.path.join(work, name)
        self.input = os.path.join(self.dir, "input")
        self.checkpoint = os.path.join(self.dir, "spark-checkpoint")
        self.output = os.path.join(self.dir, "output")
        os.makedirs(self.input, exist_ok=True)
        self.query = None
        self.stream = None
        self._seen = set()

    def start(self, spark, parallelism: int):
        events = read_stream(spark, self.input)
        if self.name.startswith("native"):
            grouped = events.groupBy("user")
            if self.name == "native-row":
                out = grouped.transformWithState(RowUserTotals(), OUTPUT, "Update", "None")
            else:
                out = grouped.transformWithStateInPandas(UserTotals(), OUTPUT, "Update", "None")
            target = self.output

            def sink(df, batch_id):  # an idempotent parquet sink, as dstl's default one
                df.write.mode("overwrite").parquet(os.path.join(target, f"batch_id={batch_id}"))

            writer = out.writeStream.foreachBatch(sink)
        else:
            from dstl.spark import StatefulStream

            fn = {"dstl-pandas": UserTotals(), "dstl-row": RowUserTotals()}.get(self.name, user_totals_fn)
            self.stream = StatefulStream(os.path.join(self.dir, "job"), fn, OUTPUT, key="user",
                                         parallelism=parallelism, output_path=self.output,
                                         api="row" if self.name == "dstl-row" else "pandas")
            writer = events.writeStream.foreachBatch(self.stream)
        self.query = (writer.option("checkpointLocation", self.checkpoint)
                      .trigger(processingTime="200 milliseconds").start())
        self._seen = {p["batchId"] for p in self._progress()}

    def _progress(self) -> List[dict]:
        return [json.loads(p.json) for p in self.query.recentProgress]

    def run_batch(self, index: int, batch) -> dict:
        """Feed one file, wait until the query has processed it; the batch's measurements."""
        t0 = time.perf_counter()
        write_json_batch(self.input, index, batch)
        self.query.processAllAvailable()
        wall = time.perf_counter() - t0
        new = [p for p in self._progress() if p["batchId"] not in self._seen and p["numInputRows"] > 0]
        if len(new) != 1:
            raise RuntimeError(f"{self.name}: expected one new batch with input, got {len(new)}")
        p = new[0]
        self._seen.add(p["batchId"])
        rec = {"batch_id": p["batchId"], "rows": p["numInputRows"], "wall_s": wall,
               "batch_ms": p["durationMs"]["triggerExecution"], "durations_ms": p["durationMs"]}
        if self.name.startswith("native"):
            op = p["stateOperators"][0]
            cm = op.get("customMetrics", {})
            rec.update({
                "state_commit_ms": op["commitTimeMs"],
                "offset_commit_ms": p["durationMs"].get("walCommit", 0) + p["durationMs"].get("commitOffsets", 0),
                "state_partitions": op["numShufflePartitions"],
                "rocksdb_load_ms": cm.get("rocksdbLoadLatencyMs"),
                "rocksdb_loaded_from_dfs": cm.get("rocksdbNumLoadedFromDfs"),
                "state_rows": op["numRowsTotal"],
            })
        else:
            r = self.stream.results[-1]
            rec.update({"checkpoint_ms": r.checkpoint_ms, "restored_subtasks": r.restored,
                        "restore_ms": r.restore_ms, "cache_hits": r.cache_hits, "stream_s": r.seconds,
                        "parallelism": self.stream.parallelism, "phases_ms": r.phases_ms,
                        "process_ms": [t.process_ms for t in r.reports],
                        "snapshot_ms": [t.snapshot_ms for t in r.reports],
                        "task_metrics": [json.loads(t.metrics or "{}") for t in r.reports],
                        "task_pids": [t.pid for t in r.reports]})
        return rec

    def stop(self):
        if self.query is not None:
            self.query.stop()
            self.query = None
        if self.stream is not None:
            self.stream.close()


def _p99(xs: List[float]) -> float:
    xs = sorted(xs)
    return xs[min(len(xs) - 1, int(round(0.99 * (len(xs) - 1))))]


def steady_phase(work: str, batches, parallelism: int, names) -> Dict[str, List[dict]]:
    spark = _session(parallelism)
    engines = [Engine(n, work) for n in names]
    for e in engines:
        e.start(spark, parallelism)
    per = {e.name: [] for e in engines}
    try:
        for b, batch in enumerate(batches):
            order = engines[b % len(engines):] + engines[:b % len(engines)]
            for e in order:
                rec = e.run_batch(b, batch)
                per[e.name].append(rec)
                print(f"  batch {b} {e.name:<15} {rec['batch_ms'] / 1000:8.2f} s", flush=True)
    finally:
        for e in engines:
            e.stop()
        spark.stop()
    return per


def restart_phase(work: str, batches, first: int, parallelism: int, names) -> dict:
    """In a fresh driver: each query restarts from its checkpoint for batch `first` (restore), then
    again with twice the parallelism for batch `first + 1` (rescale)."""
    spark = _session(parallelism)
    out: Dict[str, dict] = {}
    try:
        for step, (b, p) in enumerate(((first, parallelism), (first + 1, 2 * parallelism))):
            spark.conf.set("spark.sql.shuffle.partitions", str(p))
            for name in names:
                e = Engine(name, work)
                t0 = time.perf_counter()
                e.start(spark, p)
                try:
                    rec = e.run_batch(b, batches[b])
                finally:
                    e.stop()
                rec["start_to_done_s"] = time.perf_counter() - t0
                rec["requested_parallelism"] = p
                if name.startswith("native"):
                    with open(os.path.join(e.checkpoint, "offsets", str(rec["batch_id"]))) as f:
                        meta = json.loads(f.read().splitlines()[1])
                    rec["offset_log_shuffle_partitions"] = int(meta["conf"]["spark.sql.shuffle.partitions"])
                out.setdefault("restore" if step == 0 else "rescale", {})[name] = rec
                print(f"  {'restore' if step == 0 else 'rescale'} batch {b} {name:<15} "
                      f"{rec['batch_ms'] / 1000:8.2f} s", flush=True)
    finally:
        spark.stop()
    return out


def verify(work: str, batches, names) -> Dict[str, bool]:
    expected = normalize(reference(batches), OUTPUT_COLS + ["batch_id"])
    ok = {}
    for name in names:
        got = read_output(os.path.join(work, name, "output"))
        ok[name] = bool(len(got) and normalize(got, OUTPUT_COLS + ["batch_id"]).equals(expected))
    return ok


def summarize(steady: Dict[str, List[dict]], restart: dict, events: int) -> dict:
    s: Dict[str, dict] = {}
    for name, recs in steady.items():
        warm = recs[1:] or recs
        med_ms = statistics.median(r["batch_ms"] for r in warm)
        row = {"median_batch_s": med_ms / 1000, "events_per_s": events / (med_ms / 1000),
               "batch_s": [r["batch_ms"] / 1000 for r in recs]}
        if not name.startswith("native"):
            row["phases_ms"] = phase_breakdown(warm)
        if restart:
            row.update(restore_batch_s=restart["restore"][name]["batch_ms"] / 1000,
                       restore_start_to_done_s=restart["restore"][name]["start_to_done_s"],
                       rescale_batch_s=restart["rescale"][name]["batch_ms"] / 1000)
        if not restart:  # --steady-only
            row["checkpoint_ms"] = [r.get("checkpoint_ms", r.get("state_commit_ms")) for r in recs]
        elif name.startswith("native"):
            row["checkpoint_ms"] = [r["state_commit_ms"] for r in recs]
            row["offset_commit_ms"] = [r["offset_commit_ms"] for r in recs]
            row["rescale_state_partitions"] = restart["rescale"][name]["state_partitions"]
            row["rescale_offset_log_shuffle_partitions"] = restart["rescale"][name]["offset_log_shuffle_partitions"]
            row["restore_rocksdb_load_ms"] = restart["restore"][name]["rocksdb_load_ms"]
        elif restart:
            row["checkpoint_ms"] = [r["checkpoint_ms"] for r in recs]
            row["restore_ms"] = restart["restore"][name]["restore_ms"]
            row["restore_restored_subtasks"] = restart["restore"][name]["restored_subtasks"]
            row["rescale_parallelism"] = restart["rescale"][name]["parallelism"]
            row["rescale_restored_subtasks"] = restart["rescale"][name]["restored_subtasks"]
            row["rescale_restore_ms"] = restart["rescale"][name]["restore_ms"]
        row["checkpoint_p50_ms"] = statistics.median(row["checkpoint_ms"])
        row["checkpoint_p99_ms"] = _p99(row["checkpoint_ms"])
        # the ratio per measured batch (batches of one round ran back to back): min / max
        row["events_per_s_batches"] = [events / (r["batch_ms"] / 1000) for r in warm]
        s[name] = row
    goals = []
    for ours, native, goal in GOALS:
        if ours in s and native in s:
            per_batch = [a / b for a, b in zip(s[ours]["events_per_s_batches"], s[native]["events_per_s_batches"])]
            ratio = s[ours]["events_per_s"] / s[native]["events_per_s"]
            goals.append({"engine": ours, "vs": native, "goal": goal, "ratio": ratio,
                          "ratio_min": min(per_batch), "ratio_max": max(per_batch), "met": ratio >= goal})
            s[ours].setdefault("speedup", {})[native] = ratio
    s["_goals"] = goals
    return s


#: the task's split of a Row API processor call (dstl.spark.processor.run_processor's metrics, in us)
ROW_SPLIT = ("rows_in_us", "handlers_us", "rows_out_us")


def phase_breakdown(recs: List[dict]) -> Dict[str, List[float]]:
    """Where a dstl batch's time goes, per batch (ms): Spark's streaming work around foreachBatch
    (`trigger_other`: listing the source, the offset and commit logs, the sink's bookkeeping), the
    driver's own steps (`prepare`: the routing column and the plan; `commit`: checkpoint metadata and
    sink), the Spark job (`job`), and inside it the slowest subtask's processor call, output staging
    plus snapshot, and the rest of the job (`job_other`: reading the JSON file, the routing pandas
    UDF, the broadcast and join, moving the rows into the Python workers and the reports back)."""
    out: Dict[str, List[float]] = {}

    def add(k, v):
        out.setdefault(k, []).append(round(v, 1))

    for r in recs:
        ph = r["phases_ms"]
        add("batch", r["batch_ms"])
        add("trigger_other", r["batch_ms"] - r["stream_s"] * 1e3)
        add("prepare", ph.get("prepare", 0.0))
        add("job", ph.get("tasks", 0.0))
        add("commit", ph.get("commit", 0.0))
        task = [p + s for p, s in zip(r["process_ms"], r["snapshot_ms"])]
        add("task_process_max", max(r["process_ms"]))
        add("task_stage_snapshot_max", max(r["snapshot_ms"]))
        add("job_other", ph.get("tasks", 0.0) - max(task))
        for k in ROW_SPLIT:
            vals = [m[k] / 1e3 for m in r.get("task_metrics", []) if k in m]
            if vals:
                add(k[:-3] + "_max", max(vals))
    return out


def print_phases(summary: dict) -> None:
    for name in ENGINES:
        ph = summary.get(name, {}).get("phases_ms")
        if not ph:
            continue
        cells = [f"{k} {statistics.median(v):.0f} ({min(v):.0f}-{max(v):.0f})" for k, v in ph.items()]
        print(f"{name} ms, median (min-max): " + ", ".join(cells))


def chart(summary: dict, path: str, title: str) -> None:
    import matplotlib

    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    names = [n for n in ENGINES if n in summary]
    palette = {"native-pandas": "#888888", "native-row": "#bbbbbb", "dstl-pandas": "#1f77b4",
               "dstl-row": "#9467bd", "dstl-fn": "#2ca02c"}
    colors = [palette[n] for n in names]
    fig, axes = plt.subplots(1, 3, figsize=(15, 4.6))
    ax = axes[0]
    vals = [summary[n]["events_per_s"] for n in names]
    ax.bar(names, vals, color=colors)
    ax.set_yscale("log")
    ax.set_ylim(top=max(vals) * 4)  # room for the labels
    ax.set_title("events/s (median batch; log scale)")
    for i, (n, v) in enumerate(zip(names, vals)):
        ratio = "".join(f"\n{r:.1f}x {k}" for k, r in summary[n].get("speedup", {}).items())
        ax.text(i, v, f"{v:,.0f}{ratio}", ha="center", va="bottom", fontsize=7)
    ax = axes[1]
    vals = [summary[n]["checkpoint_p99_ms"] for n in names]
    ax.bar(names, vals, color=colors)
    ax.set_title("checkpoint p99 (ms)")
    for i, v in enumerate(vals):
        ax.text(i, v, f"{v:,.0f}", ha="center", va="bottom", fontsize=8)
    ax = axes[2]
    vals = [summary[n]["restore_batch_s"] for n in names]
    ax.bar(names, vals, color=colors)
    ax.set_title("first batch after a driver restart (s)")
    ax.set_yscale("log")
    for i, v in enumerate(vals):
        ax.text(i, v, f"{v:,.1f}", ha="center", va="bottom", fontsize=8)
    for ax in axes:
        ax.tick_params(axis="x", labelsize=7, rotation=20)
    fig.suptitle(title, fontsize=9)
    fig.tight_layout()
    fig.savefig(path, dpi=110)


def main(argv: Optional[List[str]] = None) -> int:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--events", type=int, default=200_000, help="events per micro-batch file")
    ap.add_argument("--keys", type=int, default=50_000)
    ap.add_argument("--batches", type=int, default=4, help="interleaved batches (batch 0 is warm-up)")
    ap.add_argument("--parallelism", type=int, default=2)
    ap.add_argument("--work", help="working directory (default: a temporary one, deleted)")
    ap.add_argument("--out", default=RESULTS)
    ap.add_argument("--engines", default=",".join(ENGINES), help="comma-separated subset of " + ", ".join(ENGINES))
    ap.add_argument("--steady-only", action="store_true",
                    help="skip the restart phase; print the batches' phase breakdown (no chart, no JSON "
                         "unless --out is given)")
    ap.add_argument("--restart-phase", action="store_true", help=argparse.SUPPRESS)
    opts = ap.parse_args(argv)
    names = [n.strip() for n in opts.engines.split(",") if n.strip()]
    unknown = [n for n in names if n not in ENGINES]
    if unknown or not names:
        ap.error(f"--engines: unknown {unknown}; choose from {', '.join(ENGINES)}")

    batches = make_batches(opts.batches + 2, opts.events, opts.keys, seed=11)
    if opts.restart_phase:  # the child: a fresh driver
        res = restart_phase(opts.work, batches, opts.batches, opts.parallelism, names)
        with open(os.path.join(opts.work, "restart.json"), "w") as f:
            json.dump(res, f)
        return 0

    work = opts.work or tempfile.mkdtemp(prefix="dstl-streaming-bench-")
    started = time.time()
    try:
        print(f"steady: {opts.batches} batches x {opts.events:,} events, {opts.keys:,} keys", flush=True)
        load_before = _loadavg()
        steady = steady_phase(work, batches[:opts.batches], opts.parallelism, names)
        load_steady = _loadavg()
        if opts.steady_only:
            ok = verify(work, batches[:opts.batches], names)
            summary = summarize(steady, {}, opts.events)
            report = {"setup": {"events_per_batch": opts.events, "keys": opts.keys, "batches": opts.batches,
                                "loadavg": {"before": load_before, "after_steady": load_steady}},
                      "summary": summary, "outputs_match_pandas": ok, "steady": steady}
            if "--out" in (argv if argv is not None else sys.argv):
                os.makedirs(opts.out, exist_ok=True)
                with open(os.path.join(opts.out, "streaming_steady.json"), "w") as f:
                    json.dump(report, f, indent=1, default=str)
            print(f"load: before {load_before}, after {load_steady}; outputs = pandas: {ok}")
            for g in summary["_goals"]:
                print(f"{g['engine']} vs {g['vs']}: {g['ratio']:.1f}x")
            for n in names:
                print(f"{n}: median batch {summary[n]['median_batch_s']:.2f} s, batches "
                      + " ".join(f"{x:.2f}" for x in summary[n]["batch_s"]))
            print_phases(summary)
            return 0 if all(ok.values()) else 1
        print("restart (a new driver process): restore, then rescale", flush=True)
        subprocess.run([sys.executable, os.path.abspath(__file__), "--restart-phase", "--work", work,
                        "--events", str(opts.events), "--keys", str(opts.keys), "--batches", str(opts.batches),
                        "--parallelism", str(opts.parallelism), "--engines", ",".join(names)], check=True)
        with open(os.path.join(work, "restart.json")) as f:
            restart = json.load(f)
        ok = verify(work, batches, names)
        summary = summarize(steady, restart, opts.events)
    finally:
        if not opts.work:
            shutil.rmtree(work, ignore_errors=True)

    import dstl

    report = {
        "setup": {"events_per_batch": opts.events, "keys": opts.keys, "batches": opts.batches,
                  "parallelism": opts.parallelism, "master": "local[2]", "implementation": dstl.IMPLEMENTATION,
                  "state_store": "RocksDBStateStoreProvider", "elapsed_s": time.time() - started,
                  "when": time.strftime("%Y-%m-%d %H:%M UTC", time.gmtime()),
                  "loadavg": {"before": load_before, "after_steady": load_steady, "end": _loadavg()}},
        "summary": summary, "outputs_match_pandas": ok, "steady": steady, "restart": restart,
    }
    os.makedirs(opts.out, exist_ok=True)
    with open(os.path.join(opts.out, "streaming.json"), "w") as f:
        json.dump(report, f, indent=1, default=str)
    chart(summary, os.path.join(opts.out, "streaming.png"),
          f"{opts.events:,} events/batch, {opts.keys:,} keys, local[2], parallelism {opts.parallelism}; "
          f"shared 2-core machine")
    print_table(report)
    print_phases(summary)
    return 0 if all(ok.values()) else 1


def _loadavg() -> str:
    try:
        with open("/proc/loadavg") as f:
            return " ".join(f.read().split()[:3])
    except OSError:
        return "?"


def print_table(report: dict) -> None:
    s = report["summary"]
    names = [n for n in ENGINES if n in s]
    print("| | " + " | ".join(names) + " |")
    print("|---" * (len(names) + 1) + "|")

    def line(label, cell):
        print(f"| {label} | " + " | ".join(cell(n, s[n]) for n in names) + " |")

    line("events/s (median batch)", lambda n, r: f"{r['events_per_s']:,.0f}")
    line("median batch", lambda n, r: f"{r['median_batch_s']:.2f} s")
    line("checkpoint p50 / p99", lambda n, r: f"{r['checkpoint_p50_ms']:.0f} / {r['checkpoint_p99_ms']:.0f} ms")
    line("first batch after a driver restart", lambda n, r: f"{r['restore_batch_s']:.2f} s" + (
        f" (restore {r['restore_ms']:.0f} ms)" if "restore_ms" in r else
        f" (RocksDB load {r.get('restore_rocksdb_load_ms')} ms)"))
    line("restart with 2x parallelism", lambda n, r: (
        f"rescaled to {r['rescale_parallelism']}: {r['rescale_batch_s']:.2f} s" if "rescale_parallelism" in r else
        f"stays in {r['rescale_state_partitions']} partitions: {r['rescale_batch_s']:.2f} s"))
    line("output = pandas", lambda n, r: str(report["outputs_match_pandas"][n]))
    for g in s["_goals"]:
        print(f"{g['engine']} vs {g['vs']}: {g['ratio']:.1f}x (per batch {g['ratio_min']:.1f}-{g['ratio_max']:.1f}x), "
              f"goal {g['goal']:.0f}x: {'met' if g['met'] else 'MISSED'}")


if __name__ == "__main__":
    sys.exit(main())
