"""StateChangeFsUploader: one attempt = one file (docs/semantics.md §7.1, docs/format.md §5, §9)."""
from __future__ import annotations

import os
import uuid

import pytest

from dstl.format import ChangeBuffer, to_logical
from dstl.metrics import ChangelogStorageMetricGroup
from dstl.changelog.registry import TaskChangelogRegistry
from dstl.types import SealedChangeSet
from dstl.changelog.upload.task import UploadTask
from dstl.changelog.upload.uploader import StateChangeFsUploader
from faultyfs import faulty, faulty_url  # noqa: F401

JOB = "0123456789abcdef0123456789abcdef"


def sealed(log_id: int, sqn: int, changes) -> SealedChangeSet:
    buf = ChangeBuffer()
    for kg, data in changes:
        buf.append(kg, data)
    n, size = len(buf), buf.size
    return SealedChangeSet(uuid.UUID(int=log_id), sqn, buf.seal(), size, n)


class Sink:
    """Records task outcomes."""

    def __init__(self):
        self.results, self.failures = [], []

    def task(self, *change_sets):
        return UploadTask(list(change_sets), self.results.append, lambda sqns, e: self.failures.append((sqns, e)))


@pytest.fixture
def registry():
    r = TaskChangelogRegistry()
    yield r
    r.close()


def make(base, registry, compression=None, local=None, metrics=None):
    return StateChangeFsUploader(str(base), JOB, compression, 1 << 10, registry,
                                 metrics or ChangelogStorageMetricGroup(), local)


def test_one_file_per_attempt_with_canonical_name_and_offsets(tmp_path, registry):
    metrics = ChangelogStorageMetricGroup()
    up = make(tmp_path, registry, metrics=metrics)
    sink = Sink()
    a1 = sealed(1, 1, [(3, b"bb")])
    a0 = sealed(1, 0, [(-1, b"M"), (2, b"aaa")])
    b0 = sealed(2, 0, [(5, b"c" * 33)])
    t1, t2 = sink.task(a1, a0), sink.task(b0)
    res = up.upload([t1, t2])
    files = os.listdir(tmp_path / JOB / "dstl")
    assert len(files) == 1
    name = files[0]
    assert str(uuid.UUID(name)) == name and uuid.UUID(name).version == 4
    raw = (tmp_path / JOB / "dstl" / name).read_bytes()
    assert raw[0] == 0
    # task order kept, change sets inside a task by sqn
    expect = a0.body + a1.body + b0.body
    assert raw[1:] == bytes(expect)
    assert res.handle.state_size == len(expect)
    res.complete()
    r1, r2 = sink.results
    assert [(int(r.sequence_number), r.offset, r.size) for r in r1] == [
        (0, 0, 4), (1, len(a0.body), 2)]
    assert [(int(r.sequence_number), r.offset, r.size) for r in r2] == [(0, len(a0.body) + len(a1.body), 33)]
    assert all(r.local_stream_handle is None for r in r1 + r2)
    assert registry.ref_count(res.handle) == 3
    assert metrics.upload_requests.count == 1
    assert metrics.upload_sizes.snapshot()["max"] == len(expect)
    assert metrics.upload_latencies_nanos.snapshot()["min"] > 0
    assert sink.failures == []


@pytest.mark.parametrize("codec,flag", [("snappy", 1), ("zstd", 2)])
def test_compressed_files_have_the_same_logical_offsets(tmp_path, registry, codec, flag):
    up = make(tmp_path, registry, compression=codec)
    sink = Sink()
    sets = [sealed(0, i, [(i, bytes([i]) * 5000)]) for i in range(3)]
    res = up.upload([sink.task(*sets)])
    raw = open(res.handle.path, "rb").read()
    assert raw[0] == flag
    logical = bytes(to_logical(raw))
    assert logical == b"".join(bytes(s.body) for s in sets)
    assert res.handle.state_size == len(logical)
    assert len(raw) < len(logical)  # highly compressible payload


def test_existing_file_is_never_overwritten(tmp_path, registry, monkeypatch):
    import dstl.changelog.upload.uploader as mod

    fixed = uuid.UUID("3f2504e0-4f89-41d3-9a0c-0305e82c3301")
    monkeypatch.setattr(mod.uuid, "uuid4", lambda: fixed)
    d = tmp_path / JOB / "dstl"
    d.mkdir(parents=True)
    (d / str(fixed)).write_bytes(b"someone else's file")
    up = make(tmp_path, registry)
    with pytest.raises(FileExistsError):
        up.upload([Sink().task(sealed(0, 0, [(0, b"x")]))])
    assert (d / str(fixed)).read_bytes() == b"someone else's file"


@pytest.mark.parametrize("fault", ["open", "write", "mid-write", "partial-close", "close"])
def test_failed_attempt_leaves_no_file_and_touches_no_task(tmp_path, registry, faulty, fault):
    metrics = ChangelogStorageMetricGroup()
    up = StateChangeFsUploader(faulty_url(tmp_path), JOB, None, 64, registry, metrics)
    {"open": lambda: faulty.fail_writes(1), "write": lambda: faulty.fail_writes(1, at="write"),
     "mid-write": lambda: faulty.fail_after_bytes(100),
     "partial-close": lambda: faulty.partial_then_fail_at_close(10),
     "close": lambda: faulty.fail_at_close()}[fault]()
    sink = Sink()
    task = sink.task(sealed(0, 0, [(0, b"z" * 1000)]))
    with pytest.raises(OSError):
        up.upload([task])
    assert not task.finished and sink.results == [] and sink.failures == []
    d = tmp_path / JOB / "dstl"
    assert (not d.exists()) or os.listdir(d) == []
    assert registry.tracked() == {}
    assert metrics.upload_requests.count == 1 and metrics.upload_failures.count == 1
    assert metrics.upload_sizes.snapshot()["count"] == 0
    # the next attempt works
    res = up.upload([task])
    assert os.listdir(d) == [os.path.basename(res.handle.path)]
    assert res.handle.path.startswith("faulty://")


def test_local_recovery_writes_an_identical_copy(tmp_path, registry):
    local = tmp_path / "local"
    up = make(tmp_path / "remote", registry, compression="snappy", local=str(local))
    sink = Sink()
    res = up.upload([sink.task(sealed(0, 0, [(1, b"abc" * 100)]), sealed(0, 1, [(2, b"d")]))])
    remote_path, local_path = res.handle.path, res.local_handle.path
    assert local_path == str(local / f"jid_{JOB}" / "taskowned" / os.path.basename(remote_path))
    assert open(remote_path, "rb").read() == open(local_path, "rb").read()
    assert res.local_handle.state_size == res.handle.state_size
    assert registry.ref_count(res.handle) == 2 and registry.ref_count(res.local_handle) == 2
    res.complete()
    [results] = sink.results
    assert [(r.offset, r.local_offset) for r in results] == [(0, 0), (results[1].offset, results[1].offset)]
    assert all(r.local_stream_handle == res.local_handle for r in results)


def test_local_write_error_fails_the_whole_attempt(tmp_path, registry):
    local = tmp_path / "local"
    (local / f"jid_{JOB}").mkdir(parents=True)
    (local / f"jid_{JOB}" / "taskowned").write_bytes(b"blocks the directory")
    up = make(tmp_path / "remote", registry, local=str(local))
    with pytest.raises(OSError):
        up.upload([Sink().task(sealed(0, 0, [(1, b"a")]))])
    d = tmp_path / "remote" / JOB / "dstl"
    assert (not d.exists()) or os.listdir(d) == []


def test_discard_removes_registry_entries_and_both_files(tmp_path, registry):
    up = make(tmp_path / "remote", registry, local=str(tmp_path / "local"))
    res = up.upload([Sink().task(sealed(0, 0, [(1, b"a")]))])
    res.discard()
    assert not os.path.exists(res.handle.path) and not os.path.exists(res.local_handle.path)
    assert registry.tracked() == {}
