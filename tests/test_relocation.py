"""Relocatable jobs: files under the base path are stored relative to it, so a copied or moved base
path resumes from its new place; metadata and job files of the absolute-path format still read."""
from __future__ import annotations

import argparse
import io
import json
import os
import shutil

import msgpack
import pytest

from conftest import heavy

from dstl.changelog.handles import ChangelogStateHandleStreamImpl, StreamStateHandle
from dstl.state.metadata import (MAGIC, CheckpointMetadata, SubtaskState, base_of_metadata_file,
                                 list_checkpoints, read_checkpoint, write_checkpoint)
from dstl.state.relpaths import is_relative, relative_to, resolve
from dstl.types import KeyGroupRange

JOB = "0123456789abcdef0123456789abcdef"
SMALL = ["--events", "3000", "--batches", "4", "--users", "200", "--items", "40", "--materialize-every", "800"]


def _meta(base, cid=1, outside="s3://elsewhere/f"):
    files = [StreamStateHandle(f"{base}/{JOB}/dstl/a", 10), StreamStateHandle(outside, 5)]
    h = ChangelogStateHandleStreamImpl([(files[0], 0), (files[1], 3)], KeyGroupRange(0, 127), 15)
    return CheckpointMetadata(cid, 128, 1, [SubtaskState(0, KeyGroupRange(0, 127), changelog=[h])], {"batch": 0},
                              job_id=JOB)


def test_relative_paths_round_trip():
    assert relative_to("/data/run", "/data/run/x/y") == "x/y"
    assert relative_to("/data/run", "/data/runner/x") == "/data/runner/x"  # a sibling, not a child
    assert relative_to("s3://b/run", "s3://b/run/j/dstl/f") == "j/dstl/f"
    assert relative_to("s3://b/run", "s3://c/run/j/dstl/f") == "s3://c/run/j/dstl/f"
    assert relative_to("/data/run", "s3://b/run/x") == "s3://b/run/x"
    assert resolve("s3://new/base", "j/dstl/f") == "s3://new/base/j/dstl/f"
    assert resolve("/new", "j/f") == "/new/j/f"
    assert resolve("/new", "s3://b/k") == "s3://b/k" and not is_relative("/abs") and is_relative("a/b")
    assert base_of_metadata_file("s3://b/run/checkpoints/chk-7/_metadata") == "s3://b/run"
    with pytest.raises(ValueError, match="chk-<id>"):
        base_of_metadata_file("/x/_metadata")


def test_metadata_stores_relative_paths_and_resolves_them_where_it_is_read(tmp_path):
    old, new = tmp_path / "old", tmp_path / "new"
    meta = _meta(str(old))
    path = write_checkpoint(str(old), meta)
    with open(path, "rb") as f:
        raw = msgpack.unpackb(f.read()[len(MAGIC):-4], raw=False)
    stored = ChangelogStateHandleStreamImpl.from_bytes(raw["subtasks"][0]["changelog"][0]).files()
    assert raw["v"] == 1 and stored == [f"{JOB}/dstl/a", "s3://elsewhere/f"]
    assert read_checkpoint(str(old), 1) == meta
    shutil.copytree(old, new)
    moved = read_checkpoint(str(new), 1)
    assert moved.files() == {f"{new}/{JOB}/dstl/a", "s3://elsewhere/f"}
    # without a base the stored form comes back unresolved
    with open(path, "rb") as f:
        assert CheckpointMetadata.from_bytes(f.read()).files() == set(stored)


def test_absolute_path_metadata_still_reads(tmp_path):
    base = str(tmp_path)
    meta = _meta(base)
    d = meta.to_dict()  # absolute paths, as metadata was written before
    body = msgpack.packb(d, use_bin_type=True)
    import struct
    import zlib

    os.makedirs(tmp_path / "checkpoints" / "chk-1")
    with open(tmp_path / "checkpoints" / "chk-1" / "_metadata", "wb") as f:
        f.write(MAGIC + body + struct.pack(">I", zlib.crc32(body)))
    assert read_checkpoint(base, 1) == meta


# ------------------------------------------------------------------ the pipeline, relocated

def _run(spark, *argv):
    from dstl.app import pipeline

    p = argparse.ArgumentParser()
    pipeline.add_arguments(p)
    opts = pipeline.check_options(p.parse_args(["--quiet", *argv]))
    return pipeline.run_pipeline(opts, spark=spark, stream=io.StringIO())


@pytest.mark.spark
@heavy
def test_copied_base_path_resumes_after_the_original_is_deleted(spark, tmp_path):
    old, new = tmp_path / "old", tmp_path / "copy"
    first = _run(spark, *SMALL, "--base-path", str(old), "--stop-at", "1")
    assert first.batches == 2
    with open(old / "_dstl_job.json") as f:
        assert json.load(f)["output_path"] == "output"
    shutil.copytree(old, new)
    shutil.rmtree(old)
    report = _run(spark, *SMALL, "--base-path", str(new), "--resume", "--verify")
    assert report.first_batch == 2 and report.batches == 2
    assert report.verify == [], report.render()
    assert not old.exists()
    assert all(str(new) in f for f in read_checkpoint(str(new), list_checkpoints(str(new))[-1]).files())


@pytest.mark.spark
@heavy  # test_absolute_path_metadata_still_reads covers reading old metadata under both builds
def test_absolute_path_job_is_upgraded_by_a_resume(spark, tmp_path):
    """A job written in the old format (absolute paths everywhere) resumes in place, and the resume
    writes the job file and the next checkpoint in the relative form."""
    import struct
    import zlib

    base = tmp_path / "job"
    _run(spark, *SMALL, "--base-path", str(base), "--stop-at", "1")
    for cid in list_checkpoints(str(base)):  # rewrite with absolute paths, as before
        meta = read_checkpoint(str(base), cid)
        d = meta.to_dict()
        d["properties"]["output"]["files"] = [[resolve(str(base), a), resolve(str(base), b)]
                                              for a, b in d["properties"]["output"]["files"]]
        body = msgpack.packb(d, use_bin_type=True)
        with open(base / "checkpoints" / f"chk-{cid}" / "_metadata", "wb") as f:
            f.write(MAGIC + body + struct.pack(">I", zlib.crc32(body)))
    job_file = base / "_dstl_job.json"
    spec = json.loads(job_file.read_text())
    spec["output_path"] = str(base / "output")
    job_file.write_text(json.dumps(spec))
    report = _run(spark, *SMALL, "--base-path", str(base), "--resume", "--verify")
    assert report.verify == [], report.render()
    assert json.loads(job_file.read_text())["output_path"] == "output"
    with open(base / "checkpoints" / f"chk-{list_checkpoints(str(base))[-1]}" / "_metadata", "rb") as f:
        raw = msgpack.unpackb(f.read()[len(MAGIC):-4], raw=False)
    stored = {p for s in raw["subtasks"] for b in s["materialized"] + s["changelog"]
              for p in ChangelogStateHandleStreamImpl.from_bytes(b).files()}
    assert stored and all(p.startswith(f"{spec['job_id']}/dstl/") for p in stored)


@pytest.mark.spark
@pytest.mark.s3
@heavy  # the local relocation test covers the same logic under both builds
def test_base_path_copied_between_s3_buckets(spark, s3_server):
    import uuid

    import s3fs

    fs = s3fs.S3FileSystem(client_kwargs={"endpoint_url": s3_server}, skip_instance_cache=True)
    a, b = f"dstl-reloc-a-{uuid.uuid4().hex[:8]}", f"dstl-reloc-b-{uuid.uuid4().hex[:8]}"
    fs.mkdir(a)
    fs.mkdir(b)
    try:
        _run(spark, *SMALL, "--base-path", f"s3://{a}/job", "--stop-at", "1")
        fs.copy(f"{a}/job", f"{b}/moved", recursive=True)
        fs.rm(f"{a}/job", recursive=True)
        fs.invalidate_cache()
        report = _run(spark, *SMALL, "--base-path", f"s3://{b}/moved", "--resume", "--verify")
        assert report.first_batch == 2 and report.verify == [], report.render()
        files = read_checkpoint(f"s3://{b}/moved", list_checkpoints(f"s3://{b}/moved")[-1]).files()
        assert files and all(f.startswith(f"s3://{b}/moved/") for f in files)
    finally:
        for name in (a, b):
            try:
                fs.rm(name, recursive=True)
            except FileNotFoundError:
                pass
