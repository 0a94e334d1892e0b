"""`dstl state ls|show|changes`: tables, --json parsed back, and exit code 2 with one line."""
from __future__ import annotations

import json

import pytest

from dstl import cli
from state_job import StateJob


@pytest.fixture
def job(tmp_path):
    j = StateJob(str(tmp_path / "job"))
    try:
        for i in range(3):
            j.step(materialize=(i == 1))
        yield j
    finally:
        j.close()


def _run(capsys, *argv):
    code = cli.main(["state", *argv])
    out, err = capsys.readouterr()
    return code, out, err


def test_ls(job, capsys):
    code, out, _ = _run(capsys, "ls", job.base)
    assert code == 0
    lines = out.splitlines()
    assert lines[0].split()[:3] == ["id", "time", "(UTC)"] and len(lines) == 4
    code, out, _ = _run(capsys, "ls", job.base, "--json")
    info = json.loads(out)
    last = info["checkpoints"][-1]
    assert [c["checkpoint_id"] for c in info["checkpoints"]] == [1, 2, 3]
    live = {}
    for (name, key), v in job.live.items():
        live[name] = live.get(name, 0) + 1
    assert last["states"] == live
    assert last["live_keys"] == len({key for _, key in job.live})
    assert last["materialized_bytes"] > 0 and last["log_bytes"] > 0 and last["parallelism"] == 2


def test_show(job, capsys):
    code, out, _ = _run(capsys, "show", job.base, "--limit", "0", "--json")
    rows = json.loads(out)
    assert code == 0 and len(rows) == len(job.expected_rows())
    got = sorted((r["key"], r["state"], r["kind"], None if r["user_key"] is None else json.dumps(r["user_key"]),
                  r["position"], None if r["value"] is None else json.dumps(r["value"])) for r in rows)
    assert got == sorted(job.expected_rows())
    code, out, _ = _run(capsys, "show", job.base, "--state", "items", "--key", "u1", "--checkpoint", "2")
    assert code == 0 and all(" items " in line for line in out.splitlines()[1:])
    code, out, _ = _run(capsys, "show", job.base, "--limit", "3")
    assert len(out.splitlines()) == 5 and "--limit 0 prints all" in out


def test_changes(job, capsys):
    code, out, _ = _run(capsys, "changes", job.base, "--from", "1", "--to", "3", "--json")
    rows = json.loads(out)
    assert code == 0
    got = sorted((r["checkpoint_id"], r["key"], r["state"], r["op"]) for r in rows)
    assert got == sorted(c[:4] for c in job.changes if c[0] > 1)
    code, out, _ = _run(capsys, "changes", job.base, "--from", "2", "--to", "3", "--key", "u1")
    assert code == 0 and out.splitlines()[0].split()[:3] == ["checkpoint_id", "key", "key_group"]


@pytest.mark.parametrize("argv,message", [
    (["ls", "{tmp}/none"], "holds no checkpoints"),
    (["show", "{base}", "--state", "nope"], "no state 'nope'"),
    (["show", "{base}", "--checkpoint", "9"], "no checkpoint 9"),
    (["changes", "{base}", "--from", "1", "--to", "7"], "no checkpoint 7"),
    (["changes", "{base}", "--from", "3", "--to", "1"], "must be before"),
])
def test_errors_exit_2_with_one_line(job, capsys, tmp_path, argv, message):
    argv = [a.format(base=job.base, tmp=tmp_path) for a in argv]
    code, out, err = _run(capsys, *argv)
    assert code == 2 and out == ""
    assert len(err.strip().splitlines()) == 1 and message in err and err.startswith("dstl state ")
