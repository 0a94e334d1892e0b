"""The full writer -> persist -> restore cycle against moto's S3 server on 127.0.0.1."""
from __future__ import annotations

import uuid

import pytest

from conftest import heavy

from dstl.changelog.handles import ChangelogStateHandleStreamImpl
from dstl.changelog.storage import FsStateChangelogStorage
from dstl.types import KeyGroupRange

pytestmark = [pytest.mark.s3, heavy]  # the local storage tests cover the logic under both builds
T = 30


def _fs():
    import s3fs

    return s3fs.S3FileSystem(skip_instance_cache=True)


@pytest.mark.parametrize("mode,compression", [("direct", False), ("thread", True)])
def test_write_persist_restore_on_s3(s3_bucket, mode, compression, tmp_path):
    job = uuid.uuid4().hex
    base = f"{s3_bucket}/changelog"
    config = {"dstl.dfs.base-path": base, "dstl.dfs.upload.mode": mode,
              "state.changelog.dstl.dfs.compression.enabled": compression,
              "dstl.dfs.batch.persist-delay": "20 ms", "dstl.dfs.preemptive-persist-threshold": "16kb"}
    expected = {0: [], 1: []}
    with FsStateChangelogStorage(config, job_id=job, local_recovery_dir=str(tmp_path / "local")) as s:
        writers = [s.create_writer(f"op{i}", KeyGroupRange(i * 64, i * 64 + 63)) for i in range(2)]
        for i, w in enumerate(writers):
            w.append_meta(b"schema-v1")
            expected[i].append((-1, b"schema-v1"))
            for j in range(300):  # ~30 KB: pre-emptive uploads happen along the way
                kg = i * 64 + j % 64
                data = b"%d:%d:" % (i, j) + bytes([j % 256]) * 100
                w.append(kg, data)
                expected[i].append((kg, data))
                if j % 100 == 99:
                    w.next_sequence_number()
        results = [w.persist(0, 1).result(T) for w in writers]
        handles = [r.job_manager_owned_snapshot for r in results]
        for h in handles:
            for sh, _ in h.handles_and_offsets:
                assert sh.path.startswith(f"{s3_bucket}/changelog/{job}/dstl/")
        names = _fs().ls(f"{base}/{job}/dstl".replace("s3://", ""))
        assert len(names) >= 2
        # local recovery copies of the same files
        for r in results:
            assert r.task_local_snapshot is not None
            assert len(r.task_local_snapshot.handles_and_offsets) == len(r.job_manager_owned_snapshot.handles_and_offsets)
        # the handles travel as bytes (executor -> driver -> checkpoint metadata)
        handles = [ChangelogStateHandleStreamImpl.from_bytes(h.to_bytes()) for h in handles]
        for w in writers:
            w.close()

    # restore with a fresh storage (new process in real life): read through the download cache
    with FsStateChangelogStorage({"dstl.dfs.base-path": base}) as s2:
        reader = s2.create_reader()
        for i, h in enumerate(handles):
            got = [(c.key_group, bytes(c.data)) for c in reader.get_changes(h)]
            # per change set the writer writes canonical group order; compare per key group
            assert sorted(got, key=lambda c: c[0]) == sorted(expected[i], key=lambda c: c[0])
            assert [d for kg, d in got if kg == i * 64 + 5] == [d for kg, d in expected[i] if kg == i * 64 + 5]
        # rescaling: a handle restricted to half the range yields metadata plus only that half
        half = handles[0].get_intersection(KeyGroupRange(0, 31))
        got = [(c.key_group, bytes(c.data)) for c in reader.get_changes(half)]
        assert got[0] == (-1, b"schema-v1") and all(kg <= 31 for kg, _ in got)
        assert len(got) == 1 + sum(1 for kg, _ in expected[0] if 0 <= kg <= 31)


def test_truncate_deletes_unreferenced_s3_objects(s3_bucket):
    job = uuid.uuid4().hex
    base = f"{s3_bucket}/cl"
    with FsStateChangelogStorage({"dstl.dfs.base-path": base, "dstl.dfs.upload.mode": "thread"}, job_id=job) as s:
        w = s.create_writer("op", KeyGroupRange(0, 1))
        w.append(0, b"a")
        h1 = w.persist(0, 1).result(T).job_manager_owned_snapshot
        w.append(1, b"b")
        nxt = w.next_sequence_number()
        w.persist(0, 2).result(T)
        d = f"{base}/{job}/dstl".replace("s3://", "")
        assert len(_fs().ls(d)) == 2
        w.confirm(0, 1, 2)  # checkpoint 2 owns the first file ...
        w.truncate(nxt)  # ... so only the second one is deleted
        s.registry.wait_for_deletions(T)
        left = _fs().ls(d)
        assert [p.rsplit("/", 1)[-1] for p in left] == [h1.handles_and_offsets[0][0].path.rsplit("/", 1)[-1]]
        w.close()
