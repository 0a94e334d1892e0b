"""Handles: file access through fsspec, get_intersection (SEMANTICS §11), msgpack round trip."""
from __future__ import annotations

import pickle

import fsspec
import msgpack
import pytest

from dstl.changelog.handles import ChangelogStateHandleStreamImpl, SnapshotResult, StreamStateHandle
from dstl.types import KeyGroupRange


def _file(tmp_path, name: str, data: bytes) -> str:
    p = tmp_path / name
    p.write_bytes(data)
    return str(p)


def test_stream_handle_local_path_and_url(tmp_path):
    path = _file(tmp_path, "f1", b"\x00abc")
    for p in (path, "file://" + path):
        h = StreamStateHandle(p, 3)
        assert h.handle_id == p and h.state_size == 3 and h.size == 3 and h.get_state_size() == 3
        assert h.read_bytes() == b"\x00abc"
        with h.open() as f:
            assert f.read() == b"\x00abc"
    h = StreamStateHandle(path, 3)
    h.discard_state()
    assert not (tmp_path / "f1").exists()
    h.discard_state()  # already gone: fine


def test_stream_handle_memory_fs():
    url = "memory://dstl-handles-test/file"
    fsspec.filesystem("memory").pipe(url, b"\x00xyz")
    h = StreamStateHandle(url, 3)
    assert h.read_bytes() == b"\x00xyz"
    h.discard_state()
    assert not fsspec.filesystem("memory").exists(url)


def test_stream_handle_validation_and_equality(tmp_path):
    with pytest.raises(ValueError):
        StreamStateHandle("", 1)
    with pytest.raises(ValueError):
        StreamStateHandle("/x", -1)
    with pytest.raises(ValueError):
        StreamStateHandle("/x", 1.0)
    with pytest.raises(ValueError):
        StreamStateHandle(None, 1)
    assert StreamStateHandle(tmp_path / "a", 1).path == str(tmp_path / "a")  # PathLike accepted
    assert StreamStateHandle("/x", 1) == StreamStateHandle("/x", 1)
    assert StreamStateHandle("/x", 1) != StreamStateHandle("/x", 2)
    assert len({StreamStateHandle("/x", 1), StreamStateHandle("/x", 1)}) == 1
    assert pickle.loads(pickle.dumps(StreamStateHandle("/x", 1))) == StreamStateHandle("/x", 1)
    assert "'/x'" in repr(StreamStateHandle("/x", 1))
    with pytest.raises(FileNotFoundError):
        StreamStateHandle(str(tmp_path / "missing"), 1).read_bytes()


def _handle(kgr=KeyGroupRange(0, 9), **kw):
    a, b = StreamStateHandle("s3://bucket/job/dstl/a", 100), StreamStateHandle("/local/b", 40)
    return ChangelogStateHandleStreamImpl([(a, 0), (a, 60), (b, 7)], kgr, 140, **kw)


def test_changelog_handle_fields():
    h = _handle(checkpointed_size=60, state_handle_id="id-1")
    assert [o for _, o in h.handles_and_offsets] == [0, 60, 7]
    assert h.key_group_range == KeyGroupRange(0, 9) and h.get_key_group_range() == KeyGroupRange(0, 9)
    assert (h.state_size, h.checkpointed_size, h.storage_identifier, h.state_handle_id) == \
        (140, 60, "filesystem", "id-1")
    assert h.files() == ["s3://bucket/job/dstl/a", "/local/b"] and len(h) == 3
    assert h.get_handles_and_offsets() == h.handles_and_offsets
    h.handles_and_offsets.clear()  # a copy: the handle is unchanged
    assert len(h) == 3
    assert _handle().state_handle_id != _handle().state_handle_id  # fresh random ids


def test_changelog_handle_validation():
    s = StreamStateHandle("/x", 1)
    with pytest.raises(ValueError, match=r"handles_and_offsets\[0\]"):
        ChangelogStateHandleStreamImpl([s], KeyGroupRange(0, 1), 0)
    with pytest.raises(ValueError, match="StreamStateHandle"):
        ChangelogStateHandleStreamImpl([("/x", 0)], KeyGroupRange(0, 1), 0)
    with pytest.raises(ValueError, match="offset"):
        ChangelogStateHandleStreamImpl([(s, -1)], KeyGroupRange(0, 1), 0)
    with pytest.raises(ValueError, match="key_group_range"):
        ChangelogStateHandleStreamImpl([(s, 0)], (0, 1), 0)
    with pytest.raises(ValueError, match="state_size"):
        ChangelogStateHandleStreamImpl([(s, 0)], KeyGroupRange(0, 1), -3)


def test_get_intersection():
    h = _handle(KeyGroupRange(10, 20), checkpointed_size=5)
    r = h.get_intersection(KeyGroupRange(15, 40))
    assert r.key_group_range == KeyGroupRange(15, 20)
    assert r.handles_and_offsets == h.handles_and_offsets  # files are never split
    assert (r.state_size, r.checkpointed_size) == (0, 0)
    assert r.state_handle_id != h.state_handle_id and r.storage_identifier == h.storage_identifier
    assert h.get_intersection(KeyGroupRange(0, 9)) is None
    assert h.get_intersection(KeyGroupRange(21, 30)) is None
    assert h.get_intersection(KeyGroupRange.EMPTY) is None
    assert h.get_intersection(KeyGroupRange(20, 20)).key_group_range == KeyGroupRange(20, 20)
    assert h.get_intersection(KeyGroupRange(0, 100)).key_group_range == KeyGroupRange(10, 20)
    with pytest.raises(ValueError):
        h.get_intersection((0, 5))


def test_bytes_round_trip_and_equality():
    h = _handle(checkpointed_size=33)
    data = h.to_bytes()
    back = ChangelogStateHandleStreamImpl.from_bytes(data)
    assert back == h and hash(back) == hash(h)
    assert back.handles_and_offsets == h.handles_and_offsets and back.key_group_range == h.key_group_range
    d = msgpack.unpackb(data)
    assert len(d["files"]) == 2 and d["entries"] == [[0, 0], [0, 60], [1, 7]]  # files stored once
    assert pickle.loads(pickle.dumps(h)) == h
    other = ChangelogStateHandleStreamImpl(h.handles_and_offsets, h.key_group_range, h.state_size,
                                           h.checkpointed_size)
    assert other != h  # different id
    empty = ChangelogStateHandleStreamImpl([], KeyGroupRange.EMPTY, 0)
    assert ChangelogStateHandleStreamImpl.from_bytes(empty.to_bytes()) == empty
    assert "entries=3" in repr(h) and "KeyGroupRange(0, 9)" in repr(h)


@pytest.mark.parametrize("bad", [b"", b"\xc1", msgpack.packb([1, 2]), msgpack.packb({"type": "other"}),
                                 msgpack.packb({"type": "changelog-stream", "v": 99}),
                                 msgpack.packb({"type": "changelog-stream", "v": 1, "files": []})])
def test_from_bytes_rejects_garbage(bad):
    with pytest.raises(ValueError, match="changelog handle"):
        ChangelogStateHandleStreamImpl.from_bytes(bad)


def test_snapshot_result():
    h = _handle()
    r = SnapshotResult(h)
    assert r.job_manager_owned_snapshot is h and r.task_local_snapshot is None
    assert r.get_job_manager_owned_snapshot() is h
    assert SnapshotResult.of(h) == r and SnapshotResult.empty().job_manager_owned_snapshot is None
    local = _handle()
    assert SnapshotResult(h, local).task_local_snapshot is local
