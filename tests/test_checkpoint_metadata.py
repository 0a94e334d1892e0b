"""Checkpoint metadata: round trip, atomic writes (local and moto S3), latest lookup, job ownership, gc set."""
import os
import signal
import subprocess
import sys
import textwrap
import time

import fsspec
import pytest

from conftest import heavy
from dstl.changelog.handles import ChangelogStateHandleStreamImpl, StreamStateHandle
from dstl.keygroups import key_group_ranges
from dstl.state.metadata import (
    MAGIC, CheckpointJobMismatchError, CheckpointMetadata, CorruptCheckpointError, SubtaskState,
    checkpoint_path, latest_checkpoint, list_checkpoints, read_checkpoint, remove_checkpoint,
    retained_files, write_checkpoint,
)
from dstl.state.operator import OperatorListState, UNION, repartition, restore_operator_state, snapshot_operator_state
from dstl.types import KeyGroupRange

JOB = "0123456789abcdef0123456789abcdef"
OTHER_JOB = "fedcba9876543210fedcba9876543210"
REPO = os.path.abspath(os.path.join(os.path.dirname(__file__), ".."))


def _handle(base, kgr, files, offsets=(0, 17)):
    pairs = [(StreamStateHandle(f"{base}/{JOB}/dstl/{f}", 100), off) for f in files for off in offsets]
    return ChangelogStateHandleStreamImpl(pairs, kgr, state_size=123, checkpointed_size=45)


def _metadata(checkpoint_id, base="s3://bucket/x", parallelism=2, max_parallelism=128, job_id=JOB, tag="a"):
    subtasks = []
    for i, r in enumerate(key_group_ranges(max_parallelism, parallelism)):
        subtasks.append(SubtaskState(
            i, r,
            materialized=[_handle(base, r, [f"mat-{tag}-{i}"])],
            changelog=[_handle(base, r, [f"log-{tag}-{i}", f"log-{tag}-{i}b"])],
            operator_state=[snapshot_operator_state([
                OperatorListState("offsets", values=[[i, 100 * checkpoint_id]]),
                OperatorListState("u", UNION, values=[f"sub{i}"])])],
        ))
    return CheckpointMetadata(checkpoint_id, max_parallelism, parallelism, subtasks,
                              {"source": "test", "n": checkpoint_id}, job_id=job_id)


# ------------------------------------------------------------------ record


def test_roundtrip_keeps_everything():
    meta = _metadata(7)
    data = meta.to_bytes()
    assert data.startswith(MAGIC)
    again = CheckpointMetadata.from_bytes(data)
    assert again == meta
    assert again.job_id == JOB and again.checkpoint_id == 7 and again.parallelism == 2
    assert again.properties == {"source": "test", "n": 7}
    assert [s.key_group_range for s in again.subtasks] == [KeyGroupRange(0, 63), KeyGroupRange(64, 127)]
    assert again.subtasks[1].changelog[0].handles_and_offsets == meta.subtasks[1].changelog[0].handles_and_offsets
    units = restore_operator_state(again.subtasks[0].operator_state)
    assert units["offsets"].get() == [[0, 700]] and units["u"].get() == ["sub0"]


def test_files_and_retained_files():
    a, b = _metadata(1, tag="a"), _metadata(2, tag="b")
    assert a.files() == {f"s3://bucket/x/{JOB}/dstl/{n}" for n in
                         ("mat-a-0", "mat-a-1", "log-a-0", "log-a-0b", "log-a-1", "log-a-1b")}
    assert retained_files([a, b]) == a.files() | b.files()
    assert retained_files([]) == set()
    with pytest.raises(TypeError):
        retained_files([object()])


def test_keyed_snapshot_conversion():
    meta = _metadata(3)
    snaps = meta.keyed_snapshots()
    assert [s.key_group_range for s in snaps] == [KeyGroupRange(0, 63), KeyGroupRange(64, 127)]
    assert snaps[0].changelog == meta.subtasks[0].changelog[0]
    back = SubtaskState.from_keyed_snapshot(0, snaps[0], meta.subtasks[0].operator_state)
    assert back == meta.subtasks[0]
    assert len(meta.operator_states()) == 2


def test_operator_state_from_metadata_can_be_rescaled():
    meta = CheckpointMetadata.from_bytes(_metadata(5, parallelism=2).to_bytes())
    new = repartition(meta.operator_states(), 3)
    restored = [restore_operator_state(h) for h in new]
    offsets = sorted(tuple(u) for r in restored for u in r.get("offsets", OperatorListState("o")).get())
    assert offsets == [(0, 500), (1, 500)]
    assert all(r["u"].get() == ["sub0", "sub1"] for r in restored)


@pytest.mark.parametrize("build,match", [
    (lambda: CheckpointMetadata(1, 128, 2, [SubtaskState(0, KeyGroupRange(0, 63))]), "subtasks 0..1"),
    (lambda: CheckpointMetadata(1, 128, 2, [SubtaskState(0, KeyGroupRange(0, 70)),
                                             SubtaskState(1, KeyGroupRange(64, 127))]), "overlap"),
    (lambda: CheckpointMetadata(1, 128, 1, [SubtaskState(0, KeyGroupRange(0, 200))]), "exceeds"),
    (lambda: CheckpointMetadata(1, 128, 200, []), "exceeds max_parallelism"),
    (lambda: CheckpointMetadata(-1, 128, 1, [SubtaskState(0, KeyGroupRange(0, 127))]), "checkpoint_id"),
    (lambda: CheckpointMetadata(1, 40000, 1, [SubtaskState(0, KeyGroupRange(0, 127))]), "32768"),
    (lambda: SubtaskState(0, KeyGroupRange(0, 1), changelog=["nope"]), "ChangelogStateHandleStreamImpl"),
    (lambda: SubtaskState(0, (0, 1)), "KeyGroupRange"),
    (lambda: CheckpointMetadata(1, 128, 1, [SubtaskState(0, KeyGroupRange(0, 127))], job_id=""), "job_id"),
])
def test_invalid_metadata_is_rejected(build, match):
    with pytest.raises(ValueError, match=match):
        build()


def test_operator_only_subtasks_may_have_empty_ranges():
    meta = CheckpointMetadata(1, 128, 2, [SubtaskState(0, KeyGroupRange.EMPTY), SubtaskState(1, KeyGroupRange.EMPTY)])
    assert CheckpointMetadata.from_bytes(meta.to_bytes()) == meta


@pytest.mark.parametrize("mangle", [
    lambda d: d[:-1], lambda d: d[: len(d) // 2], lambda d: d[:5], lambda d: b"",
    lambda d: d[:20] + bytes([d[20] ^ 1]) + d[21:], lambda d: b"PK\x03\x04" + d[4:],
])
def test_damaged_bytes_are_detected(mangle):
    with pytest.raises(CorruptCheckpointError):
        CheckpointMetadata.from_bytes(mangle(_metadata(1).to_bytes()))


# ------------------------------------------------------------------ local filesystem


def test_write_read_local(tmp_path):
    base = str(tmp_path / "job")
    meta = _metadata(1, base=base)
    path = write_checkpoint(base, meta)
    assert path == checkpoint_path(base, 1) == f"{base}/checkpoints/chk-1/_metadata"
    assert os.path.isfile(path)
    assert os.listdir(os.path.dirname(path)) == ["_metadata"]  # no temp file left behind
    assert read_checkpoint(base, 1) == meta
    assert list_checkpoints(base) == [1]
    assert latest_checkpoint(base) == meta


def test_file_url_base(tmp_path):
    base = "file://" + str(tmp_path / "j")
    write_checkpoint(base, _metadata(4))
    assert os.path.isfile(tmp_path / "j" / "checkpoints" / "chk-4" / "_metadata")
    assert latest_checkpoint(base).checkpoint_id == 4


def test_latest_ignores_incomplete_and_corrupt_checkpoints(tmp_path, caplog):
    base = str(tmp_path)
    for cp in (1, 2, 3):
        write_checkpoint(base, _metadata(cp))
    assert latest_checkpoint(base).checkpoint_id == 3
    # chk-9: directory without _metadata (crashed before writing it); only a temp file
    os.makedirs(tmp_path / "checkpoints" / "chk-9")
    (tmp_path / "checkpoints" / "chk-9" / "._metadata.inprogress-x").write_bytes(_metadata(9).to_bytes())
    # chk-8: truncated _metadata; chk-7: garbage; chk-6: another checkpoint's file copied in
    good = _metadata(8).to_bytes()
    for cp, data in ((8, good[:-10]), (7, b"not metadata"), (6, _metadata(5).to_bytes())):
        os.makedirs(tmp_path / "checkpoints" / f"chk-{cp}")
        (tmp_path / "checkpoints" / f"chk-{cp}" / "_metadata").write_bytes(data)
    os.makedirs(tmp_path / "checkpoints" / "not-a-checkpoint")
    assert list_checkpoints(base) == [1, 2, 3, 6, 7, 8]
    with caplog.at_level("WARNING"):
        assert latest_checkpoint(base).checkpoint_id == 3
    assert "skipping checkpoint 8" in caplog.text
    with pytest.raises(CorruptCheckpointError):
        read_checkpoint(base, 8)
    with pytest.raises(CorruptCheckpointError, match="holds checkpoint 5"):
        read_checkpoint(base, 6)
    with pytest.raises(FileNotFoundError, match="no checkpoint 9"):
        read_checkpoint(base, 9)


def test_empty_base_has_no_checkpoints(tmp_path):
    assert list_checkpoints(str(tmp_path / "nothing")) == []
    assert latest_checkpoint(str(tmp_path / "nothing")) is None


def test_completed_checkpoints_are_not_overwritten(tmp_path):
    base = str(tmp_path)
    write_checkpoint(base, _metadata(1, tag="first"))
    with pytest.raises(FileExistsError, match="checkpoint 1"):
        write_checkpoint(base, _metadata(1, tag="second"))
    assert read_checkpoint(base, 1).subtasks[0].materialized[0].files()[0].endswith("mat-first-0")
    write_checkpoint(base, _metadata(1, tag="second"), overwrite=True)
    assert read_checkpoint(base, 1).subtasks[0].materialized[0].files()[0].endswith("mat-second-0")


def test_another_jobs_base_path_is_refused(tmp_path):
    base = str(tmp_path)
    write_checkpoint(base, _metadata(1, job_id=JOB))
    write_checkpoint(base, _metadata(2, job_id=JOB))  # same job continues
    with pytest.raises(CheckpointJobMismatchError, match=JOB):
        write_checkpoint(base, _metadata(3, job_id=OTHER_JOB))
    assert list_checkpoints(base) == [1, 2]
    with pytest.raises(CheckpointJobMismatchError):
        latest_checkpoint(base, job_id=OTHER_JOB)
    assert latest_checkpoint(base, job_id=JOB).checkpoint_id == 2
    assert latest_checkpoint(base).job_id == JOB


def test_remove_checkpoint(tmp_path):
    base = str(tmp_path)
    for cp in (1, 2):
        write_checkpoint(base, _metadata(cp))
    remove_checkpoint(base, 2)
    remove_checkpoint(base, 2)  # already gone: fine
    assert list_checkpoints(base) == [1]
    assert not os.path.exists(tmp_path / "checkpoints" / "chk-2")


def test_killed_writer_never_leaves_a_torn_checkpoint(tmp_path):
    """A process writing large checkpoints in a loop is killed with SIGKILL; every _metadata is whole."""
    base = str(tmp_path)
    script = textwrap.dedent(f"""
        import sys
        sys.path.insert(0, {REPO!r})
        from dstl.state.metadata import CheckpointMetadata, SubtaskState, write_checkpoint
        from dstl.types import KeyGroupRange
        blob = "x" * (4 << 20)
        cp = 1
        while True:
            meta = CheckpointMetadata(cp, 128, 1, [SubtaskState(0, KeyGroupRange(0, 127))], {{"blob": blob}})
            write_checkpoint({base!r}, meta)
            print(cp, flush=True)
            cp += 1
    """)
    proc = subprocess.Popen([sys.executable, "-c", script], stdout=subprocess.PIPE)
    try:
        assert proc.stdout.readline().strip() == b"1"  # at least one checkpoint completed
        time.sleep(0.3)
    finally:
        os.kill(proc.pid, signal.SIGKILL)
        proc.wait(timeout=30)
        proc.stdout.close()
    ids = list_checkpoints(base)
    assert ids and ids == list(range(1, ids[-1] + 1))
    for cp in ids:  # every listed checkpoint is complete and readable
        assert read_checkpoint(base, cp).properties["blob"] == "x" * (4 << 20)
    assert latest_checkpoint(base).checkpoint_id == ids[-1]


# ------------------------------------------------------------------ moto S3


@heavy  # S3: the local tests cover the logic under both builds
@pytest.mark.s3
def test_s3_write_read_latest(s3_bucket):
    base = f"{s3_bucket}/jobs/one"
    metas = [_metadata(cp, base=base) for cp in (1, 2, 3)]
    for m in metas:
        assert write_checkpoint(base, m) == f"{base}/checkpoints/chk-{m.checkpoint_id}/_metadata"
    fs = fsspec.filesystem("s3", skip_instance_cache=True)
    keys = fs.find(base.replace("s3://", ""))
    assert sorted(k.rsplit("/", 2)[-2] + "/" + k.rsplit("/", 1)[-1] for k in keys) == [
        "chk-1/_metadata", "chk-2/_metadata", "chk-3/_metadata"]  # no temp keys left
    assert list_checkpoints(base) == [1, 2, 3]
    assert read_checkpoint(base, 2) == metas[1]
    assert latest_checkpoint(base) == metas[2]
    assert retained_files([read_checkpoint(base, c) for c in (1, 2, 3)]) == set().union(*(m.files() for m in metas))


@heavy  # S3
@pytest.mark.s3
def test_s3_latest_ignores_truncated_and_temp_keys(s3_bucket):
    base = f"{s3_bucket}/jobs/two"
    write_checkpoint(base, _metadata(1))
    fs = fsspec.filesystem("s3", skip_instance_cache=True)
    root = base.replace("s3://", "")
    fs.pipe_file(f"{root}/checkpoints/chk-2/_metadata", _metadata(2).to_bytes()[:-3])  # torn upload
    fs.pipe_file(f"{root}/checkpoints/chk-3/_metadata.inprogress-abc", _metadata(3).to_bytes())  # never moved
    assert list_checkpoints(base) == [1, 2]
    assert latest_checkpoint(base).checkpoint_id == 1
    with pytest.raises(CheckpointJobMismatchError):
        write_checkpoint(base, _metadata(4, job_id=OTHER_JOB))
    write_checkpoint(base, _metadata(4))
    assert latest_checkpoint(base).checkpoint_id == 4
    remove_checkpoint(base, 4)
    assert list_checkpoints(base) == [1, 2]


# ------------------------------------------------------------------ with the real keyed state backend


@pytest.mark.parametrize("new_parallelism", [1, 3])
def test_keyed_and_operator_state_through_a_checkpoint_and_a_rescale(tmp_path, new_parallelism):
    import numpy as np

    from dstl.keygroups import assign_key_groups, operator_indices_for_key_groups
    from dstl.state.backend import KeyedStateBackend
    from dstl.changelog.storage import open_storage

    max_p, base = 128, str(tmp_path)
    users = np.array([f"user-{i}" for i in range(60)], dtype=object)
    owner = operator_indices_for_key_groups(assign_key_groups(users, max_p), max_p, 2)
    expected = {u: i * 10 for i, u in enumerate(users)}
    with open_storage(base + "/changelog", job_id=JOB, upload_mode="direct") as storage:
        subtasks = []
        for i, kgr in enumerate(key_group_ranges(max_p, 2)):
            backend = KeyedStateBackend(storage, "op", kgr, max_p)
            state = backend.value_state("v")
            for u in users[owner == i]:
                state.update(u, expected[u])
            offsets = OperatorListState("offsets", values=[[2 * i, 7], [2 * i + 1, 9]])
            snap = backend.snapshot(1).result()
            subtasks.append(SubtaskState.from_keyed_snapshot(i, snap, [snapshot_operator_state([offsets])]))
            backend.close()
        write_checkpoint(base, CheckpointMetadata(1, max_p, 2, subtasks, job_id=JOB))
        meta = latest_checkpoint(base, job_id=JOB)
        assert retained_files([meta]) and all(f.startswith(base) for f in retained_files([meta]))
        for f in retained_files([meta]):
            assert os.path.isfile(f)

        restored, units = {}, []
        new_ops = repartition(meta.operator_states(), new_parallelism)
        for i, kgr in enumerate(key_group_ranges(max_p, new_parallelism)):
            backend = KeyedStateBackend.restore(storage, "op", kgr, max_p, meta.keyed_snapshots())
            part = dict(backend.value_state("v").items())
            assert not set(part) & set(restored)  # no key restored twice
            restored.update(part)
            backend.close()
            ops = restore_operator_state(new_ops[i])
            units += [tuple(u) for u in ops["offsets"].get()] if "offsets" in ops else []
    assert restored == expected
    assert sorted(units) == [(0, 7), (1, 9), (2, 7), (3, 9)]


def test_concurrent_writers_of_one_checkpoint_id_one_wins(tmp_path):
    """Writers racing for one checkpoint id: exactly one succeeds, the file is whole, no temp files."""
    import threading

    base = str(tmp_path)
    write_checkpoint(base, _metadata(1))
    results = []

    def attempt(tag):
        try:
            write_checkpoint(base, _metadata(2, tag=tag))
            results.append(tag)
        except FileExistsError:
            results.append(None)

    threads = [threading.Thread(target=attempt, args=(f"w{i}",)) for i in range(6)]
    for t in threads:
        t.start()
    for t in threads:
        t.join(timeout=60)
    winners = [r for r in results if r is not None]
    assert len(results) == 6 and len(winners) == 1
    meta = read_checkpoint(base, 2)
    assert meta.subtasks[0].materialized[0].files()[0].endswith(f"mat-{winners[0]}-0")
    assert os.listdir(tmp_path / "checkpoints" / "chk-2") == ["_metadata"]


def test_memory_filesystem_base():
    base = "memory://dstl-test-metadata/job"
    try:
        write_checkpoint(base, _metadata(1))
        write_checkpoint(base, _metadata(2))
        assert list_checkpoints(base) == [1, 2]
        assert latest_checkpoint(base).checkpoint_id == 2
        assert read_checkpoint(base, 1).properties == {"source": "test", "n": 1}
        assert fsspec.filesystem("memory").ls("/dstl-test-metadata/job/checkpoints/chk-2", detail=False) == [
            "/dstl-test-metadata/job/checkpoints/chk-2/_metadata"]
    finally:
        fsspec.filesystem("memory").rm("/dstl-test-metadata", recursive=True)
