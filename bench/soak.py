"""`make soak`: a long file-source StatefulStream with failures in between, to show that it stays flat.

A Structured Streaming driver (a child process with its own local[2,4] Spark) runs one JSON file per
micro-batch through `StatefulStream` at parallelism 2 (retain=2), over `--keys` distinct keys. Along
the way this orchestrator SIGKILLs Python workers (Spark retries the task, the subtask restores from
the checkpoint), the upload service (the next task starts a new one) and once the driver itself
(a new driver resumes from the Spark and dstl checkpoints). Every `--every` batches it samples:
driver (Python and JVM) and worker RSS, their open file descriptors, our /dev/shm segments, and the
files under the base path. At the end the committed output is compared with a pandas recomputation
over all input, and the samples are charted (`soak.png`) and written (`soak.json`).

    python bench/soak.py [--batches 320] [--keys 50000] [--events-per-batch 2000] [--out DIR]
    python bench/soak.py --smoke          # a few batches, one kill of each kind: a quick check

Pass criteria (exit 1 otherwise): exact output; files under the base path bounded (the maximum in
the second half of the run is at most 1.5x the maximum in the first half); driver (Python and JVM) and worker RSS
after the warm-up (the first quarter of the samples) grow by less than 10%.
"""
from __future__ import annotations

import argparse
import json
import os
import signal
import subprocess
import sys
import tempfile
import time
from typing import Dict, List, Optional

ROOT = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))
sys.path.insert(0, ROOT)
sys.path.insert(0, os.path.dirname(os.path.abspath(__file__)))

INPUT_DDL = "user string, amount long"
OUTPUT_DDL = "user string, events long, total long"


# ------------------------------------------------------------------ input and the expected output

def write_inputs(input_dir: str, batches: int, per_batch: int, keys: int, seed: int = 11) -> None:
    import numpy as np

    os.makedirs(input_dir, exist_ok=True)
    rng = np.random.default_rng(seed)
    for b in range(batches):
        users = rng.integers(0, keys, per_batch)
        amounts = rng.integers(1, 100, per_batch)
        path = os.path.join(input_dir, f"events-{b:05d}.json")
        with open(path, "w") as f:
            f.writelines(f'{{"user": "u{u}", "amount": {a}}}\n' for u, a in zip(users.tolist(), amounts.tolist()))
        os.utime(path, (1_700_000_000 + b, 1_700_000_000 + b))  # file order = batch order


def expected_output(input_dir: str, batches: int):
    """(batch_id, user, events, total) after each batch, for the users of that batch (pandas)."""
    import pandas as pd

    frames = []
    running: Dict[str, list] = {}
    for b in range(batches):
        pdf = pd.read_json(os.path.join(input_dir, f"events-{b:05d}.json"), lines=True)
        agg = pdf.groupby("user")["amount"].agg(["size", "sum"])
        rows = []
        for user, (n, s) in agg.iterrows():
            cur = running.setdefault(user, [0, 0])
            cur[0] += int(n)
            cur[1] += int(s)
            rows.append((b, user, cur[0], cur[1]))
        frames.append(pd.DataFrame(rows, columns=["batch_id", "user", "events", "total"]))
    return pd.concat(frames, ignore_index=True).sort_values(["batch_id", "user"]).reset_index(drop=True)


def read_output(output_dir: str):
    import pyarrow.dataset as ds

    got = ds.dataset(output_dir, format="parquet", partitioning="hive").to_table().to_pandas()
    got = got[["batch_id", "user", "events", "total"]].astype({"batch_id": "int64", "events": "int64",
                                                                "total": "int64"})
    return got.sort_values(["batch_id", "user"]).reset_index(drop=True)


# ------------------------------------------------------------------ the driver (child process)

def _totals(rows, state):
    """Vectorised: per user, events and amount so far (one value state holding [events, total])."""
    import pandas as pd

    agg = rows.groupby("user")["amount"].agg(["size", "sum"])
    st = state.value_state("totals")
    old = st.get_many(agg.index.tolist(), None)
    events = [int(n) + (o[0] if o else 0) for n, o in zip(agg["size"].tolist(), old)]
    total = [int(s) + (o[1] if o else 0) for s, o in zip(agg["sum"].tolist(), old)]
    st.update_many(agg.index.tolist(), [[e, t] for e, t in zip(events, total)])
    return pd.DataFrame({"user": agg.index.tolist(), "events": events, "total": total})


def driver(base: str, input_dir: str, ckpt: str, progress: str, materialize_every: str = "") -> int:
    os.environ.setdefault("PYSPARK_PYTHON", sys.executable)
    from pyspark.sql import SparkSession

    from dstl.spark import StatefulStream
    from dstl.tools.stream_demo import run_file_stream

    builder = SparkSession.builder
    heap = os.environ.get("SOAK_DRIVER_HEAP")
    if heap:  # a heap committed and touched at start: RSS growth after that is not the heap filling up
        builder = builder.config("spark.driver.memory", heap).config(
            "spark.driver.extraJavaOptions", f"-Xms{heap} -XX:+AlwaysPreTouch")
    spark = (builder.master("local[2,4]").appName("dstl-soak")
             .config("spark.ui.enabled", "false").config("spark.ui.showConsoleProgress", "false")
             .config("spark.driver.host", "127.0.0.1").config("spark.driver.bindAddress", "127.0.0.1")
             .config("spark.sql.shuffle.partitions", "2").config("spark.task.maxFailures", "4").getOrCreate())
    spark.sparkContext.setLogLevel("ERROR")
    extra = {"materialize_every": int(materialize_every)} if materialize_every else {}
    stream = StatefulStream(base, _totals, OUTPUT_DDL, key="user", parallelism=2, retain=2,
                            options={"upload.timeout": "10 s"}, **extra)

    def each_batch(df, batch_id):
        res = stream(df, batch_id)
        with open(progress, "a") as f:
            f.write(json.dumps({"batch": batch_id, "seconds": round(res.seconds, 3), "replayed": res.replayed,
                                "restored": res.restored, "t": time.time()}) + "\n")

    run_file_stream(spark, each_batch, INPUT_DDL, input_dir, ckpt)
    stream.close()
    spark.stop()
    return 0


# ------------------------------------------------------------------ processes and samples

from _soak_common import children as _children, cmdline as _cmdline, fds as _fds, kill_group as _kill_group  # noqa: E402
from _soak_common import rss_mb as _rss_mb  # noqa: E402


class Tree:
    """The driver's processes by role: its Python, its JVM, Spark's Python workers, upload services."""

    def __init__(self, driver_pid: int, runtime: str):
        self.driver = driver_pid
        self.runtime = runtime

    def roles(self) -> Dict[str, List[int]]:
        kids = _children(self.driver)
        jvm = [p for p in kids if "java" in _cmdline(p).split(" ")[0]]
        workers = [p for p in kids if "pyspark.daemon" in _cmdline(p) or "pyspark.worker" in _cmdline(p)]
        return {"driver": [self.driver], "jvm": jvm, "workers": workers, "services": self.services()}

    def services(self) -> List[int]:
        from dstl.changelog.upload.service.runtime import ServicePaths, pid_alive

        out = []
        if os.path.isdir(self.runtime):
            for d in os.listdir(self.runtime):
                pid = ServicePaths(os.path.join(self.runtime, d)).read_pid()
                if pid and pid_alive(pid):
                    out.append(pid)
        return out

    def task_workers(self) -> List[int]:
        """Forked Python workers (children of a pyspark daemon): the ones that run tasks."""
        daemons = [p for p in self.roles()["workers"] if "pyspark.daemon" in _cmdline(p)]
        return [c for d in daemons for c in _children(d)]


def _segments(pids) -> int:
    from dstl.changelog.upload.service import shm

    n = 0
    for name in shm.list_segments():
        owner = shm.parse_name(name)
        if owner is not None and (owner[0] in pids or owner[1] in pids):
            n += 1
    return n


def _files(base: str) -> int:
    """Files of the state (checkpoints, changelog, job and lease files): everything under the base
    path except the committed output, which grows by design (one folder per batch)."""
    out = os.path.join(base, "output")
    return sum(len(files) for d, _, files in os.walk(base) if not (d == out or d.startswith(out + os.sep)))


def sample(tree: Tree, base: str, batch: int) -> dict:
    r = tree.roles()
    everything = set(p for ps in r.values() for p in ps)
    everything |= set(c for s in r["services"] for c in _children(s))
    return {"batch": batch, "t": time.time(),
            "driver_rss_mb": _rss_mb(r["driver"]), "jvm_rss_mb": _rss_mb(r["jvm"]),
            "worker_rss_mb": _rss_mb(r["workers"] + [c for w in r["workers"] for c in _children(w)]),
            "service_rss_mb": _rss_mb(r["services"] + [c for s in r["services"] for c in _children(s)]),
            "driver_fds": _fds(r["driver"] + r["jvm"]),
            "worker_fds": _fds(r["workers"] + [c for w in r["workers"] for c in _children(w)]),
            "shm_segments": _segments(everything), "base_files": _files(base)}


# ------------------------------------------------------------------ the run

def _last_batch(progress: str) -> int:
    try:
        with open(progress) as f:
            lines = f.read().splitlines()
    except FileNotFoundError:
        return -1
    return max((json.loads(x)["batch"] for x in lines if x.strip()), default=-1)


def _start_driver(base, inputs, ckpt, progress, log_path, env, materialize_every=None) -> subprocess.Popen:
    log = open(log_path, "ab")
    extra = [str(materialize_every)] if materialize_every else []
    return subprocess.Popen([sys.executable, os.path.abspath(__file__), "--driver", base, inputs, ckpt, progress,
                             *extra], env=env, stdout=log, stderr=log, start_new_session=True)


def schedule(batches: int, smoke: bool) -> Dict[int, str]:
    if smoke:
        return {2: "worker", 4: "service", 6: "driver"}
    at = {}
    for i, frac in enumerate((0.12, 0.28, 0.44, 0.6, 0.76)):
        at[int(batches * frac)] = "worker"
    at[int(batches * 0.2)] = "service"
    at[int(batches * 0.68)] = "service"
    at[int(batches * 0.36)] = "driver"
    return at


def run(args) -> int:
    out = os.path.abspath(args.out or tempfile.mkdtemp(prefix="dstl-soak-"))
    os.makedirs(out, exist_ok=True)
    base, inputs, ckpt = (os.path.join(out, n) for n in ("state", "input", "spark-checkpoint"))
    progress, log_path = os.path.join(out, "progress.jsonl"), os.path.join(out, "driver.log")
    runtime = os.path.join(out, "rt")
    os.makedirs(runtime, exist_ok=True)
    env = dict(os.environ, DSTL_RUNTIME_DIR=runtime, SOAK_DRIVER_HEAP=args.driver_heap,
               PYTHONPATH=os.pathsep.join([ROOT] + [p for p in os.environ.get("PYTHONPATH", "").split(os.pathsep) if p]))
    print(f"soak: writing {args.batches} input files ({args.events_per_batch} events each, {args.keys} keys) "
          f"to {inputs}", flush=True)
    write_inputs(inputs, args.batches, args.events_per_batch, args.keys)
    kills = schedule(args.batches, args.smoke)
    done_kills: List[dict] = []
    samples: List[dict] = []
    t0 = time.time()
    proc = _start_driver(base, inputs, ckpt, progress, log_path, env, args.materialize_every)
    tree = Tree(proc.pid, runtime)
    next_sample = 0
    try:
        while True:
            batch = _last_batch(progress)
            if batch >= next_sample:
                samples.append(sample(tree, base, batch))
                s = samples[-1]
                print(f"  batch {batch:4d}  {time.time() - t0:6.0f} s  driver {s['driver_rss_mb']:.0f} MB  "
                      f"jvm {s['jvm_rss_mb']:.0f} MB  workers {s['worker_rss_mb']:.0f} MB  fds "
                      f"{s['driver_fds']}/{s['worker_fds']}  shm {s['shm_segments']}  files {s['base_files']}",
                      flush=True)
                next_sample = (batch // args.every + 1) * args.every
            due = [b for b in sorted(kills) if b <= batch and b not in {k["at"] for k in done_kills}]
            if due:
                what = kills[due[0]]
                victim = None
                if what == "worker":
                    ws = tree.task_workers()
                    victim = ws[0] if ws else None
                elif what == "service":
                    ss = tree.services()
                    victim = ss[0] if ss else None
                if what == "driver":
                    _kill_group(proc)
                    proc = _start_driver(base, inputs, ckpt, progress, log_path, env, args.materialize_every)
                    tree = Tree(proc.pid, runtime)
                    done_kills.append({"at": due[0], "what": what, "pid": None, "batch": batch})
                elif victim is not None:
                    os.kill(victim, signal.SIGKILL)
                    done_kills.append({"at": due[0], "what": what, "pid": victim, "batch": batch})
                if what == "driver" or victim is not None:  # no victim yet: tried again next poll
                    print(f"  SIGKILL {what} at batch {batch}" + (f" (pid {victim})" if victim else ""), flush=True)
            rc = proc.poll()
            if rc is not None:
                if rc != 0:
                    print(f"soak: the driver exited {rc}; see {log_path}", file=sys.stderr)
                    return 1
                break
            if time.time() - t0 > args.timeout:
                print(f"soak: not finished after {args.timeout} s (at batch {batch})", file=sys.stderr)
                _kill_group(proc)
                return 1
            time.sleep(0.5)
    finally:
        if proc.poll() is None:
            _kill_group(proc)
        from dstl.changelog.upload.service.runtime import ServicePaths

        for d in os.listdir(runtime) if os.path.isdir(runtime) else []:
            pid = ServicePaths(os.path.join(runtime, d)).read_pid()
            if pid and "dstl.changelog.upload.service.server" in _cmdline(pid):
                for p in [pid] + _children(pid):
                    try:
                        os.kill(p, signal.SIGKILL)
                    except ProcessLookupError:
                        pass
    samples.append(sample(Tree(os.getpid(), runtime), base, _last_batch(progress)) | {"after": True})
    elapsed = time.time() - t0
    import pandas as pd

    got = read_output(os.path.join(base, "output"))
    want = expected_output(inputs, args.batches)
    try:
        pd.testing.assert_frame_equal(got, want, check_dtype=False)
        exact = True
    except AssertionError as exc:
        print(f"soak: output differs from pandas: {exc}", file=sys.stderr)
        exact = False
    running = [s for s in samples if not s.get("after")]
    result = verdict(running, exact, args.smoke)
    result.update(batches=args.batches, keys=args.keys, events_per_batch=args.events_per_batch,
                  materialize_every=args.materialize_every,
                  seconds=round(elapsed, 1), kills=done_kills, loadavg=open("/proc/loadavg").read().split()[:3],
                  rows=len(got))
    with open(os.path.join(out, "soak.json"), "w") as f:
        json.dump({"result": result, "samples": samples}, f, indent=1)
    chart(samples, done_kills, os.path.join(out, "soak.png"))
    if args.results:  # the chart and the figures, without the run's input and state
        import shutil

        os.makedirs(args.results, exist_ok=True)
        for name in ("soak.json", "soak.png"):
            if os.path.exists(os.path.join(out, name)):
                shutil.copy(os.path.join(out, name), os.path.join(args.results, name))
    print(json.dumps(result, indent=1))
    print(f"soak: {'PASS' if result['pass'] else 'FAIL'}; chart {os.path.join(out, 'soak.png')}", flush=True)
    return 0 if result["pass"] else 1


def verdict(samples: List[dict], exact: bool, smoke: bool = False) -> dict:
    """Smoke runs are too short for the flatness criteria: only exactness counts there."""
    n = len(samples)
    warm = samples[max(1, n // 4):] if n >= 4 else samples
    out = {"exact": exact, "samples": n}
    for key in ("driver_rss_mb", "worker_rss_mb", "jvm_rss_mb"):
        vals = [s[key] for s in warm if s[key] > 0]
        if len(vals) >= 2:
            out[f"{key}_growth"] = round(max(vals[-3:]) / vals[0] - 1, 3) if vals[0] else None
    half = n // 2
    files_first = max((s["base_files"] for s in samples[:half]), default=0)
    files_second = max((s["base_files"] for s in samples[half:]), default=0)
    out.update(files_max_first_half=files_first, files_max_second_half=files_second,
               shm_max=max((s["shm_segments"] for s in samples), default=0))
    bounded = files_second <= max(1.5 * files_first, files_first + 10)
    # the JVM too: its heap is fixed and pre-touched (--driver-heap), so growth is not lazy heap
    rss_ok = all((out.get(f"{k}_growth") or 0) < 0.10 for k in ("driver_rss_mb", "worker_rss_mb", "jvm_rss_mb"))
    out["files_bounded"] = bounded
    out["rss_ok"] = rss_ok
    out["pass"] = bool(exact and (smoke or (bounded and rss_ok)))
    return out


def chart(samples: List[dict], kills: List[dict], path: str) -> None:
    try:
        import matplotlib

        matplotlib.use("Agg")
        import matplotlib.pyplot as plt
    except ImportError:
        print("soak: matplotlib missing (pip install -e .[bench]); no chart", file=sys.stderr)
        return
    s = [x for x in samples if not x.get("after")]
    b = [x["batch"] for x in s]
    fig, axes = plt.subplots(2, 2, figsize=(11, 7), sharex=True)
    panels = [("RSS (MB)", ["driver_rss_mb", "jvm_rss_mb", "worker_rss_mb", "service_rss_mb"]),
              ("open file descriptors", ["driver_fds", "worker_fds"]),
              ("/dev/shm segments", ["shm_segments"]),
              ("state files under the base path (output excluded)", ["base_files"])]
    for ax, (title, keys) in zip(axes.flat, panels):
        for k in keys:
            ax.plot(b, [x[k] for x in s], marker=".", label=k.replace("_mb", "").replace("_", " "))
        for k in kills:
            ax.axvline(k["batch"], color={"worker": "orange", "service": "purple", "driver": "red"}[k["what"]],
                       alpha=0.4, lw=1)
        ax.set_title(title)
        ax.legend(fontsize=7)
    for ax in axes[1]:
        ax.set_xlabel("micro-batch (vertical lines: SIGKILL of a worker / service / driver)")
    fig.tight_layout()
    fig.savefig(path, dpi=90)


def main(argv: Optional[List[str]] = None) -> int:
    argv = sys.argv[1:] if argv is None else argv
    if argv[:1] == ["--driver"]:
        return driver(*argv[1:6])
    p = argparse.ArgumentParser(prog="bench/soak.py", description=__doc__.split("\n\n")[0])
    p.add_argument("--batches", type=int, default=320)
    p.add_argument("--keys", type=int, default=50_000)
    p.add_argument("--events-per-batch", type=int, default=2_000)
    p.add_argument("--every", type=int, default=10, help="sample every N batches")
    p.add_argument("--materialize-every", type=int, default=20_000,
                   help="changes logged per subtask before a compact snapshot (StatefulStream's "
                        "materialize_every; 0 = its default, 1,000,000). Without a materialization the "
                        "changelog a checkpoint references grows with every batch")
    p.add_argument("--out", default=None, help="working directory (default: a new temporary one)")
    p.add_argument("--results", default=None, help="copy soak.json and soak.png here (make soak: bench/results)")
    p.add_argument("--timeout", type=float, default=3600.0, help="give up after this many seconds")
    p.add_argument("--smoke", action="store_true", help="8 batches, one kill of each kind")
    p.add_argument("--driver-heap", default="1g",
                   help="the driver JVM's heap, fixed (-Xms = -Xmx, pre-touched) so that its RSS can only grow "
                        "outside the heap; '' leaves Spark's lazily growing default")
    args = p.parse_args(argv)
    if args.smoke:
        args.batches, args.keys, args.events_per_batch, args.every = 8, 500, 200, 1
    return run(args)


if __name__ == "__main__":
    sys.exit(main())
