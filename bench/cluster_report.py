"""StatefulStream on a 2-worker Spark standalone cluster (tests/cluster_util.py): batch time, warm
rate and restore time at parallelism 2 and 4, with the state on a local directory and on S3 (moto's
server on 127.0.0.1). Writes bench/results/cluster.json and prints a markdown table.

Per base path, one job over a JSON file stream (tests/streaming_util.py, the vectorised count_fn):
  phase A  parallelism 2, `--batches` batches from empty state
  phase B  the same query restarted at parallelism 4: its first batch restores every subtask
           (a rescale 2 -> 4), the rest should continue warm
  phase C  restarted at parallelism 2 for 3 batches: the first restores (a rescale 4 -> 2)
Batch time = foreachBatch's `stream(df)` on the driver, after each phase's first batch (median,
min-max). Warm = subtask-batches that continued from memory, after each phase's first batch. Restore
= the restored subtasks' restore_ms in the first batch of phases B and C.

    python bench/cluster_report.py [--batches 9] [--events 20000] [--keys 5000] [--quick]
"""
from __future__ import annotations

import argparse
import json
import logging
import os
import shutil
import statistics
import sys
import tempfile
import time

HERE = os.path.dirname(os.path.abspath(__file__))
ROOT = os.path.dirname(HERE)
sys.path.insert(0, ROOT)
sys.path.insert(0, os.path.join(ROOT, "tests"))

from cluster_util import StandaloneCluster, free_port, read_progress, run_stream_driver  # noqa: E402
from streaming_util import make_batches, write_json_batch  # noqa: E402

CREDENTIALS = {"AWS_ACCESS_KEY_ID": "testing", "AWS_SECRET_ACCESS_KEY": "testing"}


def _spread(values):
    if not values:
        return None
    return {"median": statistics.median(values), "min": min(values), "max": max(values), "n": len(values)}


def run_job(cluster, base, work, batches, conf, driver_env, phases):
    """Run the phases [(parallelism, n_batches)] of one job; returns the per-batch progress entries."""
    inputs, ckpt, progress = (os.path.join(work, n) for n in ("input", "spark-checkpoint", "progress.jsonl"))
    done = 0
    for parallelism, n in phases:
        for b in range(done, done + n):
            write_json_batch(inputs, b, batches[b])
        done += n
        run_stream_driver(driver_env, conf, ["--base", base, "--input", inputs, "--checkpoint", ckpt,
                                             "--parallelism", str(parallelism), "--fn",
                                             "--option", "upload.timeout=10s"], progress)
    return [e for e in read_progress(progress) if e["phase"] == "done" and not e["replayed"]]


def summarize(entries, phases):
    out = []
    start = 0
    for parallelism, n in phases:
        mine = entries[start:start + n]
        start += n
        later = mine[1:]
        warm = [r["continued"] for e in later for r in e["reports"]]
        restores = [r["restore_ms"] for r in mine[0]["reports"] if r["restored"]]
        out.append({
            "parallelism": parallelism, "batches": n,
            "first_batch_s": mine[0]["seconds"],
            "batch_s": _spread([e["seconds"] for e in later]),
            "warm": [sum(warm), len(warm)],
            "first_batch_restored": len(restores),
            "restore_ms": _spread(restores),
            "executors_per_batch": _spread([len({r["executor"] for r in e["reports"]}) for e in later]),
        })
    return out


def main(argv=None) -> int:
    p = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    p.add_argument("--batches", type=int, default=9, help="batches of phases A and B (default 9)")
    p.add_argument("--events", type=int, default=20_000, help="events per batch (default 20000)")
    p.add_argument("--keys", type=int, default=5_000, help="distinct keys (default 5000)")
    p.add_argument("--bases", default="local,s3", help="local, s3 or both (default local,s3)")
    p.add_argument("--out", default=os.path.join(HERE, "results", "cluster.json"))
    args = p.parse_args(argv)
    phases = [(2, args.batches), (4, args.batches), (2, 3)]
    batches = make_batches(sum(n for _, n in phases), args.events, args.keys, seed=23)
    load_before = open("/proc/loadavg").read().split()[:3]
    work = tempfile.mkdtemp(prefix="dstl-cluster-bench-")
    results = {}
    moto = None
    try:
        if "s3" in args.bases:
            from moto.server import ThreadedMotoServer

            logging.getLogger("werkzeug").setLevel(logging.ERROR)  # one line per S3 request otherwise

            port = free_port()
            moto = ThreadedMotoServer(ip_address="127.0.0.1", port=port, verbose=False)
            moto.start()
            endpoint = f"http://127.0.0.1:{port}"
            os.environ.update(CREDENTIALS, AWS_ENDPOINT_URL=endpoint, AWS_DEFAULT_REGION="us-east-1")
            import s3fs

            s3fs.S3FileSystem(client_kwargs={"endpoint_url": endpoint}).mkdir("dstl-bench")
        with StandaloneCluster(os.path.join(work, "cluster"), workers=2,
                               env={k: None for k in CREDENTIALS}) as cluster:
            conf = dict(cluster.app_conf())
            if moto is not None:
                conf.update({f"spark.executorEnv.{k}": v for k, v in CREDENTIALS.items()})
                conf["spark.executorEnv.AWS_ENDPOINT_URL"] = os.environ["AWS_ENDPOINT_URL"]
                conf["spark.executorEnv.AWS_DEFAULT_REGION"] = "us-east-1"
            driver_env = cluster.driver_env(dict(CREDENTIALS, PYTHONPATH=os.pathsep.join([ROOT, os.path.join(ROOT, "tests")])))
            for kind in args.bases.split(","):
                job_dir = os.path.join(work, kind)
                os.makedirs(job_dir)
                base = os.path.join(job_dir, "state") if kind == "local" else "s3://dstl-bench/job"
                t0 = time.monotonic()
                entries = run_job(cluster, base, job_dir, batches, conf, driver_env, phases)
                results[kind] = {"phases": summarize(entries, phases), "wall_s": time.monotonic() - t0}
                print(f"{kind}: {results[kind]['wall_s']:.0f} s", file=sys.stderr, flush=True)
    finally:
        if moto is not None:
            moto.stop()
        shutil.rmtree(work, ignore_errors=True)
    load_after = open("/proc/loadavg").read().split()[:3]
    report = {"events_per_batch": args.events, "keys": args.keys, "phases": phases,
              "loadavg_before": load_before, "loadavg_after": load_after, "results": results}
    os.makedirs(os.path.dirname(args.out), exist_ok=True)
    with open(args.out, "w") as f:
        json.dump(report, f, indent=1)
    print(f"| base | phase | batch time s, median (min-max) | warm after batch 1 | restore ms in the first batch |")
    print("|---|---|---|---|---|")
    names = ["A: P=2 from empty", "B: P=4 (rescale 2->4)", "C: P=2 (rescale 4->2)"]
    for kind, r in results.items():
        for name, ph in zip(names, r["phases"]):
            bt = ph["batch_s"]
            rs = ph["restore_ms"]
            print(f"| {kind} | {name} | {bt['median']:.2f} ({bt['min']:.2f}-{bt['max']:.2f}) | "
                  f"{ph['warm'][0]}/{ph['warm'][1]} | "
                  + (f"{rs['median']:.0f} ({rs['min']:.0f}-{rs['max']:.0f}), {ph['first_batch_restored']} subtasks"
                     if rs else "none (empty state)") + " |")
    print(f"\nload average before {' '.join(load_before)}, after {' '.join(load_after)}")
    return 0


if __name__ == "__main__":
    sys.exit(main())
