"""FsStateChangelogStorage / open_storage: configuration, job ids, paths, lifecycle."""
from __future__ import annotations

import os
import threading

import pytest

import dstl
from dstl.config import StorageConfig
from dstl.changelog.storage import FsStateChangelogStorage, open_storage
from dstl.types import KeyGroupRange
from dstl.changelog.upload.scheduler import BatchingStateChangeUploadScheduler, DirectUploadScheduler

T = 20


def test_flink_keys_in_both_spellings(tmp_path):
    cfg = {"dstl.dfs.base-path": str(tmp_path), "state.changelog.dstl.dfs.batch.persist-delay": "25 ms",
           "dstl.dfs.upload.max-in-flight": "64mb", "dstl.dfs.upload.mode": "thread"}
    with FsStateChangelogStorage(cfg) as s:
        assert s.config.persist_delay_ms == 25 and s.config.max_in_flight == 64 << 20
        assert isinstance(s.scheduler, BatchingStateChangeUploadScheduler)
        assert s.scheduler.persist_delay_ms == 25


@pytest.mark.parametrize("bad,match", [
    ({"dstl.dfs.no-such-option": 1}, "no-such-option"),
    ({"dstl.dfs.batch.persist-delay": "1.5s"}, "persist-delay"),
    ({"dstl.dfs.upload.mode": "fibers"}, "upload.mode"),
    ({"dstl.dfs.batch.persist-size-threshold": "200mb"}, "max-in-flight"),
])
def test_bad_options_raise_value_error_naming_the_key(tmp_path, bad, match):
    with pytest.raises(ValueError, match=match):
        FsStateChangelogStorage({"dstl.dfs.base-path": str(tmp_path), **bad})
    assert not os.listdir(tmp_path)  # validated before anything is written


def test_open_storage_short_form(tmp_path):
    with open_storage(str(tmp_path), batch_persist_delay="0 ms", upload_mode="direct",
                      preemptive_persist_threshold="1kb") as s:
        assert isinstance(s.scheduler, DirectUploadScheduler)
        assert s.config.preemptive_persist_threshold == 1024
    with pytest.raises(ValueError, match="no_such"):
        open_storage(str(tmp_path), no_such=1)


def test_accepts_a_storage_config(tmp_path):
    with FsStateChangelogStorage(StorageConfig(base_path=str(tmp_path), upload_mode="direct")) as s:
        assert s.upload_mode == "direct"


def test_job_id_and_file_layout(tmp_path):
    job = "ab" * 16
    with open_storage(str(tmp_path), job_id=job, upload_mode="direct") as s:
        assert s.job_id == job
        w = s.create_writer("op", KeyGroupRange(0, 0))
        w.append(0, b"x")
        h = w.persist(0, 1).result(T).job_manager_owned_snapshot
        path = h.handles_and_offsets[0][0].path
        assert os.path.dirname(path) == os.path.join(str(tmp_path), job, "dstl")
    with open_storage(str(tmp_path), upload_mode="direct") as s2:
        assert len(s2.job_id) == 32 and int(s2.job_id, 16) >= 0 and s2.job_id != job
    for bad in ("ABABABABABABABABABABABABABABABAB", "abc", 5):
        with pytest.raises(ValueError, match="job_id"):
            open_storage(str(tmp_path), job_id=bad)


def test_file_url_and_memory_filesystem(tmp_path):
    with open_storage(f"file://{tmp_path}", upload_mode="thread") as s:
        w = s.create_writer("op", KeyGroupRange(0, 1))
        w.append(1, b"file-url")
        h = w.persist(0, 1).result(T).job_manager_owned_snapshot
        assert [c.data for c in s.create_reader().get_changes(h)] == [b"file-url"]
    base = f"memory://dstl-test-{os.getpid()}-{threading.get_ident()}"
    with open_storage(base, upload_mode="thread", compression_enabled=True, compression_codec="zstd") as s:
        w = s.create_writer("op", KeyGroupRange(0, 1))
        w.append(0, b"in memory")
        h = w.persist(0, 1).result(T).job_manager_owned_snapshot
        assert h.handles_and_offsets[0][0].path.startswith("memory://")
        assert [c.data for c in s.create_reader().get_changes(h)] == [b"in memory"]


def test_public_names():
    for name in ("FsStateChangelogStorage", "open_storage", "FsStateChangelogWriter", "AvailabilityProvider",
                 "StateChangeUploadScheduler", "BatchingStateChangeUploadScheduler", "UploadTask",
                 "UploadResult", "UploadTasksResult", "StateChangeUploader", "StateChangeFsUploader"):
        assert getattr(dstl, name) is not None


@pytest.mark.parametrize("delay", ["0 ms", "30 ms"])  # with a delay, the persist-delay timer thread runs too
def test_close_waits_for_running_uploads_and_stops_its_threads(tmp_path, delay):
    before = set(threading.enumerate())
    s = open_storage(str(tmp_path), upload_mode="thread", batch_persist_delay=delay)
    w = s.create_writer("op", KeyGroupRange(0, 0))
    w.append(0, b"y" * 100_000)
    f = w.persist(0, 1)
    if delay != "0 ms":
        f.result(5)  # the timer thread drained the batch (close would fail a task still queued)
    w.truncate(w.next_sequence_number())  # schedules a deletion once the result arrives
    s.close()
    assert f.done()  # the running attempt finished before close returned
    d = os.path.join(str(tmp_path), s.job_id, "dstl")
    assert os.listdir(d) == []  # and the scheduled deletion was carried out
    for t in set(threading.enumerate()) - before:
        t.join(5)
    assert [t.name for t in set(threading.enumerate()) - before if t.is_alive()] == []


def test_create_writer_rejects_bad_arguments(tmp_path):
    with open_storage(str(tmp_path), upload_mode="direct") as storage:
        with pytest.raises(ValueError, match="operator_id must be a non-empty"):
            storage.create_writer("", KeyGroupRange(0, 3))
        with pytest.raises(TypeError, match="operator_id must be a str"):
            storage.create_writer(7, KeyGroupRange(0, 3))
        with pytest.raises(TypeError, match="must be a KeyGroupRange"):
            storage.create_writer("op", (0, 3))
