"""Run a Spark driver script in its own process group, with fault points armed, and reap the group."""
from __future__ import annotations

import os
import subprocess
import sys
from typing import List, Optional, Tuple

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
