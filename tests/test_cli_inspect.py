"""`dstl inspect` and `dstl dump` as real subprocesses, on Flink fixtures and through s3:// (moto)."""
from __future__ import annotations

import json
import os
import subprocess
import sys
import uuid

import pytest

from dstl import format as fmt
from dstl.types import StateChange, StateChangeSet

from conftest import FIXTURES, heavy

REPO = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))


def dstl(*args, check=True):
    env = dict(os.environ)
    env["PYTHONPATH"] = REPO + os.pathsep + env.get("PYTHONPATH", "")
    proc = subprocess.run([sys.executable, "-m", "dstl", *args], capture_output=True, text=True,
                          timeout=120, env=env, cwd=REPO)
    if check:
        assert proc.returncode == 0, proc.stderr
    return proc


def _fixture_file(case, name_index=0):
    folder = os.path.join(FIXTURES, case)
    names = sorted(n for n in os.listdir(folder) if not n.endswith(".json"))
    return os.path.join(folder, names[name_index])


def test_inspect_raw_fixture(flink_fixtures):
    out = dstl("inspect", _fixture_file("multi-sqn")).stdout
    assert "compression: raw (flag 0)" in out
    assert "file size: 569 bytes" in out
    assert "logical size: 568 bytes" in out
    assert "change sets: 3 (18 changes, 340 payload bytes)" in out
    rows = [line.split() for line in out.splitlines() if line.strip() and line.split()[0].isdigit()]
    assert [r[0] for r in rows] == ["0", "171", "439"]
    assert rows[0][:5] == ["0", "171", "6", "6", "95"]
    assert rows[0][5] == "-1,2-3,10-12"


def test_inspect_snappy_fixture_json(flink_fixtures):
    with open(os.path.join(FIXTURES, "snappy-random", "case.json")) as f:
        case = json.load(f)
    path = _fixture_file("snappy-random")
    info = json.loads(dstl("inspect", "--json", path).stdout)
    assert info["compression"] == "snappy" and info["flag"] == 1
    meta = case["files"][os.path.basename(path)]
    assert info["file_size"] == meta["disk_size"] and info["logical_size"] == meta["handle_state_size"]
    assert info["snappy_chunks"]["compressed"] > 0 and info["snappy_chunks"]["uncompressed"] > 0
    assert [s["offset"] for s in info["change_sets"]] == [e["offset"] for e in case["handle"]]
    for got, want in zip(info["change_sets"], case["change_sets"]):
        assert got["key_groups"] == want["group_order"]
        assert got["changes"] == want["num_changes"] and got["size"] == want["payload_bytes"]


def test_dump_one_change_set(flink_fixtures):
    out = dstl("dump", _fixture_file("tiny-snappy"), "--offset", "0").stdout
    lines = [line.split() for line in out.splitlines()[2:]]
    assert [(r[1], r[2]) for r in lines] == [("meta", "7"), ("0", "8"), ("0", "8"), ("1", "8"), ("1", "8"),
                                             ("2", "8"), ("2", "8")]
    assert "".join(lines[0][3:]) == b"META-v1".hex()


def test_dump_key_group_filter_and_errors(flink_fixtures):
    out = dstl("dump", _fixture_file("multi-sqn"), "--offset", "171", "--key-groups", "3-8").stdout
    kgs = [line.split()[1] for line in out.splitlines()[2:]]
    assert kgs[0] == "meta" and all(k == "meta" or 3 <= int(k) <= 8 for k in kgs)
    bad = dstl("dump", _fixture_file("multi-sqn"), "--offset", "170", check=False)
    assert bad.returncode == 1 and "corrupt changelog at offset" in bad.stderr
    assert _fixture_file("multi-sqn") in bad.stderr


def test_inspect_reports_corruption_and_missing_files(tmp_path):
    path = tmp_path / "broken"
    data = bytearray(fmt.encode_file([StateChangeSet(uuid.UUID(int=1), 0, [StateChange(2, b"x" * 70000)])],
                                     compression="snappy")[0])
    data[20] ^= 0xFF
    path.write_bytes(bytes(data))
    proc = dstl("inspect", str(path), check=False)
    assert proc.returncode == 1 and "file offset 11" in proc.stderr and str(path) in proc.stderr
    proc = dstl("inspect", str(tmp_path / "missing"), check=False)
    assert proc.returncode == 2 and "cannot read" in proc.stderr


@heavy  # S3
@pytest.mark.s3
def test_inspect_and_dump_through_s3(s3_bucket):
    import fsspec

    sets = [StateChangeSet(uuid.UUID(int=7), i, [StateChange(-1, b"m"), StateChange(i, b"v" * 10)])
            for i in range(3)]
    data, positions = fmt.encode_file(sets, compression="zstd")
    url = f"{s3_bucket}/{'0' * 32}/dstl/{uuid.uuid4()}"
    with fsspec.open(url, "wb") as f:
        f.write(data)
    info = json.loads(dstl("inspect", "--json", url).stdout)
    assert info["compression"] == "zstd" and [s["offset"] for s in info["change_sets"]] == [p for p, _ in positions]
    out = dstl("dump", url, "--all").stdout
    assert out.count("change set at offset") == 3 and out.count("meta") == 3
