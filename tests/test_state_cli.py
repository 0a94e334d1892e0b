"""`dstl state ls|show|changes`: tables, --json parsed back, and exit code 2 with one line."""
from __future__ import annotations

import json
import os

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


# ------------------------------------------------------------------ bad checkpoints, verify, schemas

def _break_checkpoint(base: str, cid: int) -> None:
    path = f"{base}/checkpoints/chk-{cid}/_metadata"
    with open(path, "r+b") as f:
        f.truncate(os.path.getsize(path) // 2)


def test_ls_lists_every_readable_checkpoint_and_marks_the_bad_ones(job, capsys):
    from dstl.state.metadata import read_checkpoint

    _break_checkpoint(job.base, 3)
    victim = sorted(read_checkpoint(job.base, 1).files())[0]
    os.unlink(victim)
    code, out, err = _run(capsys, "ls", job.base, "--json")
    assert code == 0, err
    rows = {c["checkpoint_id"]: c for c in json.loads(out)["checkpoints"]}
    assert sorted(rows) == [1, 2, 3]
    assert rows[2]["ok"] and rows[2]["live_keys"] > 0
    assert not rows[3]["ok"] and rows[3]["problem"] == "torn or unreadable _metadata"
    assert "checksum mismatch" in rows[3]["detail"] or "truncated" in rows[3]["detail"]
    assert not rows[1]["ok"] and rows[1]["problem"] == "1 file(s) missing or short"
    assert victim in rows[1]["detail"]
    code, out, _ = _run(capsys, "ls", job.base)
    lines = out.splitlines()
    assert code == 0 and lines[0].split()[-1] == "status" and len(lines) == 4
    assert lines[2].rstrip().endswith(" ok") and "BAD: torn or unreadable _metadata" in lines[3]
    assert "BAD: 1 file(s) missing or short" in lines[1]


def test_verify_checks_every_file_of_the_retained_checkpoints(job, capsys):
    from dstl.state.metadata import read_checkpoint

    code, out, _ = _run(capsys, "verify", job.base)
    assert code == 0 and out.splitlines()[-1] == "3 of 3 checkpoints complete"
    meta = read_checkpoint(job.base, 3)
    short, missing = sorted(meta.files())[:2]
    need = max(f.size for s in meta.subtasks for h in s.materialized + s.changelog
               for f, _ in h.handles_and_offsets if f.path == short)
    with open(short, "r+b") as f:
        f.truncate(need // 2)
    os.unlink(missing)
    code, out, _ = _run(capsys, "verify", job.base, "--json")
    info = json.loads(out)
    assert code == 1 and not info["ok"]
    problems = {c["checkpoint_id"]: c["problems"] for c in info["checkpoints"]}
    assert f"{missing}: missing" in problems[3]
    assert f"{short}: {need // 2} bytes, the checkpoint needs at least {need}" in problems[3]
    code, out, _ = _run(capsys, "verify", job.base)
    assert code == 1 and f"  {missing}: missing" in out.splitlines()


def test_show_a_state_with_a_declared_schema(tmp_path, capsys):
    """Issue 19 8a: every StatefulProcessor state has a declared schema; its fields are columns."""
    from dstl.changelog.storage import open_storage
    from dstl.keygroups import key_group_ranges
    from dstl.state import CheckpointMetadata, KeyedStateBackend, SubtaskState, write_checkpoint
    from dstl.state.schema import StateSchema, ValueSchema

    base = str(tmp_path / "job")
    schema = StateSchema("total", "value", "count long, name string")
    encode = ValueSchema(schema.value.to_record()).encode
    rng = key_group_ranges(16, 1)[0]
    with open_storage(base, upload_mode="direct", job_id="ab" * 16) as storage:
        b = KeyedStateBackend(storage, "op", rng, 16)
        for k in range(5):
            b.value_state("total").update(k, encode((k * 10, f"n{k}")))
        snap = b.snapshot(1).result()
        b.close()
    write_checkpoint(base, CheckpointMetadata(1, 16, 1, [SubtaskState.from_keyed_snapshot(0, snap)],
                                              {"state_schemas": {"total": schema.to_record()}},
                                              job_id="ab" * 16))
    code, out, err = _run(capsys, "show", base, "--state", "total", "--json", "--limit", "0")
    assert code == 0, err
    rows = sorted(json.loads(out), key=lambda r: r["key"])
    assert [(r["key"], r["count"], r["name"]) for r in rows] == [(k, k * 10, f"n{k}") for k in range(5)]
    code, out, _ = _run(capsys, "show", base, "--state", "total", "--key", "3")
    assert code == 0 and out.splitlines()[0].split()[-2:] == ["count", "name"] and " 30 " in out


_CLI_LOOP = r"""
import contextlib, io, json, sys
from dstl import cli
out = []
for argv in json.loads(sys.argv[1]):
    err = io.StringIO()
    with contextlib.redirect_stderr(err), contextlib.redirect_stdout(io.StringIO()):
        try:
            code = cli.main(argv)
        except SystemExit as exc:
            code = exc.code
        except BaseException as exc:
            code = "raised " + type(exc).__name__
    out.append([argv, code, err.getvalue()])
print(json.dumps(out))
"""


def test_every_subcommand_on_an_unreachable_remote_base_exits_2_with_one_line(s3_server, s3_bucket):
    """moto with the credentials removed, a bucket that does not exist, and an endpoint that is down:
    each subcommand exits 2 with one line naming the URL and the cause, no traceback."""
    import subprocess
    import sys

    here = os.path.dirname(os.path.abspath(__file__))
    env = {k: v for k, v in os.environ.items() if not k.startswith("AWS_")}
    env.update(AWS_SHARED_CREDENTIALS_FILE="/nonexistent", AWS_CONFIG_FILE="/nonexistent",
               AWS_EC2_METADATA_DISABLED="true", AWS_DEFAULT_REGION="us-east-1",
               PYTHONPATH=os.path.dirname(here))

    def commands(url):
        return [["state", "ls", url], ["state", "show", url], ["state", "verify", url],
                ["state", "changes", url, "--from", "1", "--to", "2"],
                ["state", "rescale", url, "--max-parallelism", "8"],
                ["gc", url, "--keep-latest", "1"], ["inspect", f"{url}/f"], ["dump", f"{url}/f"],
                ["pipeline", "--base-path", url, "--events", "10", "--batches", "1"]]

    cases = [
        (dict(env, AWS_ENDPOINT_URL=s3_server), f"{s3_bucket}/job", "no credentials found; looked in"),
        (dict(env, AWS_ENDPOINT_URL=s3_server, AWS_ACCESS_KEY_ID="k", AWS_SECRET_ACCESS_KEY="s"),
         "s3://no-such-bucket-dstl/job", "does not exist"),
    ]
    for case_env, url, cause in cases:
        r = subprocess.run([sys.executable, "-c", _CLI_LOOP, json.dumps(commands(url))], env=case_env,
                           capture_output=True, text=True, timeout=300)
        assert r.returncode == 0, r.stderr[-3000:]
        for argv, code, err in json.loads(r.stdout.strip().splitlines()[-1]):
            lines = err.strip().splitlines()
            assert code == 2, (argv, code, err)
            assert len(lines) == 1 and "Traceback" not in err, (argv, err)
            assert url in lines[0] and ("cannot reach" in lines[0] or "does not exist" in lines[0]), (argv, err)
            if argv[0] != "pipeline":
                assert cause in lines[0], (argv, err)
