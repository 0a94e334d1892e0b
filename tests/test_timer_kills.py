"""A SIGKILL of the driver at every step of a timer round (dstl.spark.timer_rounds), then a restart
of the same query, one chain: run i adds one input file (one new user), its batch arms a 1 ms
timer, the first timer round after it fires that timer and run i is killed at step i of that round;
run i + 1 recovers it. Runs 1 and 2 restart at parallelism 3 (the timers of run 0 fire at 3), the
rest at 2. At the end every user's timeout is committed exactly once in one output folder, and the
sink got it once (twice for the round killed after its sink returned but before its marker).

Heavy: six driver starts (30-70 s each on the shared machine).
"""
from __future__ import annotations

import collections
import os
import signal
import subprocess
import sys
import time

import pandas as pd
import pytest

from conftest import heavy

pytestmark = heavy

HERE = os.path.dirname(os.path.abspath(__file__))
ROOT = os.path.dirname(HERE)
# (step killed, parallelism of the run); run i's batch is dstl batch 2i - (kills before it that
# left no batch number used) ... computed below from the run's own numbering
STEPS = [("before_tasks", 2), ("after_tasks", 3), ("after_checkpoint", 3), ("mid_sink", 2), ("after_sink", 2)]
USERS = ["a", "b", "c", "d", "e", "f"]


def _run(tmp, i, parallelism, faults, until_rows):
    from streaming_util import write_json_batch

    write_json_batch(str(tmp / "in"), i, pd.DataFrame({"user": [USERS[i]] * (i + 1), "kind": ["x"] * (i + 1),
                                                       "value": list(range(i + 1)), "ts_ms": [1000] * (i + 1)}))
    env = dict(os.environ, PYTHONPATH=os.pathsep.join([ROOT, HERE]), PYSPARK_PYTHON=sys.executable,
               SPARK_LOCAL_IP="127.0.0.1")
    env.pop("DSTL_FAULTS", None)
    if faults:
        env["DSTL_FAULTS"] = faults
    proc = subprocess.Popen([sys.executable, os.path.join(HERE, "timer_kill_driver.py"), "--base", str(tmp / "job"),
                             "--input", str(tmp / "in"), "--checkpoint", str(tmp / "ckpt"),
                             "--parallelism", str(parallelism), "--sink-log", str(tmp / "sink.log"),
                             "--until-rows", str(until_rows)],
                            env=env, start_new_session=True, stdout=subprocess.DEVNULL,
                            stderr=open(tmp / f"driver-{i}.err", "w"))
    try:
        rc = proc.wait(timeout=400)
    finally:
        if proc.poll() is None:
            os.killpg(proc.pid, signal.SIGKILL)
            proc.wait()
    # the driver's JVM is its child in the same session: a SIGKILLed driver leaves it behind
    try:
        os.killpg(proc.pid, signal.SIGKILL)
    except ProcessLookupError:
        pass
    return rc


def _next_round(base):
    """The dstl batch number of the first timer round after the next Spark batch."""
    from dstl.state.metadata import latest_checkpoint

    latest = latest_checkpoint(base)
    return 1 if latest is None else int(latest.properties["batch"]) + 2


def test_a_kill_at_every_step_of_a_timer_round_then_restart_is_exact(tmp_path):
    (tmp_path / "in").mkdir()
    base = str(tmp_path / "job")
    killed_at = {}
    for i, (step, par) in enumerate(STEPS):
        rnd = _next_round(base)
        killed_at[step] = rnd
        rc = _run(tmp_path, i, par, f"timers.{step}@{rnd}=kill", until_rows=10 ** 6)
        assert rc == -signal.SIGKILL, (step, rc, (tmp_path / f"driver-{i}.err").read_text()[-3000:])
    rc = _run(tmp_path, len(STEPS), 2, "", until_rows=len(USERS) + 1)  # + the sink's second call (mid_sink)
    assert rc == 0, (tmp_path / f"driver-{len(STEPS)}.err").read_text()[-3000:]

    expected = {u: f"timed out after {i + 1}" for i, u in enumerate(USERS)}
    from streaming_util import read_output

    out = read_output(os.path.join(base, "output"))
    assert sorted(zip(out["user"], out["message"])) == sorted(expected.items())
    assert out.groupby("user")["batch_id"].nunique().eq(1).all()
    assert not [d for d in os.listdir(os.path.join(base, "output")) if d.startswith("batch_id=")
                and not os.path.exists(os.path.join(base, "output", d, "_SUCCESS"))]
    calls = collections.defaultdict(list)
    for line in (tmp_path / "sink.log").read_text().splitlines():
        b, user, *msg = line.split(" ")
        if user != "-":
            calls[user].append((int(b), msg[0].replace("_", " ")))
    by_folder = dict(zip(out["user"], out["batch_id"]))
    twice = {u for u, c in calls.items() if len(c) == 2}
    assert all(len(c) in (1, 2) for c in calls.values()), calls
    # the round killed between its sink and its marker is delivered again, with the same batch id
    mid_sink_user = [u for u, b in by_folder.items() if b == killed_at["mid_sink"]]
    assert twice == set(mid_sink_user), (calls, killed_at)
    for u, c in calls.items():
        assert set(c) == {(by_folder[u], expected[u])}, (u, c)
    assert set(calls) == set(USERS)
