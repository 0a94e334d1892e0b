"""The store-fault mechanisms without Spark: a storage and the atomic create on moto's S3 server
behind the fault proxy (tests/s3proxy.py, a separate process stopped by PID). The StatefulStream runs
through the same faults are in tests/test_faults_store.py (heavy)."""
from __future__ import annotations

import uuid

import pytest

from dstl.changelog.storage import open_storage
from dstl.types import KeyGroupRange

KGR = KeyGroupRange(0, 127)


@pytest.fixture
def proxied(s3_server, tmp_path, monkeypatch):
    """(proxy, bucket URL); s3fs in this process reaches moto through the proxy."""
    import fsspec
    import s3fs

    from s3proxy import ProxyProcess

    name = f"dstl-pu-{uuid.uuid4().hex[:10]}"
    s3fs.S3FileSystem(client_kwargs={"endpoint_url": s3_server}, skip_instance_cache=True).mkdir(name)
    proxy = ProxyProcess(s3_server, str(tmp_path))
    monkeypatch.setenv("AWS_ENDPOINT_URL", proxy.endpoint)
    conf = fsspec.config.conf.setdefault("s3", {})
    saved = conf.get("client_kwargs")
    conf["client_kwargs"] = {"endpoint_url": proxy.endpoint}
    s3fs.S3FileSystem.clear_instance_cache()
    try:
        yield proxy, f"s3://{name}"
    finally:
        conf["client_kwargs"] = saved
        s3fs.S3FileSystem.clear_instance_cache()
        proxy.stop()


def _round_trip(base: str, n: int = 6):
    s = open_storage(base, upload_mode="thread", job_id=uuid.uuid4().hex, batch_persist_delay="0 ms",
                     upload_timeout="10 s")
    try:
        w = s.create_writer("op", KGR)
        for i in range(n):
            w.append(i % 128, b"%d" % i * 200)
            h = w.persist(0, i + 1).result(120).job_manager_owned_snapshot
        got = [bytes(c.data) for c in s.create_reader().get_changes(h)]
        w.close()
        return got
    finally:
        s.close()


@pytest.mark.parametrize("faults", [dict(error_rate=0.3, error_codes=[503, 500], seed=3),
                                    dict(reset_rate=0.3, seed=4),
                                    dict(lose_put_answers=2)],
                         ids=["throttled-and-500", "resets", "lost-put-answers"])
def test_persists_ride_through_and_read_back_exactly(proxied, faults):
    proxy, bucket = proxied
    proxy.set(**faults)
    got = _round_trip(f"{bucket}/job")
    assert got == [b"%d" % i * 200 for i in range(6)]
    stats = proxy.stats()
    assert stats["errors"] + stats["resets"] + stats["lost_put_answers"] > 0, stats  # faults did fire


def test_an_atomic_create_whose_answer_was_lost_is_ours_and_another_writers_is_not(proxied):
    import fsspec

    from dstl.changelog import fs as dfs

    proxy, bucket = proxied
    fs, root = fsspec.core.url_to_fs(bucket)
    proxy.set(lose_put_answers=1, lose_match="_metadata")
    assert dfs.create_file(fs, f"{root}/chk-1/_metadata", b"mine") is True
    assert proxy.stats()["lost_put_answers"] == 1  # stored, answer lost, the retry met the object
    assert fs.cat_file(f"{root}/chk-1/_metadata") == b"mine"
    with pytest.raises(FileExistsError):
        dfs.create_file(fs, f"{root}/chk-1/_metadata", b"someone else's")


def _requests(proxy) -> list:
    import os

    path = proxy.control + ".log"
    if not os.path.exists(path):
        return []
    with open(path) as f:
        return [line.split()[1:3] for line in f if line[:1].isdigit()]


@pytest.mark.parametrize("cut_short", [False, True], ids=["once", "redone after a crash"])
def test_output_commit_takes_a_listing_a_copy_per_file_and_one_delete(proxied, cut_short):
    """The driver waits for each request of a batch's output commit in turn, so it counts them:
    P staged files cost 2P + a few requests on S3 (a move per file took 6P + 3). A commit cut short
    after some files is redone to the same output."""
    import types

    import fsspec

    from dstl.spark.coordinator import CheckpointCoordinator, JobSpec

    proxy, bucket = proxied
    base = f"{bucket}/commit"
    coord = CheckpointCoordinator.open(base, JobSpec.new("op", 8, base + "/output"), {"upload.mode": "thread"},
                                       resume=False, output_layout="batch_id={batch}")
    fs = fsspec.filesystem("s3")
    p = 8
    files = []
    for i in range(p):
        staged = f"{base}/output/_staging/batch-000003/part-{i:05d}-tok.parquet"
        fs.pipe_file(staged, b"rows of subtask %d" % i)
        files.append((staged, f"{base}/output/batch_id=3/part-{i:05d}.parquet"))
    meta = types.SimpleNamespace(checkpoint_id=4, properties={"batch": 3, "output": {"batch": 3, "files": files}})
    if cut_short:  # a crash after the first copies: two files in place, their staged copies still there
        for staged, final in files[:2]:
            fs.copy(staged, final)
    before = len(_requests(proxy))
    assert coord.commit_output(meta)
    made = _requests(proxy)[before:]
    fs.invalidate_cache()
    assert sorted(fs.ls(f"{base}/output/batch_id=3", detail=False)) == sorted(
        [f[1][len("s3://"):] for f in files] + [f"{base[len('s3://'):]}/output/batch_id=3/_SUCCESS"])
    for i, (_, final) in enumerate(files):
        assert fs.cat_file(final) == b"rows of subtask %d" % i
    assert not fs.exists(f"{base}/output/_staging/batch-000003")
    copies = [r for r in made if r[0] == "PUT" and "/batch_id%3D3/part-" in r[1]]
    assert len(copies) == p, made
    assert len(made) <= 2 * p + 8, [" ".join(r) for r in made]
    assert not coord.commit_output(meta)  # done: _SUCCESS is there


def test_a_lease_check_on_s3_is_one_listing_and_still_fences_a_takeover(proxied):
    """Once the driver has read its epoch file back, a lease check compares the listing's ETag of
    the newest epoch with its own: one LIST. A takeover (a newer epoch) and an epoch file of the
    same number written by another run (another writer id, another ETag) still fail the check."""
    import fsspec

    from dstl.state.fencing import LEASE_DIR, BasePathInUseError, WriterLease

    proxy, bucket = proxied
    base = f"{bucket}/leased"
    lease = WriterLease.acquire(base, "job-a")
    lease.check()  # the first check reads the record once
    before = len(_requests(proxy))
    lease.check()
    made = _requests(proxy)[before:]
    assert len(made) == 1 and made[0][0] == "GET" and "list-type" in made[0][1], made
    # the lease directory replaced under us by another run's epoch 1
    fs = fsspec.filesystem("s3")
    epoch_file = f"{base}/{LEASE_DIR}/epoch-{lease.epoch:012d}.json"[len("s3://"):]
    fs.pipe_file(epoch_file, b'{"epoch": 1, "writer": "someone-else", "job_id": "job-b"}')
    with pytest.raises(BasePathInUseError, match="job-b"):
        lease.check()
    newer = WriterLease.acquire(base, "job-c")
    with pytest.raises(BasePathInUseError, match="job-c"):
        lease.check()
    newer.check()
