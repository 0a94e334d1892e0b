"""`dstl gc`: unreferenced, old changelog files go; referenced or young ones stay; dry run by default."""
from __future__ import annotations

import os
import time
import uuid

import pytest

from dstl.cli import main
from dstl.types import KeyGroupRange

KGR = KeyGroupRange(0, 127)


def _write_files(base: str, n: int, job: str):
    """n changelog files (direct mode: one file per persist); returns their changelog handles."""
    from dstl.changelog.storage import open_storage

    handles = []
    with open_storage(base, upload_mode="direct", job_id=job) as s:
        w = s.create_writer("op", KGR)
        for i in range(n):
            w.append(i, b"change %d" % i)
            handles.append(w.persist(i, i + 1).result(20).job_manager_owned_snapshot)
        w.close()
    return handles


def _checkpoint(base: str, cp: int, handles):
    from dstl.state.metadata import CheckpointMetadata, SubtaskState, write_checkpoint

    meta = CheckpointMetadata(cp, 128, 1, [SubtaskState(0, KGR, changelog=handles)])
    return write_checkpoint(base, meta)


def _age(paths, seconds: float):
    t = time.time() - seconds
    for p in paths:
        os.utime(p, (t, t))


def test_gc_local_dry_run_then_delete(tmp_path, capsys):
    base = str(tmp_path / "base")
    job = uuid.uuid4().hex
    h = _write_files(base, 4, job)
    files = [x.handles_and_offsets[0][0].path for x in h]
    manifest = _checkpoint(base, 7, [h[1]])  # checkpoint 7 references file 1 only
    _age(files[:3], 2 * 3600)  # file 3 stays young
    (tmp_path / "base" / job / "dstl" / "notes.txt").write_text("not a changelog file")
    _age([str(tmp_path / "base" / job / "dstl" / "notes.txt")], 2 * 3600)

    assert main(["gc", base, "--keep", manifest]) == 0
    out = capsys.readouterr().out
    assert f"would delete {files[0]}" in out and f"would delete {files[2]}" in out
    assert files[1] not in out and files[3] not in out
    assert "2 files" in out and "dry run" in out
    assert all(os.path.exists(f) for f in files)

    assert main(["gc", base, "--keep", manifest, "--delete"]) == 0
    out = capsys.readouterr().out
    assert f"deleted {files[0]}" in out
    assert [os.path.exists(f) for f in files] == [False, True, False, True]
    assert os.path.exists(tmp_path / "base" / job / "dstl" / "notes.txt")

    # the grace period protects young files; 0 s removes them when nothing retains them
    assert main(["gc", base, "--keep-latest", "1", "--grace", "0 s", "--delete"]) == 0
    assert [os.path.exists(f) for f in files] == [False, True, False, False]


def test_gc_keep_latest_reads_the_newest_checkpoints(tmp_path, capsys):
    base = str(tmp_path / "base")
    job = uuid.uuid4().hex
    h = _write_files(base, 3, job)
    files = [x.handles_and_offsets[0][0].path for x in h]
    _checkpoint(base, 1, [h[0]])
    _checkpoint(base, 2, [h[1]])
    _checkpoint(base, 3, [h[2]])
    _age(files, 7200)
    assert main(["gc", base, "--keep-latest", "2", "--delete"]) == 0
    assert [os.path.exists(f) for f in files] == [False, True, True]
    capsys.readouterr()


def test_gc_refuses_without_retained_checkpoints_and_names_bad_input(tmp_path, capsys):
    base = str(tmp_path / "base")
    assert main(["gc", base]) == 2
    assert "--keep" in capsys.readouterr().err
    assert main(["gc", base, "--keep", str(tmp_path / "missing" / "_metadata")]) == 2
    assert "does not exist" in capsys.readouterr().err
    assert main(["gc", base, "--keep-latest", "1"]) == 2
    assert "no checkpoint" in capsys.readouterr().err
    assert main(["gc", base, "--no-checkpoints", "--grace", "soon"]) == 2
    assert "--grace" in capsys.readouterr().err
    bad = tmp_path / "bad_metadata"
    bad.write_bytes(b"garbage")
    assert main(["gc", base, "--keep", str(bad)]) == 2
    assert capsys.readouterr().err.startswith("dstl gc: error:")


@pytest.mark.s3
def test_gc_on_s3(s3_bucket, capsys):
    base = f"{s3_bucket}/changelog"
    job = uuid.uuid4().hex
    h = _write_files(base, 3, job)
    files = [x.handles_and_offsets[0][0].path for x in h]
    manifest = _checkpoint(base, 1, [h[2]])
    # S3 cannot back-date objects: --grace 0 treats every unreferenced file as old enough
    assert main(["gc", base, "--keep", manifest, "--grace", "0 ms"]) == 0
    out = capsys.readouterr().out
    assert "2 files" in out and "would delete" in out
    import s3fs

    fs = s3fs.S3FileSystem(skip_instance_cache=True)
    assert all(fs.exists(f) for f in files)
    assert main(["gc", base, "--keep", manifest, "--grace", "0 ms", "--delete"]) == 0
    fs.invalidate_cache()
    assert [fs.exists(f) for f in files] == [False, False, True]
    # with the default grace of 1 h nothing is old enough
    assert main(["gc", base, "--no-checkpoints", "--delete"]) == 0
    assert "0 files" in capsys.readouterr().out
    assert fs.exists(files[2])
