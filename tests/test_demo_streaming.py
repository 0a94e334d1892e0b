"""`dstl demo --streaming`: two real driver processes (a SIGKILL, then a rescale 2 -> 3), verified.

Heavy (two JVMs): runs under the Cython build only; tests/test_stream*.py cover the same logic."""
from __future__ import annotations

import os
import subprocess
import sys

import pytest

from conftest import heavy

ROOT = os.path.abspath(os.path.join(os.path.dirname(__file__), ".."))


@heavy
def test_demo_streaming_kills_rescales_and_verifies(tmp_path):
    target = tmp_path / "demo"
    env = dict(os.environ, PYTHONPATH=ROOT, PYSPARK_PYTHON=sys.executable, SPARK_LOCAL_IP="127.0.0.1")
    proc = subprocess.run([sys.executable, "-m", "dstl", "demo", "--streaming", "--dir", str(target),
                           "--events", "3000", "--batches", "3"], capture_output=True, text=True, env=env,
                          timeout=900, cwd=str(tmp_path))
    assert proc.returncode == 0, proc.stdout[-2000:] + proc.stderr[-3000:]
    out = proc.stdout
    assert "SIGKILLed once checkpoint 2 (batch 1) is durable" in out
    assert "batch 1 at parallelism 3: replayed" in out  # Spark replayed the killed batch
    assert "3. verify: exact." in out
    assert (target / "state" / "output" / "batch_id=2" / "_SUCCESS").exists()


def test_demo_streaming_needs_three_batches(tmp_path):
    from dstl.tools import stream_demo

    assert stream_demo.run(str(tmp_path), 100, 2, "local[1]") == 2
