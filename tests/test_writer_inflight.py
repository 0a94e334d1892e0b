"""Writer behaviour while uploads are in flight (docs/semantics.md §2, §5, §6).

A hand-driven scheduler holds the writer's upload tasks so the test decides when each one finishes;
the upload itself is the real StateChangeFsUploader writing to tmp_path, with the real registry.
"""
from __future__ import annotations

import threading
import uuid
from concurrent.futures import CancelledError

import pytest

from dstl.errors import WriterClosedError
from dstl.metrics import ChangelogStorageMetricGroup
from dstl.changelog.reader import StateChangelogReader
from dstl.changelog.registry import LocalChangelogRegistry, TaskChangelogRegistry
from dstl.types import KeyGroupRange
from dstl.changelog.upload.scheduler import StateChangeUploadScheduler
from dstl.changelog.upload.uploader import StateChangeFsUploader
from dstl.changelog.writer import FsStateChangelogWriter

KGR = KeyGroupRange(0, 15)
T = 10


class HeldScheduler(StateChangeUploadScheduler):
    """Keeps tasks until the test completes (real upload) or fails them."""

    def __init__(self, uploader):
        self.uploader = uploader
        self.tasks = []

    def upload(self, task):
        self.tasks.append(task)

    def complete(self, i=0):
        self.uploader.upload([self.tasks.pop(i)]).complete()

    def fail(self, exc, i=0):
        self.tasks.pop(i).fail(exc)


@pytest.fixture
def rig(tmp_path):
    registry = TaskChangelogRegistry()
    job = uuid.uuid4().hex
    uploader = StateChangeFsUploader(str(tmp_path), job, None, 1 << 16, registry, ChangelogStorageMetricGroup())
    sched = HeldScheduler(uploader)
    writer = FsStateChangelogWriter(uuid.UUID(int=7), KGR, sched, registry, LocalChangelogRegistry.NO_OP,
                                    preemptive_persist_threshold=1 << 20)
    files = lambda: sorted(p.name for p in (tmp_path / job / "dstl").glob("*"))  # noqa: E731
    yield writer, sched, registry, files
    registry.close()


def test_persist_waits_for_sets_already_in_flight(rig):
    w, sched, _, _ = rig
    w.append(0, b"a")
    f1 = w.persist(0, 1)
    w.append(1, b"b")
    f2 = w.persist(0, 2)  # set 0 is in flight: only set 1 is submitted
    assert [len(t.change_sets) for t in sched.tasks] == [1, 1]
    assert not f1.done() and not f2.done()
    sched.complete(1)  # set 1 first: f2 still needs set 0
    assert not f2.done()
    sched.complete(0)
    h1, h2 = f1.result(T).job_manager_owned_snapshot, f2.result(T).job_manager_owned_snapshot
    assert len(h1.handles_and_offsets) == 1 and len(h2.handles_and_offsets) == 2
    assert h2.handles_and_offsets[0] == h1.handles_and_offsets[0]  # ascending sqn order
    assert h2.checkpointed_size == 2
    changes = list(StateChangelogReader().get_changes(h2))
    assert [(c.key_group, c.data) for c in changes] == [(0, b"a"), (1, b"b")]


def test_failure_fails_the_waiting_persists_and_marks_highest_failed(rig):
    w, sched, _, _ = rig
    w.append(0, b"a")
    f1 = w.persist(0, 1)
    f2 = w.persist(0, 2)
    w.append(1, b"b")
    f3 = w.persist(1, 3)  # does not need set 0
    sched.fail(ValueError("boom"), 0)
    for f in (f1, f2):
        exc = f.exception(T)
        assert isinstance(exc, OSError) and isinstance(exc.__cause__, ValueError)
    assert not f3.done()
    sched.complete(0)
    assert f3.result(T).job_manager_owned_snapshot.state_size == 1
    with pytest.raises(OSError, match="already failed"):
        w.persist(0, 4)
    assert w.persist(1, 5).done()


def test_os_error_is_passed_through_unchanged(rig):
    w, sched, _, _ = rig
    w.append(0, b"a")
    f = w.persist(0, 1)
    err = FileNotFoundError("gone")
    sched.fail(err)
    assert f.exception(T) is err


def test_failure_below_lowest_does_not_block_later_persists(rig):
    w, sched, _, _ = rig
    w.append(0, b"a")
    w.persist(0, 1)
    w.truncate(w.next_sequence_number())
    sched.fail(OSError("late failure of a truncated set"))
    assert w.highest_failed is None
    w.append(1, b"b")
    f = w.persist(1, 2)
    sched.complete()
    assert f.result(T).job_manager_owned_snapshot.state_size == 1


def test_late_result_of_truncated_set_is_released(rig):
    w, sched, registry, files = rig
    w.append(0, b"a")
    w.persist(0, 1)
    w.truncate(w.next_sequence_number())
    sched.complete()
    registry.wait_for_deletions(T)
    assert files() == []
    assert w.uploaded_sequence_numbers() == []


def test_result_for_closed_writer_is_released_through_registry(rig):
    w, sched, registry, files = rig
    w.append(0, b"a")
    f = w.persist(0, 1)
    w.close()
    assert isinstance(f.exception(T), WriterClosedError)
    sched.complete()
    registry.wait_for_deletions(T)
    assert files() == []
    assert registry.tracked() == {}


def test_failure_after_close_is_ignored(rig):
    w, sched, _, _ = rig
    w.append(0, b"a")
    w.persist(0, 1)
    w.close()
    sched.fail(OSError("x"))
    assert w.highest_failed is None


def test_truncate_and_close_releases_late_results_at_or_after_from(rig):
    w, sched, registry, files = rig
    w.append(0, b"a")
    h0 = None
    f0 = w.persist(0, 1)
    sched.complete()
    h0 = f0.result(T).job_manager_owned_snapshot
    w.append(1, b"b")
    w.persist(0, 2)  # set 1 in flight
    w.truncate_and_close(1)
    sched.complete()
    registry.wait_for_deletions(T)
    assert files() == [h0.handles_and_offsets[0][0].path.rsplit("/", 1)[-1]]


def test_callbacks_run_without_the_writer_lock(rig):
    """A done-callback calling back into the writer must not deadlock (docs/semantics.md §2.5)."""
    w, sched, _, _ = rig
    w.append(0, b"a")
    f = w.persist(0, 1)
    seen = []
    f.add_done_callback(lambda fut: seen.append(int(w.next_sequence_number())))
    done = threading.Event()

    def complete():
        sched.complete()
        done.set()

    t = threading.Thread(target=complete)
    t.start()
    t.join(T)
    assert done.is_set() and seen == [1]


def test_close_fails_pending_persists(rig):
    w, sched, _, _ = rig
    w.append(0, b"a")
    futures = [w.persist(0, 1), w.persist(0, 2)]
    w.close()
    for f in futures:
        assert isinstance(f.exception(T), WriterClosedError)


def test_cancelled_upload_fails_the_persist(rig):
    w, sched, _, _ = rig
    w.append(0, b"a")
    f = w.persist(0, 1)
    sched.fail(CancelledError("scheduler closed"))
    exc = f.exception(T)
    assert isinstance(exc, OSError) and isinstance(exc.__cause__, CancelledError)


class _BrokenScheduler(StateChangeUploadScheduler):
    """A scheduler that raises without settling the task (e.g. a dead service connection)."""

    def upload(self, task):
        raise RuntimeError("scheduler is broken")


def test_scheduler_raising_fails_the_task_so_nothing_hangs():
    registry = TaskChangelogRegistry()
    w = FsStateChangelogWriter(uuid.UUID(int=3), KGR, _BrokenScheduler(), registry,
                               LocalChangelogRegistry.NO_OP, preemptive_persist_threshold=1 << 20)
    w.append(0, b"a")
    with pytest.raises(RuntimeError, match="broken"):
        w.persist(0, 1)
    with pytest.raises(OSError, match="already failed"):
        w.persist(0, 2)
    registry.close()


def test_truncate_after_confirm_leaves_the_file_without_untracked_warnings(rig, caplog):
    import logging

    w, sched, registry, files = rig
    w.append(0, b"a")
    f = w.persist(0, 1)
    sched.complete()
    f.result(T)
    nxt = w.next_sequence_number()
    w.confirm(0, nxt, 1)
    with caplog.at_level(logging.WARNING, logger="dstl.changelog.registry"):
        w.truncate(nxt)
        w.close()
    registry.wait_for_deletions(T)
    assert len(files()) == 1
    assert "untracked" not in caplog.text
