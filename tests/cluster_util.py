"""A real Spark standalone cluster on 127.0.0.1 for tests, benchmarks and `make cluster-demo`, and a
reader for the event logs its applications write.

`StandaloneCluster` starts a master and N workers from pyspark's own `bin/spark-class`
(`org.apache.spark.deploy.master.Master` / `...deploy.worker.Worker`), each worker with 1 core and
1 GB by default, on free ports, with an event-log directory for the applications. Every process it
starts, and every process those start (executors, Python workers, dstl upload services), carries a
tag in its environment; `stop()` finds them by that tag and stops each by its PID, so nothing
survives a test, even one that failed or killed a worker half-way.

Applications get an event log (tests/eventlog_util.py reads it: each batch's stage, its tasks,
their executors and times), and `running_tasks` asks a driver's status API what runs right now.
"""
from __future__ import annotations

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

from eventlog_util import eventlog_conf

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
        except (OSError, ValueError):  # not listening yet, or an answer that is not the JSON status yet
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
            **eventlog_conf("file://" + self.event_log_dir),   # read with eventlog_util.batch_stages
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
    with appId, stageId, description (the stage's job description), index, executorId (empty when
    the driver or its UI is not up yet)."""
    def get(path):
        with urllib.request.urlopen(f"http://127.0.0.1:{ui_port}/api/v1/{path}", timeout=2) as r:
            return json.loads(r.read())

    try:
        out = []
        for app in get("applications"):
            for st in get(f"applications/{app['id']}/stages?status=active"):
                tasks = get(f"applications/{app['id']}/stages/{st['stageId']}/{st['attemptId']}/taskList"
                            "?status=running")
                out += [dict(t, appId=app["id"], stageId=st["stageId"], description=st.get("description") or "")
                        for t in tasks
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
