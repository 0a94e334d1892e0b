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
