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


def bytecode_spark_home(directory: str) -> Optional[str]:
    """A Spark home for a driver whose Python processes should import the installed pyspark, or None
    where that does not apply (SPARK_HOME set, or pyspark not installed as a package).

    Spark puts ``$SPARK_HOME/python/lib/pyspark.zip`` first on the PYTHONPATH of every Python process
    it starts. A pip-installed pyspark is its own Spark home and ships that zip without bytecode, so
    each such process compiles the pyspark modules it imports (measured: 2.2-2.9 s of CPU for
    foreachBatch's worker, against about 1 s importing the installed, compiled package). The
    processes Spark starts one per query on the driver (foreachBatch's under Spark Connect,
    transformWithState's PreInit runner) must connect back within a fixed 10 s
    (PythonWorkerFactory.createSimpleWorker; no setting changes it), which a loaded 2-core machine
    misses. This home is the package's own directory entry by entry (bin, jars, ...), less
    `python`: the zip's path then names nothing, and the processes import the installed pyspark,
    the same files, with their bytecode."""
    if os.environ.get("SPARK_HOME"):
        return None
    import pyspark
    from pyspark.find_spark_home import _find_spark_home

    package = os.path.dirname(os.path.abspath(pyspark.__file__))
    if os.path.realpath(_find_spark_home()) != os.path.realpath(package):
        return None
    os.makedirs(directory, exist_ok=True)
    for name in os.listdir(package):
        link = os.path.join(directory, name)
        if name != "python" and not os.path.lexists(link):
            os.symlink(os.path.join(package, name), link)
    return directory
