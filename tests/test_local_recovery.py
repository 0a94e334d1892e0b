"""Local recovery through the storage (docs/semantics.md §5 result, §6 confirm/reset, §10)."""
from __future__ import annotations

import logging
import os
import uuid

import pytest

from dstl.changelog.storage import open_storage
from dstl.types import KeyGroupRange

T = 20
KGR = KeyGroupRange(0, 7)


@pytest.fixture(params=["direct", "thread"])
def local_storage(request, tmp_path):
    job = uuid.uuid4().hex
    s = open_storage(str(tmp_path / "remote"), upload_mode=request.param, job_id=job,
                     local_recovery_dir=str(tmp_path / "local"))
    try:
        yield s, tmp_path / "local" / f"jid_{job}" / "taskowned"
    finally:
        s.close()


def _names(d):
    return sorted(os.listdir(d)) if d.exists() else []


def test_persist_returns_a_task_local_snapshot(local_storage):
    s, local_dir = local_storage
    w = s.create_writer("op", KGR)
    w.append_meta(b"m")
    w.append(3, b"abc")
    r = w.persist(0, 1).result(T)
    remote, local = r.job_manager_owned_snapshot, r.task_local_snapshot
    assert local is not None and local.checkpointed_size == 0
    assert local.state_size == remote.state_size and local.key_group_range == KGR
    [(rh, roff)] = remote.handles_and_offsets
    [(lh, loff)] = local.handles_and_offsets
    assert roff == loff and os.path.basename(rh.path) == os.path.basename(lh.path)
    assert open(rh.path, "rb").read() == open(lh.path, "rb").read()
    reader = s.create_reader()
    assert [(c.key_group, c.data) for c in reader.get_changes(local)] == [(-1, b"m"), (3, b"abc")]
    assert _names(local_dir) == [os.path.basename(lh.path)]


def test_confirm_of_a_later_checkpoint_deletes_older_local_copies(local_storage):
    s, local_dir = local_storage
    w = s.create_writer("op", KGR)
    w.append(0, b"a")
    r1 = w.persist(0, 1).result(T)
    w.append(1, b"b")
    nxt = w.next_sequence_number()
    r2 = w.persist(0, 2).result(T)
    first = os.path.basename(r1.task_local_snapshot.handles_and_offsets[0][0].path)
    assert len(_names(local_dir)) == 2
    # checkpoint 2 re-registered the first copy, so confirming 2 keeps both ...
    w.confirm(0, nxt, 2)
    s.local_registry.wait_for_deletions(T)
    assert len(_names(local_dir)) == 2
    # ... and confirming checkpoint 3 (which used neither) deletes both local copies
    w.confirm(nxt, nxt, 3)
    s.local_registry.wait_for_deletions(T)
    assert _names(local_dir) == []
    assert first in {os.path.basename(h.path) for h, _ in r2.job_manager_owned_snapshot.handles_and_offsets}
    # the remote files are owned by checkpoint 2 and stay
    assert all(os.path.exists(h.path) for h, _ in r2.job_manager_owned_snapshot.handles_and_offsets)


def test_reset_discards_the_aborted_checkpoints_local_copies(local_storage):
    s, local_dir = local_storage
    w = s.create_writer("op", KGR)
    w.append(0, b"a")
    w.persist(0, 5).result(T)
    assert len(_names(local_dir)) == 1
    w.reset(0, 1, 4)  # discards up to 5 (exclusive): checkpoint 5's copy stays
    s.local_registry.wait_for_deletions(T)
    assert len(_names(local_dir)) == 1
    w.reset(0, 1, 5)  # checkpoint 5 aborted
    s.local_registry.wait_for_deletions(T)
    assert _names(local_dir) == []
    # the remote upload stays reusable
    r = w.persist(0, 6).result(T)
    assert r.job_manager_owned_snapshot.checkpointed_size == 0


def test_truncate_releases_remote_and_local(local_storage):
    s, local_dir = local_storage
    w = s.create_writer("op", KGR)
    w.append(0, b"a")
    r = w.persist(0, 1).result(T)
    w.truncate(w.next_sequence_number())
    s.registry.wait_for_deletions(T)
    assert _names(local_dir) == []
    assert not os.path.exists(r.job_manager_owned_snapshot.handles_and_offsets[0][0].path)


def test_mixed_results_give_no_local_snapshot(tmp_path, caplog):
    """Change sets uploaded before local recovery was available have no local copy: warn, no local snapshot."""
    from dstl.changelog.handles import StreamStateHandle
    from dstl.changelog.upload.task import UploadResult
    from dstl.changelog.writer import FsStateChangelogWriter
    from dstl.changelog.registry import LocalChangelogRegistry, TaskChangelogRegistry

    registry = TaskChangelogRegistry()
    w = FsStateChangelogWriter(uuid.UUID(int=1), KGR, None, registry, LocalChangelogRegistry.NO_OP, 1 << 20,
                               local_recovery=True)
    remote = StreamStateHandle(str(tmp_path / "f"), 10)
    results = {0: UploadResult(remote, None, 0, 0, 0, 1),
               1: UploadResult(remote, StreamStateHandle(str(tmp_path / "l"), 10), 5, 5, 1, 1)}
    with caplog.at_level(logging.WARNING, logger="dstl.changelog.writer"):
        snap = w._build_result(results, 2)
    assert snap.task_local_snapshot is None and "local copy" in caplog.text
    assert snap.job_manager_owned_snapshot.state_size == 2
    registry.close()
