"""`make cluster-demo`: the pipeline demo through `spark-submit` on a local Spark standalone cluster.

1. The executors' Python: a fresh virtual environment with the wheel `make dist` built, installed
   as docs/spark.md says (`pip install "dist/pyspark_dstl-*.whl[executor,s3]"`); kept under
   build/cluster-demo/ and reused while the wheel is unchanged.
2. A standalone master and two workers (1 core, 1 GB each) from pyspark's bin/spark-class on
   127.0.0.1 (tests/cluster_util.py).
3. `spark-submit --deploy-mode client` of dstl/app/pipeline.py from that environment, with --verify:
   exit 0 only when the state and every output row match pandas.
4. `spark-submit --deploy-mode cluster` of the same: Spark's standalone master does not run Python
   drivers (SparkSubmit refuses before anything starts); the demo checks that it is exactly that
   refusal and says so. YARN and Kubernetes run Python drivers in cluster mode (docs/spark.md).
5. Every process it started is stopped by PID, also on failure or Ctrl-C.

    python scripts/cluster_demo.py [--wheel dist/pyspark_dstl-...whl] [--events N] [--batches B] [--parallelism P]
"""
from __future__ import annotations

import argparse
import glob
import os
import shlex
import shutil
import subprocess
import sys
import time

HERE = os.path.dirname(os.path.abspath(__file__))
ROOT = os.path.dirname(HERE)
sys.path.insert(0, os.path.join(ROOT, "tests"))

from cluster_util import StandaloneCluster, spark_home  # noqa: E402

STANDALONE_PYTHON_CLUSTER_MODE = "Cluster deploy mode is currently not supported for python applications"


def executor_env(wheel: str, where: str) -> str:
    """A venv with the wheel and its executor extras; returns its python. Reused while the wheel's
    bytes are the same."""
    import hashlib

    py = os.path.join(where, "bin", "python")
    stamp = os.path.join(where, ".wheel-sha256")
    with open(wheel, "rb") as f:
        digest = hashlib.sha256(f.read()).hexdigest()
    if os.path.exists(stamp) and open(stamp).read() == digest and os.path.exists(py):
        return py
    shutil.rmtree(where, ignore_errors=True)
    subprocess.run([sys.executable, "-m", "venv", where], check=True)
    cmd = [os.path.join(where, "bin", "pip"), "install", "-q", f"{wheel}[executor,s3]"]
    print("$", " ".join(shlex.quote(c) for c in cmd), flush=True)
    subprocess.run(cmd, check=True)
    with open(stamp, "w") as f:
        f.write(digest)
    return py


def du_mb(path: str) -> float:
    total = 0
    for d, _, files in os.walk(path):
        for n in files:
            p = os.path.join(d, n)
            if not os.path.islink(p):
                total += os.path.getsize(p)
    return total / 2**20


def submit_argv(master: str, mode: str, python: str, pipeline: str, pipeline_args: list) -> list:
    """The spark-submit command line of docs/spark.md ("A real cluster"), for this cluster."""
    return [os.path.join(spark_home(), "bin", "spark-submit"), "--master", master, "--deploy-mode", mode,
            "--conf", f"spark.pyspark.python={python}",          # the executors' Python
            "--conf", f"spark.pyspark.driver.python={python}",   # client mode: else the driver takes the one above
            "--conf", "spark.speculation=false",
            "--conf", "spark.driver.host=127.0.0.1", "--conf", "spark.driver.bindAddress=127.0.0.1",
            pipeline, *pipeline_args]


def main(argv=None) -> int:
    p = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    p.add_argument("--wheel", default=None, help="the dstl wheel (default: the newest dist/pyspark_dstl-*.whl)")
    p.add_argument("--dir", default=os.path.join(ROOT, "build", "cluster-demo"))
    p.add_argument("--events", type=int, default=100_000)
    p.add_argument("--batches", type=int, default=6)
    p.add_argument("--parallelism", type=int, default=2)
    args = p.parse_args(argv)
    wheels = [args.wheel] if args.wheel else sorted(glob.glob(os.path.join(ROOT, "dist", "pyspark_dstl-*.whl")),
                                                    key=os.path.getmtime)
    if not wheels or not os.path.exists(wheels[-1]):
        print("cluster-demo: error: no dstl wheel; run `make dist` first", file=sys.stderr)
        return 2
    wheel = os.path.abspath(wheels[-1])
    os.makedirs(args.dir, exist_ok=True)
    t0 = time.monotonic()
    py = executor_env(wheel, os.path.join(args.dir, "executor-env"))
    print(f"cluster-demo: wheel {os.path.basename(wheel)} ({os.path.getsize(wheel) / 2**20:.1f} MiB); executor "
          f"environment {du_mb(os.path.join(args.dir, 'executor-env')):.0f} MiB on disk", flush=True)
    pipeline = subprocess.run([py, "-c", "import dstl.app.pipeline as p; print(p.__file__)"], check=True,
                              capture_output=True, text=True, cwd=args.dir).stdout.strip()
    run_dir = os.path.join(args.dir, "run")
    shutil.rmtree(run_dir, ignore_errors=True)
    os.makedirs(run_dir)
    cluster_root = os.path.join(args.dir, "cluster")
    shutil.rmtree(cluster_root, ignore_errors=True)
    env_clean = {"PYTHONPATH": None, "PYSPARK_PYTHON": None, "PYSPARK_DRIVER_PYTHON": None}
    with StandaloneCluster(cluster_root, workers=2, env=env_clean) as cluster:
        print(f"cluster-demo: standalone master {cluster.master_url}, {len(cluster.alive_workers())} workers "
              f"(1 core, 1 GB each), up in {time.monotonic() - t0:.0f} s", flush=True)
        env = cluster.driver_env()
        env.pop("PYSPARK_PYTHON", None)   # spark-submit's --conf decides
        # client mode: the driver runs here, the tasks on the two workers' executors
        pargs = ["--base-path", os.path.join(run_dir, "state"), "--output", os.path.join(run_dir, "output"),
                 "--events", str(args.events), "--batches", str(args.batches),
                 "--parallelism", str(args.parallelism), "--quiet", "--verify"]
        cmd = submit_argv(cluster.master_url, "client", py, pipeline, pargs)
        print("$", " ".join(shlex.quote(c) for c in cmd), flush=True)
        client = subprocess.run(cmd, env=env, cwd=args.dir, stdout=subprocess.PIPE, stderr=subprocess.PIPE,
                                text=True, timeout=1800)
        print(client.stdout, flush=True)
        if client.returncode != 0 or "verify           OK" not in client.stdout:
            print(f"cluster-demo: client mode FAILED (exit {client.returncode}):\n{client.stderr[-4000:]}",
                  file=sys.stderr)
            return 1
        # cluster mode: the standalone master would have to start a Python driver; Spark refuses
        cmd = submit_argv(cluster.master_url, "cluster", py, pipeline, pargs)
        print("$", " ".join(shlex.quote(c) for c in cmd), flush=True)
        refused = subprocess.run(cmd, env=env, cwd=args.dir, capture_output=True, text=True, timeout=300)
        if refused.returncode == 0 or STANDALONE_PYTHON_CLUSTER_MODE not in refused.stderr + refused.stdout:
            print(f"cluster-demo: cluster mode: unexpected result (exit {refused.returncode}):\n"
                  f"{(refused.stdout + refused.stderr)[-4000:]}", file=sys.stderr)
            return 1
        print(f"cluster-demo: cluster deploy mode: Spark refuses it on a standalone master for Python "
              f"applications (\"{STANDALONE_PYTHON_CLUSTER_MODE} on standalone clusters\"); on YARN and "
              f"Kubernetes the same command runs with --deploy-mode cluster (docs/spark.md)", flush=True)
    print(f"cluster-demo: OK in {time.monotonic() - t0:.0f} s; every cluster process stopped", flush=True)
    return 0


if __name__ == "__main__":
    sys.exit(main())
