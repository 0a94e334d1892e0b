"""What the Spark benchmarks that run each measurement in its own driver process share: /proc
figures (peak and current RSS), the load average, the driver's SparkSession, and starting a child
driver (its own process group, reaped by PID) with this checkout on its path.
"""
from __future__ import annotations

import os
import signal
import subprocess
import sys
import time
from typing import Iterable, List, Optional

HERE = os.path.dirname(os.path.abspath(__file__))
ROOT = os.path.dirname(HERE)


def proc_kb(pid: int, field: str) -> int:
    """A `kB` field of /proc/<pid>/status (`VmHWM`: peak RSS, `VmRSS`: current); 0 if gone."""
    try:
        with open(f"/proc/{pid}/status") as f:
            for line in f:
                if line.startswith(field + ":"):
                    return int(line.split()[1])
    except (FileNotFoundError, ProcessLookupError):
        pass
    return 0


def peak_mb(pid: int) -> float:
    return round(proc_kb(pid, "VmHWM") / 1024, 1)


def rss_mb(pid: int) -> float:
    return round(proc_kb(pid, "VmRSS") / 1024, 1)


def cpu_s(pid: int) -> float:
    """User + system CPU seconds of process `pid` so far (/proc/<pid>/stat); 0.0 if gone."""
    try:
        with open(f"/proc/{pid}/stat") as f:
            fields = f.read().rsplit(")", 1)[1].split()
        return (int(fields[11]) + int(fields[12])) / os.sysconf("SC_CLK_TCK")
    except (OSError, IndexError, ValueError):
        return 0.0


def loadavg() -> str:
    try:
        with open("/proc/loadavg") as f:
            return " ".join(f.read().split()[:3])
    except OSError:
        return "?"


def driver_session(master: str, app: str, driver_memory: str, conf: Iterable[tuple] = ()):
    """A loopback-only SparkSession without UI, Arrow on; returns (spark, the driver JVM's pid)."""
    from pyspark.sql import SparkSession

    b = (SparkSession.builder.master(master).appName(app)
         .config("spark.driver.host", "127.0.0.1").config("spark.driver.bindAddress", "127.0.0.1")
         .config("spark.ui.enabled", "false").config("spark.ui.showConsoleProgress", "false")
         .config("spark.driver.memory", driver_memory)
         .config("spark.executorEnv.PYSPARK_PYTHON", sys.executable)
         .config("spark.sql.execution.arrow.pyspark.enabled", "true"))
    for k, v in conf:
        b = b.config(k, v)
    spark = b.getOrCreate()
    spark.sparkContext.setLogLevel("ERROR")
    return spark, spark.sparkContext._gateway.proc.pid


def child_env() -> dict:
    return dict(os.environ, PYTHONPATH=os.pathsep.join([ROOT, os.path.join(ROOT, "tests"), HERE]),
                SPARK_LOCAL_IP="127.0.0.1", PYSPARK_PYTHON=sys.executable)


def run_child(script: str, args: List[str], timeout: float, log: Optional[str] = None) -> int:
    """Run `python script args` as a driver in its own process group; its output to `log` (or
    discarded). The group is reaped (SIGKILL after 30 s) when it ends or times out; returns the
    exit code (-9 after a timeout)."""
    out = open(log, "ab") if log else subprocess.DEVNULL
    try:
        proc = subprocess.Popen([sys.executable, script, *args], env=child_env(), stdout=out,
                                stderr=subprocess.STDOUT, start_new_session=True)
        try:
            rc = proc.wait(timeout=timeout)
        except subprocess.TimeoutExpired:
            os.killpg(proc.pid, signal.SIGKILL)
            rc = proc.wait()
            rc = -9
        _reap_group(proc.pid)
        return rc
    finally:
        if log:
            out.close()


def _reap_group(pgid: int) -> None:
    """The driver's JVM exits once its Python parent is gone; wait for it, then make sure."""
    from dstl.tools.stream_demo import reap_group

    reap_group(pgid)


def stop_slots(pids: Iterable[int], wait_s: float = 15.0) -> List[int]:
    """dstl's slot processes (detached by design) that outlived their driver: they exit on their own
    once the worker daemon they served is gone; any still alive after `wait_s` get SIGTERM, by PID,
    if their command line is still a dstl slot's. Returns the PIDs that had to be stopped."""
    pids = sorted({int(p) for p in pids if p})

    def is_slot(pid: int) -> bool:
        try:
            with open(f"/proc/{pid}/cmdline", "rb") as f:
                return b"dstl.spark.slot_process" in f.read()
        except OSError:
            return False

    deadline = time.monotonic() + wait_s
    while time.monotonic() < deadline and any(is_slot(p) for p in pids):
        time.sleep(0.5)
    stopped = []
    for p in pids:
        if is_slot(p):
            try:
                os.kill(p, signal.SIGTERM)
                stopped.append(p)
            except ProcessLookupError:
                pass
    return stopped
