"""`make soak-scale`: a long StatefulStream on a local-cluster, with its state on S3 behind a store that
throttles and once goes away, through executor kills and a driver kill, to show that it stays exact,
flat and bounded.

Everything runs on 127.0.0.1 and is stopped by PID at the end, also on failure: moto's S3 server (a
process of its own), tests/s3proxy.py in front of it (the fault-injecting proxy), and the driver (a
child process, its own session: its JVM, the `local-cluster[2,1,MB]` executors and their Python
workers). The slot processes, which leave the driver's session, carry a tag in their environment and
are found by it.

The driver runs one JSON file per micro-batch (Structured Streaming, file source, Spark checkpoint on
local disk) through `StatefulStream` at parallelism 2 (vectorised count and sum per user, one value
state, `retain=2`), base path `s3://<bucket>/job` reached only through the proxy. Batch 0 holds every
one of `--keys` users once (the state has all its keys from then on); each later batch
`--events-per-batch` events of random users. Along the way:

* 10% of requests are answered 503 SlowDown by the proxy, throughout (`--throttle`);
* 3 executor kills: `task.mid_batch@B/S=kill-executor` (dstl.spark.faults), the executor JVM of
  subtask S SIGKILLed half-way through batch B; Spark retries the task elsewhere, which restores;
* 1 driver kill: the harness SIGKILLs the driver's process group a moment into a batch and starts a
  new driver, which resumes from Spark's and dstl's checkpoints;
* 1 store outage of `--outage-s` (60) seconds a moment into a batch: the proxy resets every
  connection; the batch fails (the driver exits with the error), and once the store is back the
  harness starts a new driver, which resumes from the last checkpoint.

After every batch it samples the RSS of the driver's Python and JVM, of the executor JVMs and of the
slot processes (their pids come from the batch's task reports), and the count and bytes of the
state's objects on the bucket (the committed output excluded: it grows by design). At the end the
committed output is compared with a pandas recomputation over all input; figures go to
`soak_scale.json` and a chart to `soak_scale.png` (`--results DIR` copies both there).

    python bench/soak_scale.py [--batches 160] [--keys 1000000] [--events-per-batch 4000] [--results DIR]
    python bench/soak_scale.py --smoke     # 10 batches, 20,000 keys, one of each fault: a quick check

Pass (exit 0) when: the output is exact; each planned fault happened (the outage's batch failed);
the state's objects on the bucket are bounded (the maximum count in the second half at most 1.5x the
first half's); and RSS after the warm-up (the first quarter of the batches) grows by less than 10%
per role (the last three samples' maximum against the first sample after the warm-up).
"""
from __future__ import annotations

import argparse
import json
import os
import shutil
import signal
import socket
import subprocess
import sys
import tempfile
import time
import uuid
from typing import Dict, List, Optional

HERE = os.path.dirname(os.path.abspath(__file__))
ROOT = os.path.dirname(HERE)
TESTS = os.path.join(ROOT, "tests")
for _p in (ROOT, HERE, TESTS):
    if _p not in sys.path:
        sys.path.insert(0, _p)

from _soak_common import children, cmdline, kill_group, loadavg, read_progress, rss_mb  # noqa: E402

INPUT_DDL = "user string, amount long"
OUTPUT_DDL = "user string, events long, total long"
TAG_ENV = "DSTL_SOAK_SCALE_TAG"
BUCKET = "dstl-soak-scale"


# ------------------------------------------------------------------ input and the expected output

def write_inputs(input_dir: str, batches: int, per_batch: int, keys: int, seed: int = 34) -> None:
    """Batch 0: every user once; batches 1..: `per_batch` events of random users."""
    import numpy as np

    os.makedirs(input_dir, exist_ok=True)
    rng = np.random.default_rng(seed)
    for b in range(batches):
        users = rng.permutation(keys) if b == 0 else rng.integers(0, keys, per_batch)
        amounts = rng.integers(1, 100, len(users))
        path = os.path.join(input_dir, f"events-{b:05d}.json")
        with open(path, "w") as f:
            f.writelines(f'{{"user":"u{u}","amount":{a}}}\n' for u, a in zip(users.tolist(), amounts.tolist()))
        os.utime(path, (1_700_000_000 + b, 1_700_000_000 + b))  # file order = batch order


def expected_output(input_dir: str, batches: int):
    """(batch_id, user, events, total) after each batch, for the users of that batch (pandas)."""
    import pandas as pd

    per = []
    for b in range(batches):
        pdf = pd.read_json(os.path.join(input_dir, f"events-{b:05d}.json"), lines=True, dtype={"user": str})
        agg = pdf.groupby("user")["amount"].agg(events="size", total="sum").reset_index()
        agg["batch_id"] = b
        per.append(agg)
    allb = pd.concat(per, ignore_index=True).sort_values(["batch_id", "user"], kind="stable")
    allb[["events", "total"]] = allb.groupby("user")[["events", "total"]].cumsum()
    allb = allb[["batch_id", "user", "events", "total"]].astype({"batch_id": "int64", "events": "int64",
                                                                  "total": "int64"})
    return allb.sort_values(["batch_id", "user"]).reset_index(drop=True)


def read_output(fs, root: str):
    import pyarrow.dataset as ds

    fs.invalidate_cache()
    got = ds.dataset(root, filesystem=fs, format="parquet", partitioning="hive").to_table().to_pandas()
    got = got[["batch_id", "user", "events", "total"]].astype({"batch_id": "int64", "events": "int64",
                                                                "total": "int64"})
    return got.sort_values(["batch_id", "user"]).reset_index(drop=True)


# ------------------------------------------------------------------ the driver (child process)

def _counts(rows, state):
    """Vectorised: per user, events and amount so far (one value state holding [events, total])."""
    import numpy as np
    import pandas as pd

    agg = rows.groupby("user")["amount"].agg(["size", "sum"])
    users = agg.index.tolist()
    st = state.value_state("totals")
    old = st.get_many(users, None)
    prev = np.array([o if o else (0, 0) for o in old], dtype=np.int64).reshape(-1, 2)
    events = agg["size"].to_numpy(np.int64) + prev[:, 0]
    total = agg["sum"].to_numpy(np.int64) + prev[:, 1]
    st.update_many(users, np.stack([events, total], axis=1).tolist())
    return pd.DataFrame({"user": users, "events": events, "total": total})


def driver(base: str, input_dir: str, ckpt: str, progress: str, settings: str) -> int:
    cfg = json.loads(settings)
    os.environ.setdefault("PYSPARK_PYTHON", sys.executable)
    from pyspark.sql import SparkSession

    from dstl.spark import StatefulStream
    from dstl.tools.stream_demo import run_file_stream

    heap, ex_heap = cfg["driver_heap"], cfg["executor_heap"]
    # heaps committed and touched at start: RSS growth after that is not a heap filling up
    spark = (SparkSession.builder.master(f"local-cluster[2,1,{cfg['worker_mb']}]").appName("dstl-soak-scale")
             .config("spark.driver.memory", heap)
             .config("spark.driver.extraJavaOptions", f"-Xms{heap} -XX:+AlwaysPreTouch")
             .config("spark.executor.memory", ex_heap)
             .config("spark.executor.extraJavaOptions", f"-Xms{ex_heap} -XX:+AlwaysPreTouch")
             .config("spark.ui.enabled", "false").config("spark.ui.showConsoleProgress", "false")
             .config("spark.driver.host", "127.0.0.1").config("spark.driver.bindAddress", "127.0.0.1")
             .config("spark.sql.shuffle.partitions", "2")
             # two attempts: an executor kill costs one; the store outage then fails the batch
             # instead of outlasting the outage in further attempts (docs/semantics.md §14)
             .config("spark.task.maxFailures", "2")
             .config("spark.locality.wait", "30s")   # docs/spark.md: above the longest task
             .config("spark.executorEnv." + TAG_ENV, os.environ.get(TAG_ENV, ""))
             .getOrCreate())
    spark.sparkContext.setLogLevel("ERROR")
    stream = StatefulStream(base, _counts, OUTPUT_DDL, key="user", parallelism=2, retain=2,
                            materialize_every=cfg["materialize_every"],
                            options={"upload.timeout": "10 s"})

    def each_batch(df, batch_id):
        with open(progress, "a") as f:
            f.write(json.dumps({"phase": "start", "batch": batch_id, "pid": os.getpid(), "t": time.time()}) + "\n")
        res = stream(df, batch_id)
        reps = [{"subtask": r.subtask, "attempt": r.attempt, "pid": r.pid, "executor": r.executor,
                 "restored": r.restored, "continued": r.continued, "restore_source": r.restore_source,
                 "restore_ms": round(r.restore_ms, 1)} for r in res.reports]
        with open(progress, "a") as f:
            f.write(json.dumps({"phase": "done", "batch": batch_id, "pid": os.getpid(),
                                "seconds": round(res.seconds, 3), "replayed": res.replayed,
                                "restored": res.restored, "reports": reps, "t": time.time()}) + "\n")

    run_file_stream(spark, each_batch, INPUT_DDL, input_dir, ckpt)
    stream.close()
    spark.stop()
    return 0


# ------------------------------------------------------------------ the store: moto and the proxy

def _free_port() -> int:
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return s.getsockname()[1]


class Moto:
    """moto's S3 server as a process of its own on 127.0.0.1, stopped by PID."""

    def __init__(self, log_path: str):
        self.port = _free_port()
        self.endpoint = f"http://127.0.0.1:{self.port}"
        with open(log_path, "ab") as log:
            self.proc = subprocess.Popen([sys.executable, "-m", "moto.server", "-H", "127.0.0.1", "-p",
                                          str(self.port)], stdout=log, stderr=log, stdin=subprocess.DEVNULL,
                                         start_new_session=True)
        deadline = time.monotonic() + 60
        while True:
            try:
                with socket.create_connection(("127.0.0.1", self.port), timeout=1):
                    break
            except OSError:
                if self.proc.poll() is not None or time.monotonic() > deadline:
                    self.stop()
                    raise RuntimeError(f"moto's S3 server did not start (see {log_path})")
                time.sleep(0.2)

    def fs(self):
        import s3fs

        return s3fs.S3FileSystem(key="testing", secret="testing", skip_instance_cache=True,
                                 client_kwargs={"endpoint_url": self.endpoint})

    def rss_mb(self) -> float:
        return rss_mb([self.proc.pid])

    def stop(self) -> None:
        from cluster_util import stop_pids

        if self.proc.poll() is None:
            stop_pids([self.proc.pid])
        self.proc.wait(10)


def bucket_objects(fs, root: str) -> Dict[str, float]:
    """Objects of the state under `root` (checkpoints, changelog, job files; output excluded)."""
    fs.invalidate_cache()
    try:
        found = fs.find(root, detail=True)
    except FileNotFoundError:
        found = {}
    out = f"{root}/output/"
    state = [v for k, v in found.items() if not k.startswith(out)]
    return {"objects": len(state), "mb": round(sum(v.get("size", 0) for v in state) / 2**20, 2),
            "output_objects": len(found) - len(state)}


# ------------------------------------------------------------------ the run

def schedule(batches: int, smoke: bool) -> Dict[str, object]:
    """When each fault happens: executor kills (batch, subtask), the driver kill's and the outage's batch."""
    if smoke:
        return {"executor": [(2, 0), (3, 1), (5, 0)], "driver": 4, "outage": 7}
    return {"executor": [(int(batches * 0.3), 0), (int(batches * 0.45), 1), (int(batches * 0.7), 0)],
            "driver": int(batches * 0.55), "outage": int(batches * 0.75)}


class Run:
    def __init__(self, args):
        self.args = args
        self.out = os.path.abspath(args.out or tempfile.mkdtemp(prefix="dstl-soak-scale-"))
        os.makedirs(self.out, exist_ok=True)
        self.inputs, self.ckpt = (os.path.join(self.out, n) for n in ("input", "spark-checkpoint"))
        self.progress = os.path.join(self.out, "progress.jsonl")
        self.log_path = os.path.join(self.out, "driver.log")
        self.runtime = os.path.join(self.out, "rt")
        self.markers = os.path.join(self.out, "markers")
        for d in (self.runtime, self.markers):
            os.makedirs(d, exist_ok=True)
        self.tag = uuid.uuid4().hex
        self.plan = schedule(args.batches, args.smoke)
        self.events: List[dict] = []
        self.samples: List[dict] = []
        self.slot_pids: Dict[int, int] = {}  # slot pid -> subtask, as the latest report said
        self.proc: Optional[subprocess.Popen] = None
        self.completed = 0  # batches completed when --timeout stopped the run
        self.moto: Optional[Moto] = None
        self.proxy = None

    # -------------------------------------------------------- processes
    def env(self) -> Dict[str, str]:
        faults = ",".join(f"task.mid_batch@{b}/{s}=kill-executor:once={self.markers}/exec-{b}-{s}"
                          for b, s in self.plan["executor"])
        pp = [ROOT] + [p for p in os.environ.get("PYTHONPATH", "").split(os.pathsep) if p]
        return dict(os.environ, DSTL_RUNTIME_DIR=self.runtime, DSTL_FAULTS=faults,
                    **{TAG_ENV: self.tag}, PYTHONPATH=os.pathsep.join(pp), PYSPARK_PYTHON=sys.executable,
                    SPARK_LOCAL_IP="127.0.0.1", AWS_ENDPOINT_URL=self.proxy.endpoint,
                    AWS_ACCESS_KEY_ID="testing", AWS_SECRET_ACCESS_KEY="testing", AWS_DEFAULT_REGION="us-east-1")

    def start_driver(self) -> None:
        a = self.args
        settings = json.dumps({"driver_heap": a.driver_heap, "executor_heap": a.executor_heap,
                               "worker_mb": a.worker_mb, "materialize_every": a.materialize_every})
        with open(self.log_path, "ab") as log:
            log.write(f"\n===== driver started {time.strftime('%H:%M:%S')} =====\n".encode())
            log.flush()
            self.proc = subprocess.Popen(
                [sys.executable, os.path.abspath(__file__), "--driver", f"s3://{BUCKET}/job", self.inputs,
                 self.ckpt, self.progress, settings], env=self.env(), stdout=log, stderr=log,
                stdin=subprocess.DEVNULL, start_new_session=True)

    def roles(self) -> Dict[str, List[int]]:
        if self.proc is None or self.proc.poll() is not None:
            return {"driver_py": [], "driver_jvm": [], "executors": [], "slots": []}
        kids = children(self.proc.pid)
        jvm = [p for p in kids if "java" in cmdline(p).split(" ")[0]]
        execs = [p for p in kids if "CoarseGrainedExecutorBackend" in cmdline(p)]
        jvm = [p for p in jvm if p not in execs]
        slots = [p for p in self.slot_pids if "dstl" in cmdline(p)]
        return {"driver_py": [self.proc.pid], "driver_jvm": jvm, "executors": execs, "slots": slots}

    def stop_everything(self) -> None:
        """The driver's group, then whatever carries our tag (slots, Python workers, executors)."""
        from cluster_util import stop_pids, tagged_pids

        if self.proc is not None and self.proc.poll() is None:
            kill_group(self.proc)
        for _ in range(3):
            left = [p for p in tagged_pids(self.tag) if p != os.getpid()]
            if not left:
                break
            stop_pids(left, grace_s=5.0)

    # -------------------------------------------------------- samples
    def sample(self, batch: int, fs) -> dict:
        r = self.roles()
        s = {"batch": batch, "t": round(time.time() - self.t0, 1), "load1": float(loadavg()[0]),
             **{f"{k}_mb": round(rss_mb(v), 1) for k, v in r.items()},
             "executor_count": len(r["executors"]), "slot_count": len(r["slots"]),
             "moto_mb": round(self.moto.rss_mb(), 1)}
        s.update(bucket_objects(fs, f"{BUCKET}/job"))
        self.samples.append(s)
        return s

    def note(self, what: str, batch: int, **extra) -> None:
        e = {"what": what, "batch": batch, "t": round(time.time() - self.t0, 1), **extra}
        self.events.append(e)
        print(f"  [{e['t']:6.0f} s] {what} at batch {batch} {extra if extra else ''}", flush=True)

    # -------------------------------------------------------- the loop
    def run(self) -> int:
        from s3proxy import ProxyProcess

        a = self.args
        print(f"soak-scale: {a.batches} batches, {a.keys} keys, {a.events_per_batch} events a batch; "
              f"plan {self.plan}; working in {self.out}", flush=True)
        write_inputs(self.inputs, a.batches, a.events_per_batch, a.keys)
        self.t0 = time.time()
        try:
            self.moto = Moto(os.path.join(self.out, "moto.log"))
            fs = self.moto.fs()
            fs.mkdir(BUCKET)
            self.proxy = ProxyProcess(self.moto.endpoint, self.out)
            self.throttle = dict(error_rate=a.throttle, error_codes=[503], seed=1)
            self.proxy.set(**self.throttle)
            ok = self.loop(fs)
            self.stop_everything()
            return self.finish(fs, ok)
        finally:
            self.stop_everything()
            if self.proxy is not None:
                self.proxy.stop()
            if self.moto is not None:
                self.moto.stop()

    def loop(self, fs) -> bool:
        a = self.args
        self.start_driver()
        seen_start, seen_done = set(), set()
        driver_killed = outage_started = outage_failed = False
        outage_until = outage_t = None
        restarts = 0
        while True:
            now = time.time()
            for e in read_progress(self.progress):
                key = (e["batch"], e["pid"])
                if e["phase"] == "start" and key not in seen_start:
                    seen_start.add(key)
                    b = e["batch"]
                    if b == self.plan["driver"] and not driver_killed:
                        time.sleep(a.kill_delay)
                        driver_killed = True
                        kill_group(self.proc)
                        self.note("driver SIGKILL", b)
                        self.start_driver()
                        break
                    if b == self.plan["outage"] and not outage_started:
                        time.sleep(a.kill_delay)
                        outage_started = True
                        self.proxy.set(down=True)
                        outage_t = time.time()
                        outage_until = outage_t + a.outage_s
                        self.note("store down", b, seconds=a.outage_s)
                elif e["phase"] == "done" and key not in seen_done:
                    seen_done.add(key)
                    self.slot_pids = {r["pid"]: r["subtask"] for r in e["reports"]}
                    for r in e["reports"]:
                        if r["restored"]:
                            self.note("restored", e["batch"], subtask=r["subtask"], executor=r["executor"],
                                      source=r["restore_source"], restore_ms=r["restore_ms"])
                    s = self.sample(e["batch"], fs)
                    print(f"  batch {e['batch']:4d} {s['t']:6.0f} s ({e['seconds']:5.1f} s)  driver "
                          f"{s['driver_py_mb']:.0f}/{s['driver_jvm_mb']:.0f} MB  executors {s['executors_mb']:.0f} MB "
                          f"({s['executor_count']})  slots {s['slots_mb']:.0f} MB ({s['slot_count']})  objects "
                          f"{s['objects']} ({s['mb']} MB)  load {s['load1']}", flush=True)
            for b, sub in self.plan["executor"]:
                m = f"{self.markers}/exec-{b}-{sub}"
                if os.path.exists(m) and not any(x["what"] == "executor SIGKILL" and x["batch"] == b
                                                 for x in self.events):
                    self.note("executor SIGKILL", b, subtask=sub)
            if outage_until is not None and now >= outage_until:
                self.proxy.set(**self.throttle)
                self.note("store back", self.plan["outage"], driver_alive=self.proc.poll() is None)
                outage_until = None
            rc = self.proc.poll()
            if rc is not None:
                done = {b for b, _ in seen_done}
                if rc == 0 and len(done) >= a.batches:
                    return True
                tail = _log_tail(self.log_path)
                if outage_t is not None and not outage_failed and time.time() - outage_t < a.outage_s + 300:
                    # the outage's batch failed, as it must (its retries may outlast the outage a little)
                    outage_failed = True
                    self.note("driver failed in the outage", self.plan["outage"], rc=rc,
                              after_s=round(time.time() - outage_t, 1), error=_error_line(tail))
                    if outage_until is not None:
                        time.sleep(max(0.0, outage_until - time.time()))
                        self.proxy.set(**self.throttle)
                        self.note("store back", self.plan["outage"], driver_alive=False)
                        outage_until = None
                else:
                    self.note("driver exited unplanned", max(done, default=-1), rc=rc, error=_error_line(tail))
                    restarts += 1
                    if restarts > a.max_restarts:
                        print(f"soak-scale: the driver keeps failing; see {self.log_path}", file=sys.stderr)
                        return False
                kill_group(self.proc)
                self.start_driver()
                self.note("driver restarted", max(done, default=-1))
            if time.time() - self.t0 > a.timeout:
                self.completed = max((b for b, _ in seen_done), default=-1) + 1
                print(f"soak-scale: not finished after {a.timeout} s: checking the {self.completed} batches "
                      f"completed", file=sys.stderr)
                return False
            time.sleep(0.25)

    # -------------------------------------------------------- the verdict
    def finish(self, fs, ran: bool) -> int:
        import pandas as pd

        a = self.args
        elapsed = time.time() - self.t0
        exact, rows = False, 0
        completed = a.batches if ran else self.completed
        if completed > 0:
            got = read_output(fs, f"{BUCKET}/job/output")
            got = got[got["batch_id"] < completed].reset_index(drop=True)  # a batch cut off by --timeout: out
            rows = len(got)
            want = expected_output(self.inputs, completed)
            try:
                pd.testing.assert_frame_equal(got, want, check_dtype=False)
                exact = True
            except AssertionError as exc:
                print(f"soak-scale: output differs from pandas: {str(exc)[:2000]}", file=sys.stderr)
        stats = self.proxy.stats()
        result = verdict(self.samples, completed)
        kinds = [e["what"] for e in self.events]
        faults_ok = (kinds.count("executor SIGKILL") == len(self.plan["executor"])
                     and "driver SIGKILL" in kinds and "driver failed in the outage" in kinds)
        seconds = [s["t"] for s in self.samples]
        loads = [s["load1"] for s in self.samples]
        result.update(ran=ran, completed_batches=completed, exact=exact, rows=rows, faults_ok=faults_ok, batches=a.batches, keys=a.keys,
                      events_per_batch=a.events_per_batch, materialize_every=a.materialize_every,
                      throttle=a.throttle, outage_s=a.outage_s, seconds=round(elapsed, 1), plan=self.plan,
                      proxy=stats, throttled_share=round(stats.get("errors", 0) / max(1, stats.get("requests", 1)), 4),
                      load1_min_median_max=[min(loads, default=0), sorted(loads)[len(loads) // 2] if loads else 0,
                                            max(loads, default=0)],
                      loadavg_end=loadavg(), smoke=a.smoke, commit=_commit(),
                      span_s=round(seconds[-1] - seconds[0], 1) if seconds else 0)
        result["pass"] = bool(ran and exact and faults_ok and (a.smoke or (result["files_bounded"] and result["rss_ok"])))
        name = "soak_scale_smoke" if a.smoke else "soak_scale"
        with open(os.path.join(self.out, f"{name}.json"), "w") as f:
            json.dump({"result": result, "events": self.events, "samples": self.samples}, f, indent=1)
        chart(self.samples, self.events, os.path.join(self.out, f"{name}.png"), result)
        if a.results:
            os.makedirs(a.results, exist_ok=True)
            for n in (f"{name}.json", f"{name}.png"):
                if os.path.exists(os.path.join(self.out, n)):
                    shutil.copy(os.path.join(self.out, n), os.path.join(a.results, n))
        print(json.dumps(result, indent=1))
        print(f"soak-scale: {'PASS' if result['pass'] else 'FAIL'}; {self.out}/{name}.png", flush=True)
        return 0 if result["pass"] else 1


ROLES = ("driver_py_mb", "driver_jvm_mb", "executors_mb", "slots_mb")


def verdict(samples: List[dict], batches: int) -> dict:
    """RSS growth per role after the warm-up (batches < a quarter), and whether the state's objects
    stay bounded (second half's maximum against the first half's)."""
    out: dict = {"samples": len(samples)}
    warm = [s for s in samples if s["batch"] >= batches // 4]
    for key in ROLES:
        vals = [s[key] for s in warm if s[key] > 0]
        if len(vals) >= 2:
            out[f"{key}_after_warmup"] = vals[0]
            out[f"{key}_end"] = max(vals[-3:])
            out[f"{key}_range"] = [min(vals), max(vals)]
            out[f"{key}_growth"] = round(max(vals[-3:]) / vals[0] - 1, 3)
    first = [s for s in samples if s["batch"] < batches // 2]
    second = [s for s in samples if s["batch"] >= batches // 2]
    f1 = max((s["objects"] for s in first), default=0)
    f2 = max((s["objects"] for s in second), default=0)
    out.update(objects_max_first_half=f1, objects_max_second_half=f2,
               mb_max_first_half=max((s["mb"] for s in first), default=0),
               mb_max_second_half=max((s["mb"] for s in second), default=0))
    out["files_bounded"] = f2 <= max(1.5 * f1, f1 + 10)
    out["rss_ok"] = all((out.get(f"{k}_growth") or 0) < 0.10 for k in ROLES)
    return out


def chart(samples: List[dict], events: List[dict], path: str, result: dict) -> None:
    try:
        import matplotlib

        matplotlib.use("Agg")
        import matplotlib.pyplot as plt
    except ImportError:
        print("soak-scale: matplotlib missing (pip install -e .[bench]); no chart", file=sys.stderr)
        return
    fig, axes = plt.subplots(3, 1, figsize=(11, 10), sharex=True)
    colors = {"executor SIGKILL": "orange", "driver SIGKILL": "red", "store down": "purple", "store back": "green"}
    # samples in run order: a replayed batch after a restart is sampled again, so plot against time
    t = [s["t"] / 60 for s in samples]
    for k in ROLES:
        axes[0].plot(t, [s[k] for s in samples], marker=".", ms=3, label=k[:-3].replace("_", " "))
    axes[0].set_ylabel("RSS (MB)")
    axes[0].set_title(f"soak-scale: {result['batches']} batches, {result['keys']:,} keys; "
                      f"exact={result['exact']}, rss_ok={result['rss_ok']}, files_bounded={result['files_bounded']}")
    axes[1].plot(t, [s["objects"] for s in samples], marker=".", ms=3, label="state objects on the bucket")
    ax2 = axes[1].twinx()
    ax2.plot(t, [s["mb"] for s in samples], color="gray", lw=1, label="their MB")
    ax2.set_ylabel("MB")
    axes[1].set_ylabel("objects (output excluded)")
    axes[2].plot(t, [s["batch"] for s in samples], marker=".", ms=3, label="batch completed")
    ax3 = axes[2].twinx()
    ax3.plot(t, [s["load1"] for s in samples], color="gray", lw=1, label="load (1 min)")
    ax3.set_ylabel("load average")
    axes[2].set_ylabel("batch")
    axes[2].set_xlabel("minutes (vertical lines: executor kill orange, driver kill red, store down purple / back green)")
    for ax in axes:
        for e in events:
            if e["what"] in colors:
                ax.axvline(e["t"] / 60, color=colors[e["what"]], alpha=0.5, lw=1)
        ax.legend(fontsize=7, loc="upper left")
    fig.tight_layout()
    fig.savefig(path, dpi=90)


def _log_tail(path: str, n: int = 20000) -> str:
    try:
        with open(path, errors="replace") as f:
            f.seek(max(0, os.path.getsize(path) - n))
            return f.read()
    except OSError:
        return ""


def _error_line(tail: str) -> str:
    """The most telling line of a failed driver's log."""
    tail = tail.rsplit("===== driver started", 1)[-1]
    for needle in ("StreamBatchError", "Could not connect to the endpoint URL", "Error:", "Exception:"):
        hits = [ln.strip() for ln in tail.splitlines() if needle in ln]
        if hits:
            return hits[-1][:400]
    return ""


def _commit() -> str:
    try:
        return subprocess.run(["git", "-C", ROOT, "rev-parse", "--short", "HEAD"], capture_output=True,
                              text=True, timeout=10).stdout.strip()
    except (OSError, subprocess.SubprocessError):
        return ""


def main(argv: Optional[List[str]] = None) -> int:
    argv = sys.argv[1:] if argv is None else argv
    if argv[:1] == ["--driver"]:
        return driver(*argv[1:6])
    p = argparse.ArgumentParser(prog="bench/soak_scale.py", description=__doc__.split("\n\n")[0])
    p.add_argument("--batches", type=int, default=160)
    p.add_argument("--keys", type=int, default=1_000_000)
    p.add_argument("--events-per-batch", type=int, default=4_000)
    p.add_argument("--materialize-every", type=int, default=40_000,
                   help="changes logged per subtask before a compact snapshot (StatefulStream's "
                        "materialize_every): without one, the changelog a checkpoint references grows every batch")
    p.add_argument("--throttle", type=float, default=0.10, help="share of requests answered 503 SlowDown")
    p.add_argument("--outage-s", type=float, default=60.0, help="how long the store is gone")
    p.add_argument("--kill-delay", type=float, default=1.0,
                   help="seconds into a batch at which the driver is killed / the store goes away")
    p.add_argument("--driver-heap", default="1g")
    p.add_argument("--executor-heap", default="1g")
    p.add_argument("--worker-mb", type=int, default=1536, help="local-cluster[2,1,MB]")
    p.add_argument("--max-restarts", type=int, default=3, help="unplanned driver failures tolerated")
    p.add_argument("--out", default=None, help="working directory (default: a new temporary one)")
    p.add_argument("--results", default=None, help="copy the JSON and the chart here (make soak-scale: bench/results)")
    p.add_argument("--timeout", type=float, default=3600.0, help="give up after this many seconds")
    p.add_argument("--smoke", action="store_true", help="10 batches, 20,000 keys, each fault once")
    args = p.parse_args(argv)
    if args.smoke:
        args.batches, args.keys, args.events_per_batch, args.materialize_every = 10, 20_000, 500, 4_000
    def stop(signum, _frame):  # SIGTERM, or SIGINT where a background shell ignores it: clean up first
        raise SystemExit(128 + signum)

    signal.signal(signal.SIGTERM, stop)
    signal.signal(signal.SIGINT, stop)
    return Run(args).run()


if __name__ == "__main__":
    sys.exit(main())
