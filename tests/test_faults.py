"""The one fault-injection hook (dstl.spark.faults): syntax, matching, once-markers, the environment."""
from __future__ import annotations

import os
import subprocess
import sys

import pytest

from dstl.spark import faults


def test_parse_syntax_and_errors():
    (f,) = faults.parse("task.mid_batch@3/0=raise:once=/tmp/x")
    assert (f.point, f.batch, f.subtask, f.action, f.once) == ("task.mid_batch", 3, 0, "raise", "/tmp/x")
    (g,) = faults.parse("stream.after_sink=kill")
    assert g.batch is None and g.subtask is None
    assert len(faults.parse("a@1=raise, b@*=kill")) == 2
    with pytest.raises(ValueError, match="no '=<action>'"):
        faults.parse("a@1")
    with pytest.raises(ValueError, match="unknown action 'boom'"):
        faults.parse("a@1=boom")
    with pytest.raises(ValueError, match="must be ints"):
        faults.parse("a@x=raise")


def test_point_fires_only_where_armed_and_once(tmp_path):
    faults.point("stream.after_sink", 1)  # nothing armed: nothing happens
    calls = []
    marker = tmp_path / "m" / "fired"
    with faults.armed(f"task.mid_batch@2/1=raise:once={marker}"):
        faults.point("task.mid_batch", 2, subtask=0)            # other subtask
        faults.point("task.mid_batch", 1, subtask=1)            # other batch
        with pytest.raises(faults.InjectedFault, match=r"task.mid_batch \(batch 2, subtask 1\)"):
            faults.point("task.mid_batch", 2, subtask=1, before=lambda: calls.append("half"))
        faults.point("task.mid_batch", 2, subtask=1, before=lambda: calls.append("again"))  # once
    assert calls == ["half"] and marker.exists()
    faults.point("task.mid_batch", 2, subtask=1)                # disarmed


def test_kill_from_the_environment(tmp_path):
    code = ("from dstl.spark import faults\nfaults.point('stream.after_checkpoint', 1)\nprint('alive')\n"
            "faults.point('stream.after_checkpoint', 2)\nprint('not reached')\n")
    env = dict(os.environ, DSTL_FAULTS="stream.after_checkpoint@2=kill",
               PYTHONPATH=os.path.dirname(os.path.dirname(os.path.abspath(__file__))))
    proc = subprocess.run([sys.executable, "-c", code], capture_output=True, text=True, env=env, timeout=60)
    assert proc.returncode == -9 and proc.stdout == "alive\n"


def test_stall_sleeps_then_goes_on_without_the_crash_side_effect(tmp_path, monkeypatch):
    monkeypatch.setenv("DSTL_FAULTS_STALL_S", "0.3")
    calls = []
    with faults.armed(f"task.mid_batch@4=stall:once={tmp_path / 'stalled'}"):
        import time

        t0 = time.monotonic()
        faults.point("task.mid_batch", 4, subtask=0, before=lambda: calls.append("half"))
        assert time.monotonic() - t0 >= 0.3
        t0 = time.monotonic()
        faults.point("task.mid_batch", 4, subtask=0)            # once: no second stall
        assert time.monotonic() - t0 < 0.3
    assert calls == []  # a stall applies nothing: the task goes on with all its rows
