"""Restores read each changelog file from this host's local-recovery copy when it has a good one,
and from the base path otherwise, file by file (dstl.changelog.local_recovery, docs/spark.md
"Local recovery"). Real files on the local disk; the base path is another local directory."""
from __future__ import annotations

import os
import subprocess
import time
import sys
import uuid

import pytest

from dstl.changelog import local_recovery as lr
from dstl.changelog.storage import open_storage
from dstl.changelog.upload.service.runtime import sweep_download_caches
from dstl.spark.restore import restore_preferring_local
from dstl.state.backend import KeyedStateBackend
from dstl.types import KeyGroupRange

MAXP = 128
FULL = KeyGroupRange(0, MAXP - 1)
T = 30


def _write_job(tmp_path, mode, batches=3, **options):
    """A job whose checkpoint `batches` references one changelog file per batch, with local copies
    in an owner directory under the host root; returns (remote base, job id, root, snapshot, expected)."""
    root = str(tmp_path / "local")
    lr.ensure_root(root)
    owner = lr.new_owner_dir(root)
    job = uuid.uuid4().hex
    base = str(tmp_path / "remote")
    expected = {}
    with open_storage(base, upload_mode=mode, job_id=job, local_recovery_dir=owner, **options) as st:
        backend = KeyedStateBackend(st, "op", FULL, MAXP)
        counts = backend.value_state("counts")
        snap = None
        for cp in range(1, batches + 1):
            keys = [f"k{i}" for i in range(cp * 7)]
            old = counts.get_many(keys, 0)
            new = [o + i + cp for i, o in enumerate(old)]
            counts.update_many(keys, new)
            expected.update(zip(keys, new))
            snap = backend.snapshot(cp).result(T)
            backend.confirm(cp)
        backend.close()
    return base, job, root, snap, expected


def _restore(base, job, root, snap, **options):
    """Restore in a 'moved' process: a storage of its own that knows the host root, not the owner."""
    with open_storage(base, upload_mode="direct", job_id=job, local_recovery_root=root, **options) as st:
        backend, source = restore_preferring_local(
            st, lambda: KeyedStateBackend.restore(st, "op", FULL, MAXP, [snap]))
        try:
            state = dict(backend.value_state("counts").all_items())
        finally:
            backend.close()
        return state, source, st.local_copies.counters()


def _copies(root, job):
    out = {}
    for owner in os.listdir(root):
        d = os.path.join(root, owner, f"jid_{job}", "taskowned")
        for name in (os.listdir(d) if os.path.isdir(d) else []):
            out[name] = os.path.join(d, name)
    return out


def _remote_files(snap):
    return [stream.path for h in snap.handles() for stream, _ in h.handles_and_offsets]


@pytest.mark.parametrize("mode", ["direct", "thread"])
def test_restore_prefers_the_local_copy(tmp_path, mode):
    base, job, root, snap, expected = _write_job(tmp_path, mode)
    files = sorted(set(_remote_files(snap)))
    assert len(files) == 3 and sorted(_copies(root, job)) == sorted(os.path.basename(f) for f in files)
    state, source, counters = _restore(base, job, root, snap)
    assert state == expected and source == "local"
    assert counters["hits"] == 3 and counters["misses"] == 0
    # proof that the copies were read: without the base path's files the restore is still exact
    for f in files:
        os.remove(f)
    state, source, _ = _restore(base, job, root, snap)
    assert state == expected and source == "local"


@pytest.mark.parametrize("mode", ["direct", "thread"])
def test_short_or_missing_copies_fall_back_to_the_base_path_file_by_file(tmp_path, mode):
    base, job, root, snap, expected = _write_job(tmp_path, mode)
    copies = _copies(root, job)
    first, second, _ = [copies[os.path.basename(f)] for f in _remote_files(snap)]
    with open(first, "r+b") as f:  # a copy cut short (a crash while it was written)
        f.truncate(os.path.getsize(first) - 3)
    os.remove(second)  # and one that is gone
    state, source, counters = _restore(base, job, root, snap)
    assert state == expected and source == "local+dfs"
    assert (counters["hits"], counters["misses"], counters["rejected"]) == (1, 2, 1)
    for path in _copies(root, job).values():
        os.remove(path)
    state, source, _ = _restore(base, job, root, snap)
    assert state == expected and source == "dfs"


@pytest.mark.parametrize("codec", ["snappy", "zstd"])
def test_a_corrupt_compressed_copy_is_detected_by_its_checksums(tmp_path, codec):
    base, job, root, snap, expected = _write_job(tmp_path, "direct", compression_enabled=True,
                                                 compression_codec=codec)
    copies = _copies(root, job)
    victim = copies[os.path.basename(_remote_files(snap)[2])]
    data = bytearray(open(victim, "rb").read())
    data[len(data) // 2] ^= 0x5A  # same length, one byte flipped
    with open(victim, "wb") as f:
        f.write(data)
    state, source, counters = _restore(base, job, root, snap)
    assert state == expected and source == "local+dfs" and counters["rejected"] == 1


@pytest.mark.parametrize("mode", ["direct", "thread"])
def test_a_raw_copy_that_decodes_wrong_is_deleted_and_the_restore_reads_the_base_path(tmp_path, mode):
    """Raw files carry no checksum: a copy of the right length whose change-set structure is broken
    fails the restore, which then deletes the copies it read and runs again from the base path."""
    base, job, root, snap, expected = _write_job(tmp_path, mode)
    copies = _copies(root, job)
    victim = copies[os.path.basename(_remote_files(snap)[1])]
    size = os.path.getsize(victim)
    with open(victim, "r+b") as f:
        f.seek(1)
        f.write(b"\xff" * (size - 1))  # flag byte kept (raw), every structure field broken
    state, source, counters = _restore(base, job, root, snap)
    assert state == expected and source == "dfs"
    assert counters["hits"] >= 1  # the first attempt read the copies ...
    assert os.path.basename(victim) not in _copies(root, job)  # ... and the bad one is gone


def test_copies_of_dead_owners_are_swept_and_live_ones_kept(tmp_path):
    root = str(tmp_path / "local")
    lr.ensure_root(root)
    assert os.stat(root).st_mode & 0o777 == 0o700
    mine = lr.new_owner_dir(root)
    child = subprocess.Popen([sys.executable, "-c", "import os; print(os.getpid())"], stdout=subprocess.PIPE)
    dead_pid = int(child.communicate()[0])
    dead = os.path.join(root, f"{lr.OWNER_PREFIX}{dead_pid}-deadbeef")
    os.makedirs(os.path.join(dead, "jid_x", "taskowned"))
    open(os.path.join(dead, "jid_x", "taskowned", "f"), "wb").close()
    # a dead owner that wrote recently is kept for the retry of the task it died in (a killed slot) ...
    assert sweep_download_caches(root, lr.OWNER_PREFIX, grace_s=600) == 0
    assert sorted(os.listdir(root)) == sorted([os.path.basename(mine), os.path.basename(dead)])
    # ... and swept once it is older than the grace
    for d, _, _ in os.walk(dead):
        os.utime(d, (time.time() - 700, time.time() - 700))
    assert sweep_download_caches(root, lr.OWNER_PREFIX, grace_s=600) == 1
    assert os.listdir(root) == [os.path.basename(mine)]


def test_prune_keeps_only_the_referenced_copies_of_its_job(tmp_path):
    owner = str(tmp_path / "owner")
    for job, names in (("a" * 32, ("f1", "f2", "f3")), ("b" * 32, ("g1",))):
        d = os.path.join(owner, f"jid_{job}", "taskowned")
        os.makedirs(d)
        for n in names:
            open(os.path.join(d, n), "wb").close()
    assert lr.prune(owner, "a" * 32, {"f2"}) == 2
    assert os.listdir(os.path.join(owner, f"jid_{'a' * 32}", "taskowned")) == ["f2"]
    assert os.listdir(os.path.join(owner, f"jid_{'b' * 32}", "taskowned")) == ["g1"]


def test_configured_root(monkeypatch, tmp_path):
    monkeypatch.delenv(lr.ENV, raising=False)
    assert lr.configured_root() == lr.default_root()
    assert lr.configured_root({lr.ENV: "off"}) is None
    assert lr.configured_root({lr.ENV: str(tmp_path)}) == str(tmp_path)
