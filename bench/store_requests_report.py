"""What a steady-state StatefulStream batch asks of an object store, and what that costs when every
request takes 50 ms: per-batch time on S3 (moto's server on 127.0.0.1 behind tests/s3proxy.py, one
proxy for the driver and one for Spark's Python workers, each adding `--latency-ms` to every request)
against the same batches with the base path on local disk. Writes bench/results/store_requests.json
and prints a markdown table.

The same query runs once per code tree (`--trees`: name=path; default "after" = this tree): a tree's
run puts that path first on PYTHONPATH and runs from a neutral directory, so e.g.
`git worktree add /tmp/req-base main` (with this tree's built extensions copied in) measures the code
before a change side by side with this one, in one run on one machine.

Per run: `--batches` batches of `--events` events (tests/streaming_util.py, P=2, local[2]); batch
time = foreachBatch's `stream(df)` on the driver (the progress file's start and done), median and
range over the batches after the first two; requests = what each proxy forwarded between one batch's
start and the next one's, median over the same batches, with the kinds of the last one.

    python bench/store_requests_report.py [--batches 8] [--events 1000] [--latency-ms 50]
        [--trees before=/tmp/req-base,after=.]
"""
from __future__ import annotations

import argparse
import collections
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
TESTS = os.path.join(ROOT, "tests")
sys.path.insert(0, ROOT)
sys.path.insert(0, TESTS)

from cluster_util import free_port, read_progress, run_stream_driver  # noqa: E402
from s3proxy import ProxyProcess, request_kind  # noqa: E402
from streaming_util import make_batches, write_json_batch  # noqa: E402

CREDENTIALS = {"AWS_ACCESS_KEY_ID": "testing", "AWS_SECRET_ACCESS_KEY": "testing",
               "AWS_DEFAULT_REGION": "us-east-1"}
WARMUP = 2
CONF = {"spark.master": "local[2]", "spark.driver.host": "127.0.0.1", "spark.driver.bindAddress": "127.0.0.1",
        "spark.ui.enabled": "false", "spark.sql.shuffle.partitions": "4",
        "spark.sql.execution.arrow.pyspark.enabled": "true"}


def _spread(values):
    if not values:
        return None
    return {"median": statistics.median(values), "min": min(values), "max": max(values), "n": len(values)}


def run_one(tree: str, base: str, work: str, batches, proxies=None) -> dict:
    """One query over `batches` with the code of `tree`; per-batch times and (with proxies) requests."""
    inputs, ckpt, progress = (os.path.join(work, n) for n in ("input", "spark-checkpoint", "progress.jsonl"))
    for b, batch in enumerate(batches):
        write_json_batch(inputs, b, batch)
    env = {k: v for k, v in os.environ.items() if not k.startswith("AWS_ENDPOINT_URL")}
    env.update(CREDENTIALS, PYTHONPATH=os.pathsep.join([tree, TESTS]), PYSPARK_PYTHON=sys.executable,
               SPARK_LOCAL_IP="127.0.0.1")
    conf = dict(CONF)
    if proxies is not None:  # each side finds its own proxy in a config file of its own
        for who, proxy in proxies.items():
            ini = os.path.join(work, f"aws-config-{who}")
            with open(ini, "w") as f:
                f.write(f"[default]\nendpoint_url = {proxy.endpoint}\n")
            if who == "driver":
                env["AWS_CONFIG_FILE"] = ini
            else:
                conf["spark.executorEnv.AWS_CONFIG_FILE"] = ini
    # the driver script is this tree's; the code it imports is `tree`'s (first on PYTHONPATH, and the
    # working directory is neutral: an editable install's directory would otherwise come first)
    cwd = os.getcwd()
    os.chdir(work)
    try:
        run_stream_driver(env, conf, ["--base", base, "--input", inputs, "--checkpoint", ckpt,
                                      "--parallelism", "2", "--option", "upload.timeout=10s"], progress,
                          timeout=1800)
    finally:
        os.chdir(cwd)
    entries = read_progress(progress)
    starts = {e["batch"]: e["t"] for e in entries if e["phase"] == "start"}
    dones = {e["batch"]: e["t"] for e in entries if e["phase"] == "done"}
    steady = [b for b in sorted(starts) if b >= WARMUP and b in dones]
    out = {"batch_s": _spread([dones[b] - starts[b] for b in steady])}
    if proxies is not None:
        counted = [b for b in steady if b + 1 in starts]  # a batch's requests run to the next start
        per = {}
        for who, proxy in proxies.items():
            reqs = proxy.requests()
            per[who] = [[request_kind(m, p) for t, m, p in reqs if starts[b] <= t < starts[b + 1]] for b in counted]
        out["requests"] = {who: _spread([len(k) for k in kinds]) for who, kinds in per.items()}
        out["kinds_last"] = {who: dict(sorted(collections.Counter(kinds[-1]).items()))
                             for who, kinds in per.items() if kinds}
    return out


def main(argv=None) -> int:
    p = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    p.add_argument("--batches", type=int, default=8, help="batches per run (default 8; the first 2 are warm-up)")
    p.add_argument("--events", type=int, default=1_000, help="events per batch (default 1000)")
    p.add_argument("--keys", type=int, default=400, help="distinct keys (default 400)")
    p.add_argument("--latency-ms", type=float, default=50.0, help="added to every S3 request (default 50)")
    p.add_argument("--trees", default=f"after={ROOT}", help="name=path,... (default after=this tree)")
    p.add_argument("--out", default=os.path.join(HERE, "results", "store_requests.json"))
    args = p.parse_args(argv)
    trees = dict(t.split("=", 1) for t in args.trees.split(","))
    trees = {name: os.path.abspath(path) for name, path in trees.items()}
    batches = make_batches(args.batches, args.events, args.keys, seed=42)
    load_before = open("/proc/loadavg").read().split()[:3]
    work = tempfile.mkdtemp(prefix="dstl-requests-bench-")
    results = {}
    from moto.server import ThreadedMotoServer

    logging.getLogger("werkzeug").setLevel(logging.ERROR)  # one line per S3 request otherwise
    port = free_port()
    moto = ThreadedMotoServer(ip_address="127.0.0.1", port=port, verbose=False)
    moto.start()
    endpoint = f"http://127.0.0.1:{port}"
    try:
        import s3fs

        os.environ.update(CREDENTIALS)
        fs = s3fs.S3FileSystem(client_kwargs={"endpoint_url": endpoint}, skip_instance_cache=True)
        for name, tree in trees.items():
            for kind in ("local", "s3"):
                job = os.path.join(work, f"{name}-{kind}")
                os.makedirs(job)
                proxies = None
                if kind == "s3":
                    bucket = f"dstl-bench-{name}"
                    fs.mkdir(bucket)
                    proxies = {}
                    for who in ("driver", "tasks"):
                        os.makedirs(os.path.join(job, who))
                        proxies[who] = ProxyProcess(endpoint, os.path.join(job, who))
                        proxies[who].set(latency_s=args.latency_ms / 1e3)
                base = os.path.join(job, "state") if kind == "local" else f"s3://dstl-bench-{name}/job"
                t0 = time.monotonic()
                try:
                    results.setdefault(name, {})[kind] = run_one(tree, base, job, batches, proxies)
                finally:
                    for proxy in (proxies or {}).values():
                        proxy.stop()
                print(f"{name} {kind}: {time.monotonic() - t0:.0f} s", file=sys.stderr, flush=True)
    finally:
        moto.stop()
        shutil.rmtree(work, ignore_errors=True)
    load_after = open("/proc/loadavg").read().split()[:3]
    report = {"events_per_batch": args.events, "keys": args.keys, "batches": args.batches, "warmup": WARMUP,
              "latency_ms": args.latency_ms, "trees": trees, "loadavg_before": load_before,
              "loadavg_after": load_after, "results": results}
    os.makedirs(os.path.dirname(args.out), exist_ok=True)
    with open(args.out, "w") as f:
        json.dump(report, f, indent=1)
    print(f"| code | batch time, local disk: median (min-max) s | on S3 +{args.latency_ms:.0f} ms/request | "
          "S3 overhead (median) | requests per batch: driver / tasks |")
    print("|---|---|---|---|---|")
    for name, r in results.items():
        loc, s3 = r["local"]["batch_s"], r["s3"]["batch_s"]
        req = r["s3"]["requests"]
        print(f"| {name} | {loc['median']:.2f} ({loc['min']:.2f}-{loc['max']:.2f}) | "
              f"{s3['median']:.2f} ({s3['min']:.2f}-{s3['max']:.2f}) | {s3['median'] - loc['median']:+.2f} s | "
              f"{req['driver']['median']:.0f} / {req['tasks']['median']:.0f} |")
    print(f"\nload average before {' '.join(load_before)}, after {' '.join(load_after)}")
    return 0


if __name__ == "__main__":
    sys.exit(main())
