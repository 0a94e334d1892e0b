"""TaskChangelogRegistry (SEMANTICS §9) and LocalChangelogRegistry (§10) on real files."""
from __future__ import annotations

import logging
import threading

import pytest

from dstl.changelog.handles import StreamStateHandle
from dstl.changelog import registry
from dstl.changelog.registry import LocalChangelogRegistry, TaskChangelogRegistry


def _file(tmp_path, name):
    p = tmp_path / name
    p.write_bytes(b"\x00data")
    return StreamStateHandle(str(p), 4), p


def test_deleted_after_exactly_the_last_release(tmp_path):
    h, p = _file(tmp_path, "a")
    with TaskChangelogRegistry() as reg:
        reg.start_tracking(h, 2)
        assert reg.ref_count(h) == 2
        reg.release(h)
        assert reg.wait_for_deletions(5)
        assert p.exists() and reg.ref_count(h) == 1
        reg.release(h)
        assert reg.wait_for_deletions(5)
        assert not p.exists() and reg.ref_count(h) is None


def test_stop_tracking_means_never_deleted(tmp_path, caplog):
    h, p = _file(tmp_path, "a")
    reg = TaskChangelogRegistry()
    reg.start_tracking(h, 2)
    reg.stop_tracking(h)
    with caplog.at_level(logging.WARNING, logger="dstl.changelog.registry"):
        reg.release(h)
        reg.release(h)
    reg.close()
    assert p.exists()
    assert "untracked" in caplog.text


def test_start_tracking_validates_and_overwrites(tmp_path):
    h, p = _file(tmp_path, "a")
    reg = TaskChangelogRegistry()
    for bad in (0, -1, True, 1.5):
        with pytest.raises(ValueError):
            reg.start_tracking(h, bad)
    reg.start_tracking(h, 3)
    reg.start_tracking(h, 1)  # overwrites
    reg.release(h)
    reg.close()
    assert not p.exists()
    with pytest.raises(ValueError):
        TaskChangelogRegistry(0)


def test_release_by_an_equal_handle_object(tmp_path):
    h, p = _file(tmp_path, "a")
    reg = TaskChangelogRegistry()
    reg.start_tracking(h, 1)
    reg.release(StreamStateHandle(h.path, 4))  # identity is the path
    reg.close()
    assert not p.exists()


@pytest.fixture
def short_retries(monkeypatch):
    """The retry schedule's shape (4 retries), not its 8.5 s of waiting."""
    monkeypatch.setattr(registry, "DELETE_RETRY_DELAYS_S", (0.001, 0.004, 0.016, 0.064))


def test_deletion_runs_on_the_discard_pool_and_errors_are_logged(tmp_path, caplog, short_retries):
    h, _ = _file(tmp_path, "a")
    started, proceed = threading.Event(), threading.Event()
    threads = []

    def slow_discard(handle):
        threads.append(threading.current_thread().name)
        started.set()
        proceed.wait(5)
        raise OSError("disk on fire")

    reg = TaskChangelogRegistry(2, discard=slow_discard)
    reg.start_tracking(h, 1)
    with caplog.at_level(logging.WARNING):
        reg.release(h)  # returns while the deletion is still running
        assert started.wait(5)
        assert not reg.wait_for_deletions(0.05)
        proceed.set()
        reg.close()  # waits for scheduled deletions
    assert threads and threads[0] != threading.current_thread().name and "dstl-discard" in threads[0]


def test_default_discard_logs_failures(tmp_path, caplog, short_retries):
    class Broken(StreamStateHandle):
        def discard_state(self):
            raise PermissionError("read-only")

    reg = TaskChangelogRegistry()
    h = Broken(str(tmp_path / "x"), 1)
    reg.start_tracking(h, 1)
    with caplog.at_level(logging.WARNING, logger="dstl.changelog.registry"):
        reg.release(h)
        reg.close()
    assert "could not delete" in caplog.text
    assert "after 5 attempts" in caplog.text  # the first try and every retry of the schedule


def test_release_after_close_still_deletes(tmp_path):
    h, p = _file(tmp_path, "a")
    reg = TaskChangelogRegistry()
    reg.start_tracking(h, 1)
    reg.close()
    reg.close()
    reg.release(h)
    assert not p.exists()


def test_concurrent_releases_delete_once(tmp_path):
    handles = [_file(tmp_path, f"f{i}") for i in range(20)]
    calls = []
    lock = threading.Lock()

    def discard(handle):
        with lock:
            calls.append(handle.path)
        handle.discard_state()

    reg = TaskChangelogRegistry(3, discard=discard)
    for h, _ in handles:
        reg.start_tracking(h, 8)
    barrier = threading.Barrier(8)

    def worker():
        barrier.wait()
        for h, _ in handles:
            reg.release(h)

    ts = [threading.Thread(target=worker) for _ in range(8)]
    for t in ts:
        t.start()
    for t in ts:
        t.join()
    reg.close()
    assert sorted(calls) == sorted(h.path for h, _ in handles)
    assert not any(p.exists() for _, p in handles) and reg.tracked() == {}


def test_local_registry(tmp_path):
    (h1, p1), (h2, p2), (h3, p3) = (_file(tmp_path, n) for n in "abc")
    reg = LocalChangelogRegistry()
    reg.register(h1, 1)
    reg.register(h2, 2)
    reg.register(h2, 1)  # keeps max(2, 1)
    reg.register(h3, 3)
    assert reg.checkpoint_of(h2) == 2
    reg.discard_up_to_checkpoint(2)  # removes entries < 2
    assert reg.wait_for_deletions(5)
    assert not p1.exists() and p2.exists() and p3.exists()
    reg.register(h3, 5)
    reg.discard_up_to_checkpoint(4)
    assert reg.wait_for_deletions(5)
    assert not p2.exists() and p3.exists() and reg.checkpoint_of(h3) == 5
    reg.close()
    assert p3.exists()  # close deletes nothing


def test_no_op_local_registry(tmp_path):
    h, p = _file(tmp_path, "a")
    noop = LocalChangelogRegistry.NO_OP
    assert not noop.enabled
    noop.register(h, 1)
    noop.discard_up_to_checkpoint(100)
    noop.close()
    noop.register(h, 2)  # still usable after close: it is shared
    assert p.exists() and noop.checkpoint_of(h) is None
    assert repr(noop) == "LocalChangelogRegistry.NO_OP"
