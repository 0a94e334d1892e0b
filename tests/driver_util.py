"""Run a Spark driver script in its own process group, with fault points armed, and reap the group."""
from __future__ import annotations

import os
import subprocess
import sys
from typing import Iterable, List, Optional, Tuple

from dstl.tools.stream_demo import reap_group

HERE = os.path.dirname(os.path.abspath(__file__))
ROOT = os.path.dirname(HERE)


def run_driver(script: str, args: List[str], faults_spec: Optional[str], timeout: float = 600) -> Tuple[int, str]:
    """(exit code, output) of `tests/<script> args` with `DSTL_FAULTS=faults_spec` (None: no faults)."""
    env = dict(os.environ, PYTHONPATH=os.pathsep.join([ROOT, HERE]), PYSPARK_PYTHON=sys.executable,
               SPARK_LOCAL_IP="127.0.0.1")
    env.pop("DSTL_FAULTS", None)
    if faults_spec:
        env["DSTL_FAULTS"] = faults_spec
    proc = subprocess.Popen([sys.executable, os.path.join(HERE, script), *args], env=env,
                            stdout=subprocess.PIPE, stderr=subprocess.STDOUT, start_new_session=True)
    try:
        out, _ = proc.communicate(timeout=timeout)
    finally:
        reap_group(proc.pid)
    return proc.returncode, out.decode(errors="replace")


def driver_session(master: str, app_name: str, eventlog: Optional[str] = None, conf: Iterable[str] = ()):
    """The SparkSession of a test driver: loopback only, no UI, Arrow on, an event log when asked for
    (`eventlog` a directory), then each `KEY=VALUE` of `conf`; executors of a local-cluster get 512 MB."""
    from pyspark.sql import SparkSession

    from eventlog_util import eventlog_conf

    b = (SparkSession.builder.master(master).appName(app_name)
         .config("spark.driver.host", "127.0.0.1").config("spark.driver.bindAddress", "127.0.0.1")
         .config("spark.ui.enabled", "false").config("spark.ui.showConsoleProgress", "false")
         .config("spark.executorEnv.PYSPARK_PYTHON", sys.executable)
         .config("spark.sql.execution.arrow.pyspark.enabled", "true"))
    if master.startswith("local-cluster"):
        b = b.config("spark.executor.memory", "512m")
    if eventlog:
        os.makedirs(eventlog, exist_ok=True)
        for k, v in eventlog_conf(eventlog).items():
            b = b.config(k, v)
    for kv in conf:
        k, v = kv.split("=", 1)
        b = b.config(k, v)
    spark = b.getOrCreate()
    spark.sparkContext.setLogLevel("ERROR")
    return spark
