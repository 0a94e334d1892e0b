"""A real Spark standalone cluster on 127.0.0.1 for tests, benchmarks and `make cluster-demo`, and a
reader for the event logs its applications write.

`StandaloneCluster` starts a master and N workers from pyspark's own `bin/spark-class`
(`org.apache.spark.deploy.master.Master` / `...deploy.worker.Worker`), each worker with 1 core and
1 GB by default, on free ports, with an event-log directory for the applications. Every process it
starts, and every process those start (executors, Python workers, dstl upload services), carries a
tag in its environment; `stop()` finds them by that tag and stops each by its PID, so nothing
survives a test, even one that failed or killed a worker half-way.

`read_event_log(dir)` parses Spark's JSON event log: stages with their tasks (index, attempt,
executor id, launch and finish times, failure) and the executors added and removed.
"""
from __future__ import annotations

import glob
import json
import os
import signal
import socket
import subprocess
import sys
import time
import urllib.request
import uuid
from dataclasses import dataclass, field
from typing import Dict, List, Optional

TAG_ENV = "DSTL_TEST_CLUSTER"


def free_port() -> int:
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return s.getsockname()[1]


def spark_home() -> str:
    import pyspark

    return os.path.dirname(os.path.abspath(pyspark.__file__))


def tagged_pids(tag: str) -> List[int]:
    """PIDs of this user's processes whose environment holds TAG_ENV=tag."""
    needle = f"{TAG_ENV}={tag}".encode()
    pids = []
    for entry in os.listdir("/proc"):
        if not entry.isdigit() or int(entry) == os.getpid():
            continue
        try:
            with open(f"/proc/{entry}/environ", "rb") as f:
                if needle in f.read().split(b"\0"):
                    pids.append(int(entry))
        except OSError:  # gone, or not ours
            continue
    return pids


def _alive(pid: int) -> bool:
    try:
        with open(f"/proc/{pid}/stat") as f:
            return f.read().rsplit(")", 1)[1].split()[0] != "Z"
    except OSError:
        return False


def _parent(pid: int) -> int:
    try:
        with open(f"/proc/{pid}/stat") as f:
            return int(f.read().rsplit(")", 1)[1].split()[1])
    except (OSError, ValueError, IndexError):
        return -1


def stop_pids(pids: List[int], grace_s: float = 10.0) -> None:
    """SIGTERM each PID, wait up to `grace_s`, then SIGKILL those still alive."""
    for pid in pids:
        try:
            os.kill(pid, signal.SIGTERM)
        except ProcessLookupError:
            pass
    deadline = time.monotonic() + grace_s
    while time.monotonic() < deadline and any(_alive(p) for p in pids):
        time.sleep(0.1)
    for pid in pids:
        if _alive(pid):
            try:
                os.kill(pid, signal.SIGKILL)
            except ProcessLookupError:
                pass


@dataclass
class Worker:
    index: int
    pid: int
    port: int
    webui_port: int
    work_dir: str
    proc: subprocess.Popen = field(repr=False)


class StandaloneCluster:
    """A standalone master and `workers` workers on 127.0.0.1; use as a context manager.

    `env`: changes to this process's environment for the master, the workers and so the executors
    and their Python workers (a worker's environment is its executors'); a value None removes the
    variable. `root`: where
    logs, work dirs and the event log go.
    """

    def __init__(self, root: str, workers: int = 2, cores: int = 1, memory: str = "1g",
                 env: Optional[Dict[str, str]] = None, start_timeout_s: float = 90.0):
        self.root = os.path.abspath(root)
        self.n_workers = workers
        self.cores = cores
        self.memory = memory
        self.tag = uuid.uuid4().hex
        self.start_timeout_s = start_timeout_s
        self.event_log_dir = os.path.join(self.root, "event-log")
        self.log_dir = os.path.join(self.root, "logs")
        self.env = dict(os.environ)
        self.env.update({"SPARK_HOME": spark_home(), "SPARK_LOCAL_IP": "127.0.0.1",
                         "SPARK_LOG_DIR": self.log_dir, "SPARK_NO_DAEMONIZE": "1", TAG_ENV: self.tag})
        self.env.pop("SPARK_CONF_DIR", None)
        for k, v in (env or {}).items():  # None: not in the cluster's environment
            if v is None:
                self.env.pop(k, None)
            else:
                self.env[k] = v
        self.master_port = self.master_webui_port = 0
        self.master_proc: Optional[subprocess.Popen] = None
        self.workers: List[Worker] = []

    # ------------------------------------------------------------ lifecycle
    def __enter__(self) -> "StandaloneCluster":
        try:
            self.start()
        except BaseException:
            self.stop()
            raise
        return self

    def __exit__(self, *exc) -> None:
        self.stop()

    @property
    def master_url(self) -> str:
        return f"spark://127.0.0.1:{self.master_port}"

    def _spawn(self, name: str, argv: List[str]) -> subprocess.Popen:
        os.makedirs(self.log_dir, exist_ok=True)
        log = open(os.path.join(self.log_dir, f"{name}.log"), "ab")
        try:
            return subprocess.Popen([os.path.join(spark_home(), "bin", "spark-class"), *argv], env=self.env,
                                    stdout=log, stderr=subprocess.STDOUT, stdin=subprocess.DEVNULL,
                                    start_new_session=True)
        finally:
            log.close()

    def start(self) -> None:
        os.makedirs(self.event_log_dir, exist_ok=True)
        self.master_port, self.master_webui_port = free_port(), free_port()
        self.master_proc = self._spawn("master", [
            "org.apache.spark.deploy.master.Master", "--host", "127.0.0.1", "--port", str(self.master_port),
            "--webui-port", str(self.master_webui_port)])
        for i in range(self.n_workers):
            self.start_worker(i)
        self.wait_for_workers(self.n_workers)

    def start_worker(self, index: int) -> Worker:
        """Start worker `index` (again, after `kill_worker`: a new JVM, a new worker id)."""
        port, webui = free_port(), free_port()
        work_dir = os.path.join(self.root, f"worker-{index}")
        os.makedirs(work_dir, exist_ok=True)
        proc = self._spawn(f"worker-{index}", [
            "org.apache.spark.deploy.worker.Worker", "--host", "127.0.0.1", "--port", str(port),
            "--webui-port", str(webui), "--cores", str(self.cores), "--memory", self.memory,
            "--work-dir", work_dir, self.master_url])
        w = Worker(index, proc.pid, port, webui, work_dir, proc)
        self.workers = [x for x in self.workers if x.index != index] + [w]
        return w

    def master_state(self) -> dict:
        with urllib.request.urlopen(f"http://127.0.0.1:{self.master_webui_port}/json/", timeout=5) as r:
            return json.loads(r.read())

    def alive_workers(self) -> List[dict]:
        try:
            return [w for w in self.master_state().get("workers", []) if w.get("state") == "ALIVE"]
        except OSError:
            return []

    def wait_for_workers(self, n: int, timeout_s: Optional[float] = None) -> None:
        """Wait until the master lists `n` alive workers (a dead JVM fails at once, with its log)."""
        deadline = time.monotonic() + (timeout_s or self.start_timeout_s)
        while time.monotonic() < deadline:
            if len(self.alive_workers()) >= n:
                return
            for name, proc in [("master", self.master_proc)] + [(f"worker-{w.index}", w.proc) for w in self.workers]:
                if proc is not None and proc.poll() is not None:
                    raise RuntimeError(f"spark {name} exited with {proc.returncode}: {self.log_tail(name)}")
            time.sleep(0.3)
        raise TimeoutError(f"{len(self.alive_workers())} of {n} workers alive after the timeout; "
                           f"master log: {self.log_tail('master')}")

    def log_tail(self, name: str, chars: int = 3000) -> str:
        try:
            with open(os.path.join(self.log_dir, f"{name}.log"), errors="replace") as f:
                return f.read()[-chars:]
        except OSError:
            return "(no log)"

    def kill_worker(self, index: int) -> List[int]:
        """SIGKILL worker `index`'s JVM and the executor JVMs it launched, at once (a lost host: an
        executor whose worker alone died would finish its running task before it notices); returns
        the PIDs killed, worker first."""
        w = next(x for x in self.workers if x.index == index)
        pids = [w.pid] + [p for p in self.executor_pids() if _parent(p) == w.pid]
        for pid in pids:
            os.kill(pid, signal.SIGKILL)
        w.proc.wait(timeout=30)
        return pids

    def worker_of_executor(self, app_id: str, executor_id: str) -> Optional[int]:
        """The index of the worker that runs `executor_id` of application `app_id` (from its work dir)."""
        for w in self.workers:
            if os.path.isdir(os.path.join(w.work_dir, app_id, str(executor_id))):
                return w.index
        return None

    def executor_pids(self) -> List[int]:
        """PIDs of the executor JVMs (CoarseGrainedExecutorBackend) now running on this cluster."""
        out = []
        for pid in tagged_pids(self.tag):
            try:
                with open(f"/proc/{pid}/cmdline", "rb") as f:
                    if b"CoarseGrainedExecutorBackend" in f.read():
                        out.append(pid)
            except OSError:
                continue
        return out

    def stop(self) -> None:
        """Stop every process of this cluster by PID: workers and master first, then whatever they left
        (executors, Python workers, upload services), found by the environment tag."""
        started = [w.pid for w in self.workers] + ([self.master_proc.pid] if self.master_proc else [])
        stop_pids([p for p in started if _alive(p)])
        for proc in [w.proc for w in self.workers] + ([self.master_proc] if self.master_proc else []):
            try:
                proc.wait(timeout=10)
            except subprocess.TimeoutExpired:
                pass
        for _ in range(3):  # children may start grandchildren while they die
            left = [p for p in tagged_pids(self.tag) if _alive(p)]
            if not left:
                break
            stop_pids(left, grace_s=5.0)

    # ------------------------------------------------------------ applications
    def app_conf(self, python: Optional[str] = None) -> Dict[str, str]:
        """Spark conf for an application on this cluster: master, loopback driver, event log."""
        return {
            "spark.master": self.master_url,
            "spark.driver.host": "127.0.0.1",
            "spark.driver.bindAddress": "127.0.0.1",
            "spark.ui.enabled": "false",
            "spark.eventLog.enabled": "true",
            "spark.eventLog.dir": "file://" + self.event_log_dir,
            # one plain JSON-lines file per application (Spark 4 rolls and compresses by default)
            "spark.eventLog.rolling.enabled": "false",
            "spark.eventLog.compress": "false",
            "spark.pyspark.python": python or sys.executable,
            "spark.pyspark.driver.python": python or sys.executable,
            "spark.executorEnv." + TAG_ENV: self.tag,
        }

    def driver_env(self, extra: Optional[Dict[str, str]] = None) -> Dict[str, str]:
        """Environment for a driver process of this cluster (tagged, so `stop()` reaches it too). A
        driver started as `python script.py` takes its executors' Python from PYSPARK_PYTHON
        (spark.pyspark.python is read by spark-submit only)."""
        env = dict(self.env, PYSPARK_PYTHON=sys.executable)
        env.update(extra or {})
        return env


def running_tasks(ui_port: int) -> List[dict]:
    """The tasks a driver is running now, from its status REST API on 127.0.0.1:`ui_port`: dicts
    with appId, stageId, index, executorId (empty when the driver or its UI is not up yet)."""
    def get(path):
        with urllib.request.urlopen(f"http://127.0.0.1:{ui_port}/api/v1/{path}", timeout=2) as r:
            return json.loads(r.read())

    try:
        out = []
        for app in get("applications"):
            for st in get(f"applications/{app['id']}/stages?status=active"):
                tasks = get(f"applications/{app['id']}/stages/{st['stageId']}/{st['attemptId']}/taskList"
                            "?status=running")
                out += [dict(t, appId=app["id"], stageId=st["stageId"]) for t in tasks
                        if t.get("status") == "RUNNING"]
        return out
    except (OSError, ValueError):
        return []


# ---------------------------------------------------------------- a streaming driver on the cluster

DRIVER = os.path.join(os.path.dirname(os.path.abspath(__file__)), "cluster_driver.py")


def read_progress(path: str) -> List[dict]:
    """The complete lines tests/cluster_driver.py wrote to its progress file so far."""
    if not os.path.exists(path):
        return []
    with open(path) as f:
        return [json.loads(line) for line in f if line.endswith("\n")]


def run_stream_driver(env: Dict[str, str], conf: Dict[str, str], args: List[str], progress: str,
                      on_poll=None, timeout: float = 600) -> None:
    """Run tests/cluster_driver.py with `args` and Spark `conf` until its input is drained; call
    `on_poll(progress entries)` every 50 ms meanwhile. Raises with the driver's log on failure."""
    argv = [sys.executable, DRIVER, "--progress", progress, *args]
    for k, v in conf.items():
        argv += ["--conf", f"{k}={v}"]
    with open(progress + ".log", "ab") as log:
        proc = subprocess.Popen(argv, env=env, stdout=log, stderr=subprocess.STDOUT, start_new_session=True)
    deadline = time.monotonic() + timeout
    try:
        while proc.poll() is None and time.monotonic() < deadline:
            if on_poll is not None:
                on_poll(read_progress(progress))
            time.sleep(0.05)
    finally:
        if proc.poll() is None:
            proc.kill()
        proc.wait(timeout=30)
    if proc.returncode != 0:
        with open(progress + ".log", errors="replace") as f:
            raise RuntimeError(f"driver exited with {proc.returncode}: {f.read()[-4000:]}")


# ---------------------------------------------------------------- event log

@dataclass
class TaskRun:
    stage: int
    stage_attempt: int
    index: int
    attempt: int
    executor: str
    host: str
    launch_ms: int
    finish_ms: int
    failed: bool
    reason: str = ""


@dataclass
class StageRun:
    stage: int
    attempt: int
    name: str
    details: str
    num_tasks: int
    job: Optional[int] = None
    tasks: List[TaskRun] = field(default_factory=list)

    def successful(self) -> List[TaskRun]:
        return [t for t in self.tasks if not t.failed]

    def executors(self) -> List[str]:
        return sorted({t.executor for t in self.successful()})

    def overlapping(self) -> bool:
        """Did two successful tasks of this stage run at the same time?"""
        ts = sorted(self.successful(), key=lambda t: t.launch_ms)
        return any(b.launch_ms < a.finish_ms for a, b in zip(ts, ts[1:]))


@dataclass
class EventLog:
    app_id: str
    stages: List[StageRun]
    executors_added: Dict[str, int]     # executor id -> time (ms)
    executors_removed: Dict[str, str]   # executor id -> reason

    def stages_matching(self, text: str) -> List[StageRun]:
        """Stages whose name or call-site details contain `text`, in submission order."""
        return [s for s in self.stages if text in s.name or text in s.details]


def event_log_files(directory: str) -> List[str]:
    """The applications' event logs in `directory`, oldest first (app ids sort by start time)."""
    return sorted(p for p in glob.glob(os.path.join(directory, "app-*")) if os.path.isfile(p))


def read_event_log(path: str) -> EventLog:
    """Parse one application's event log (a file written with spark.eventLog.enabled)."""
    stages: Dict[tuple, StageRun] = {}
    stage_job: Dict[int, int] = {}
    added: Dict[str, int] = {}
    removed: Dict[str, str] = {}
    app_id = ""
    with open(path, errors="replace") as f:
        for line in f:
            try:
                ev = json.loads(line)
            except ValueError:  # an in-progress log may end in a partial line
                continue
            kind = ev.get("Event")
            if kind == "SparkListenerApplicationStart":
                app_id = ev.get("App ID", "")
            elif kind == "SparkListenerJobStart":
                for sid in ev.get("Stage IDs", []):
                    stage_job[sid] = ev["Job ID"]
            elif kind in ("SparkListenerStageSubmitted", "SparkListenerStageCompleted"):
                info = ev["Stage Info"]
                key = (info["Stage ID"], info.get("Stage Attempt ID", 0))
                st = stages.get(key)
                if st is None:
                    st = stages[key] = StageRun(key[0], key[1], info.get("Stage Name", ""), info.get("Details", ""),
                                                info.get("Number of Tasks", 0), stage_job.get(key[0]))
            elif kind == "SparkListenerTaskEnd":
                info = ev["Task Info"]
                key = (ev["Stage ID"], ev.get("Stage Attempt ID", 0))
                st = stages.get(key)
                if st is None:
                    st = stages[key] = StageRun(key[0], key[1], "", "", 0, stage_job.get(key[0]))
                reason = ev.get("Task End Reason", {}) or {}
                st.tasks.append(TaskRun(key[0], key[1], info["Index"], info["Attempt"], str(info["Executor ID"]),
                                        info.get("Host", ""), info["Launch Time"], info.get("Finish Time", 0),
                                        bool(info.get("Failed") or info.get("Killed")),
                                        reason.get("Reason", "") if reason.get("Reason") != "Success" else ""))
            elif kind == "SparkListenerExecutorAdded":
                added[str(ev["Executor ID"])] = ev.get("Timestamp", 0)
            elif kind == "SparkListenerExecutorRemoved":
                removed[str(ev["Executor ID"])] = ev.get("Removed Reason", "")
    ordered = sorted(stages.values(), key=lambda s: (s.stage, s.attempt))
    return EventLog(app_id, ordered, added, removed)
