"""The uploader's local-disk path: exclusive create, blocks reserved up front for large raw files,
streamed SealedBody bodies, byte-identical to writing the sealed bytes (both implementations)."""
from __future__ import annotations

import os
import uuid

import numpy as np
import pytest

from dstl.format import ChangeBuffer, to_logical, decode_change_set_arrays
from dstl.metrics import ChangelogStorageMetricGroup
from dstl.changelog.registry import TaskChangelogRegistry
from dstl.types import SealedChangeSet
from dstl.changelog.upload.task import UploadTask
from dstl.changelog.upload.uploader import StateChangeFsUploader, _PREALLOCATE_MIN

JOB = "0123456789abcdef0123456789abcdef"


@pytest.fixture
def registry():
    r = TaskChangelogRegistry()
    yield r
    r.close()


def _big_change_set(sqn: int, n: int, seed: int):
    """n changes of 100 bytes over key groups 0..127 (round robin), appended by reference."""
    rng = np.random.default_rng(seed)
    data = rng.integers(0, 256, n * 100, dtype=np.uint8).tobytes()
    kgs = (np.arange(n) % 128).astype(np.int32)
    offs = np.arange(0, n * 100 + 1, 100, dtype=np.int64)
    buf, ref = ChangeBuffer(), ChangeBuffer()
    buf.append_many(kgs, data, offs)
    ref.append_many(kgs, data, offs)
    cs = SealedChangeSet(uuid.UUID(int=1), sqn, buf.seal_body(), buf.size, len(buf))
    return cs, ref.seal()


@pytest.mark.parametrize("compression", [None, "zstd"])
@pytest.mark.parametrize("local_copy", [False, True])
def test_large_upload_has_exact_size_and_content(tmp_path, registry, compression, local_copy):
    cs0, body0 = _big_change_set(0, 30_000, 1)   # 3 MB: above the preallocation threshold
    cs1, body1 = _big_change_set(1, 10, 2)
    assert len(body0) > _PREALLOCATE_MIN
    done = []
    task = UploadTask([cs1, cs0], done.append, lambda sqns, e: done.append(e))
    up = StateChangeFsUploader(str(tmp_path / "remote"), JOB, compression, 1 << 20, registry,
                               ChangelogStorageMetricGroup(), str(tmp_path / "local") if local_copy else None)
    res = up.upload([task])
    res.complete()
    path = res.handle.path
    data = open(path, "rb").read()
    logical = bytes(to_logical(data))
    assert logical == body0 + body1  # sqn order inside the task
    if compression is None:
        assert os.path.getsize(path) == 1 + len(body0) + len(body1)
    assert res.handle.state_size == len(body0) + len(body1)
    kgs, _, lens, end = decode_change_set_arrays(logical, 0)
    assert len(kgs) == 30_000 and end == len(body0) and (lens == 100).all()
    if local_copy:
        assert open(res.local_handle.path, "rb").read() == data
    assert [r.offset for r in done[0]] == [0, len(body0)]


def test_existing_file_is_never_overwritten(tmp_path, registry, monkeypatch):
    cs, _ = _big_change_set(0, 20_000, 3)
    up = StateChangeFsUploader(str(tmp_path), JOB, None, 1 << 20, registry, ChangelogStorageMetricGroup())
    fixed = uuid.UUID(int=42)
    monkeypatch.setattr(uuid, "uuid4", lambda: fixed)
    target = tmp_path / JOB / "dstl" / str(fixed)
    target.parent.mkdir(parents=True)
    target.write_bytes(b"someone else's")
    failures = []
    task = UploadTask([cs], lambda r: None, lambda sqns, e: failures.append(e))
    with pytest.raises(FileExistsError):
        up.upload([task])
    assert target.read_bytes() == b"someone else's"


def _span_sets(tmp_path, sizes):
    """Change sets whose bodies are byte ranges of one file (as the upload service's segments are):
    -> (descriptor, [SealedChangeSet], [body bytes])."""
    from dstl.changelog.upload.uploader import FileSpan

    bodies = [_big_change_set(i, n, 10 + i)[1] for i, n in enumerate(sizes)]
    seg = tmp_path / "segment"
    seg.write_bytes(b"junk" + b"".join(bodies) + b"tail")
    fd = os.open(seg, os.O_RDONLY)
    sets, at = [], 4
    for i, b in enumerate(bodies):
        sets.append(SealedChangeSet(uuid.UUID(int=7), i, FileSpan(fd, at, len(b)), len(b), 1))
        at += len(b)
    return fd, sets, bodies


@pytest.mark.parametrize("compression", [None, "snappy"])
@pytest.mark.parametrize("local_copy", [False, True])
def test_file_span_bodies_give_the_same_files_as_bytes(tmp_path, registry, compression, local_copy):
    """Raw to local disk they are copied piecewise through one buffer, otherwise streamed with pread:
    either way the file is the one the same bodies as bytes give."""
    fd, sets, bodies = _span_sets(tmp_path, [20_000, 3, 0])
    try:
        files = []
        for name, change_sets in (("spans", sets),
                                  ("bytes", [SealedChangeSet(cs.log_id, cs.sequence_number, b, cs.size, 1)
                                             for cs, b in zip(sets, bodies)])):
            up = StateChangeFsUploader(str(tmp_path / name), JOB, compression, 1 << 20, registry,
                                       ChangelogStorageMetricGroup(),
                                       str(tmp_path / f"{name}-local") if local_copy else None)
            res = up.upload([UploadTask(change_sets, lambda r: None, lambda sqns, e: None)])
            data = open(res.handle.path, "rb").read()
            if local_copy:
                assert open(res.local_handle.path, "rb").read() == data
            files.append((data, res.handle.state_size, [off for _, off, _ in res.tasks_offsets[0][1]]))
            res.complete()
        assert files[0] == files[1]
        assert bytes(to_logical(files[0][0])) == b"".join(bodies)
    finally:
        os.close(fd)


def test_a_short_segment_fails_the_attempt_and_leaves_no_file(tmp_path, registry):
    from dstl.changelog.upload.uploader import FileSpan

    fd, sets, bodies = _span_sets(tmp_path, [1000])
    try:
        cs = sets[0]
        cs.body = FileSpan(fd, cs.body.offset, cs.body.length + 100)  # past the segment's end
        up = StateChangeFsUploader(str(tmp_path / "out"), JOB, None, 1 << 20, registry, ChangelogStorageMetricGroup())
        with pytest.raises(EOFError, match="segment ends"):
            up.upload([UploadTask([cs], lambda r: None, lambda sqns, e: None)])
        assert os.listdir(tmp_path / "out" / JOB / "dstl") == []
    finally:
        os.close(fd)


@pytest.mark.parametrize("offset,length", [(10, 20_000), (0, 3 * 1024 + 5), (7, 0)])
def test_file_span_send_to_copies_exactly_across_pieces_and_reuses_its_buffer(tmp_path, monkeypatch, offset,
                                                                              length):
    """send_to copies through one reused piece buffer (smaller here than the span, so several pieces),
    appending at the output's position."""
    from dstl.changelog.upload import uploader as U

    monkeypatch.setattr(U, "SEND_PIECE", 1024)
    monkeypatch.setattr(U, "_pieces", [])
    src = tmp_path / "src"
    src.write_bytes(bytes(range(256)) * 100)
    fd = os.open(src, os.O_RDONLY)
    out = os.open(tmp_path / "dst", os.O_WRONLY | os.O_CREAT)
    try:
        os.write(out, b"head")
        U.FileSpan(fd, offset, length).send_to(out)
        U.FileSpan(fd, 0, 1).send_to(out)
    finally:
        os.close(fd)
        os.close(out)
    data = src.read_bytes()
    assert (tmp_path / "dst").read_bytes() == b"head" + data[offset:offset + length] + data[:1]
    assert len(U._pieces) == 1 and len(U._pieces[0]) == 1024  # one buffer, given back after each copy


@pytest.mark.parametrize("offset", [0, 4099])
def test_file_span_send_to_maps_a_large_span_and_copies_it_exactly(tmp_path, monkeypatch, offset):
    """From MAP_MIN on a span is mapped (MAP_POPULATE) and written in one go, from an offset that need
    not be page-aligned; no piece buffer is used. A span past the segment's end is an EOFError, checked
    before anything is mapped (touching a mapping past the end would be SIGBUS)."""
    from dstl.changelog.upload import uploader as U

    if not U._POPULATE:
        pytest.skip("no MAP_POPULATE on this system: every span goes through the piece buffer")
    monkeypatch.setattr(U, "MAP_MIN", 8192)
    monkeypatch.setattr(U, "_pieces", [])
    src = tmp_path / "src"
    src.write_bytes(os.urandom(70_000))
    fd = os.open(src, os.O_RDONLY)
    out = os.open(tmp_path / "dst", os.O_WRONLY | os.O_CREAT)
    try:
        os.write(out, b"head")
        U.FileSpan(fd, offset, 60_000).send_to(out)
        with pytest.raises(EOFError, match="segment ends at 70000"):
            U.FileSpan(fd, offset, 70_001 - offset).send_to(out)
    finally:
        os.close(fd)
        os.close(out)
    data = src.read_bytes()
    assert (tmp_path / "dst").read_bytes() == b"head" + data[offset:offset + 60_000]
    assert U._pieces == []  # the mapped path took no piece buffer
