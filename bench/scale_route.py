"""How a micro-batch reaches its subtasks: the shuffle route against the broadcast route, side by side.

    python bench/scale_route.py [--master local[2]] [--parallelism 2] [--rows 200000] [--keys 100000]
                                [--payload 256] [--batches 4] [--driver-memory 1g] [--json OUT]

Each route runs in its own driver process (so each JVM's peak RSS is its own): a `StatefulStream`
with the vectorised count per user over `--batches` batches generated on the executors
(tests/route_driver.batch_df: `--rows` rows, `--keys` keys, a `--payload` of hex characters per row).
The broadcast route is forced by replacing `dstl.spark.routing.choose_route`, which `StatefulStream`
consults per batch. Per route: batch seconds (median of the batches after the first), subtasks
restored, and the peak RSS (VmHWM) of the driver JVM and of the driver's Python process. The load
average is printed with the results: absolute times on a shared machine are inflated, compare the
two routes of one run.
"""
from __future__ import annotations

import argparse
import json
import os
import statistics
import subprocess
import sys
import tempfile

HERE = os.path.dirname(os.path.abspath(__file__))
ROOT = os.path.dirname(HERE)
sys.path.insert(0, HERE)

from _driver_proc import child_env, driver_session, loadavg, peak_mb  # noqa: E402


def one_route(a) -> dict:
    """Run in the child: one route, every batch; returns the figures."""
    os.environ["PYSPARK_PYTHON"] = sys.executable
    sys.path.insert(0, os.path.join(ROOT, "tests"))
    import processors
    from dstl.spark import StatefulStream, routing
    from route_driver import batch_df

    if a.route == routing.BROADCAST:
        routing.choose_route = lambda batch, route=None: routing.BROADCAST
    spark, jvm_pid = driver_session(a.master, f"dstl-scale-{a.route}", a.driver_memory)
    out = {"route": a.route, "seconds": [], "restored": [], "error": None}
    with tempfile.TemporaryDirectory(prefix="dstl-scale-") as base:
        stream = StatefulStream(base, processors.count_fn, processors.COUNT_OUTPUT, key="user",
                                parallelism=a.parallelism)
        try:
            for b in range(a.batches):
                res = stream.run(batch_df(spark, b, a.rows, a.keys, a.payload))
                assert res.route == a.route, res.route
                out["seconds"].append(round(res.seconds, 3))
                out["restored"].append(res.restored)
        except Exception as exc:  # noqa: BLE001 - a route that cannot run this batch is a result
            out["error"] = str(exc).strip().splitlines()[0][:300]
        finally:
            stream.close()
    out["driver_jvm_peak_mb"] = peak_mb(jvm_pid)
    out["driver_python_peak_mb"] = peak_mb(os.getpid())
    spark.stop()
    return out


def main(argv) -> int:
    p = argparse.ArgumentParser()
    p.add_argument("--master", default="local[2]")
    p.add_argument("--parallelism", type=int, default=2)
    p.add_argument("--rows", type=int, default=200_000)
    p.add_argument("--keys", type=int, default=100_000)
    p.add_argument("--payload", type=int, default=256)
    p.add_argument("--batches", type=int, default=4)
    p.add_argument("--driver-memory", default="1g")
    p.add_argument("--routes", default="shuffle,broadcast")
    p.add_argument("--route", help=argparse.SUPPRESS)       # the child's
    p.add_argument("--child-out", help=argparse.SUPPRESS)
    p.add_argument("--json")
    a = p.parse_args(argv)
    if a.route:
        with open(a.child_out, "w") as f:
            json.dump(one_route(a), f)
        return 0
    results = []
    for route in a.routes.split(","):
        with tempfile.NamedTemporaryFile(suffix=".json", delete=False) as tmp:
            child_out = tmp.name
        args = [a2 for a2 in argv if a2 != "--json" and a2 != a.json] + ["--route", route, "--child-out", child_out]
        subprocess.run([sys.executable, os.path.abspath(__file__), *args], env=child_env(), check=True,
                       stdout=subprocess.DEVNULL, stderr=subprocess.DEVNULL)
        with open(child_out) as f:
            r = json.load(f)
        os.unlink(child_out)
        later = r["seconds"][1:] or r["seconds"]
        r["median_s"] = round(statistics.median(later), 3) if later else None
        results.append(r)
        print(json.dumps(r), flush=True)
    load = loadavg().split()
    summary = {"config": {k: getattr(a, k) for k in ("master", "parallelism", "rows", "keys", "payload",
                                                    "batches", "driver_memory")},
               "load": load, "routes": results}
    print("load average", " ".join(load))
    if a.json:
        with open(a.json, "w") as f:
            json.dump(summary, f, indent=1)
    return 0


if __name__ == "__main__":
    sys.exit(main(sys.argv[1:]))
