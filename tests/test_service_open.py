"""Every upload mode: validation at open, a deleted job directory made again, failed deletes retried
with backoff and counted, and (process mode) a client that exits without close() becomes an orphan
owner like a killed one (issue 9, items 4 and 5)."""
from __future__ import annotations

import json
import os
import shutil
import signal
import time
import uuid

import pytest

from conftest import heavy
from service_util import gate_url, python_child, runtime  # noqa: F401  (runtime: fixture)
from service_util import process_storage as _storage
from writer_modes import UPLOAD_MODES, make_storage, read_all, upload_mode  # noqa: F401  (fixtures)

from dstl.types import KeyGroupRange

pytestmark = heavy  # real service processes and signals; the service's code is the same under both builds

KGR = KeyGroupRange(0, 127)


@pytest.mark.parametrize("mode", UPLOAD_MODES)
def test_unknown_protocol_is_rejected_at_open(tmp_path, mode):
    from dstl.changelog.storage import open_storage

    with pytest.raises(ValueError) as info:
        open_storage("nosuchfs://bucket/cl", upload_mode=mode)
    msg = str(info.value)
    assert "dstl.dfs.base-path" in msg and "nosuchfs://bucket/cl" in msg and "protocol" in msg


@pytest.mark.parametrize("mode", UPLOAD_MODES)
def test_a_base_path_that_is_a_file_is_rejected_at_open(tmp_path, mode):
    from dstl.changelog.storage import open_storage

    f = tmp_path / "not-a-dir"
    f.write_bytes(b"x")
    with pytest.raises(ValueError) as info:
        open_storage(str(f), upload_mode=mode)
    msg = str(info.value)
    assert "dstl.dfs.base-path" in msg and str(f) in msg and "not a directory" in msg


@pytest.mark.parametrize("mode", UPLOAD_MODES)
def test_upload_threads_above_the_bound_are_rejected_at_open(tmp_path, mode):
    from dstl.config import MAX_UPLOAD_THREADS
    from dstl.changelog.storage import open_storage

    with pytest.raises(ValueError) as info:
        open_storage(str(tmp_path), upload_mode=mode, upload_num_threads=MAX_UPLOAD_THREADS + 1)
    msg = str(info.value)
    assert "upload.num-threads" in msg and str(MAX_UPLOAD_THREADS + 1) in msg and str(MAX_UPLOAD_THREADS) in msg


def test_a_deleted_job_directory_is_made_again_for_the_next_eight_persists(make_storage, tmp_path):
    s = make_storage(batch_persist_delay="0 ms", upload_num_threads=1)  # one uploader (process mode)
    w = s.create_writer("op", KGR)
    w.append(1, b"before")
    first = w.persist(0, 1).result(20).job_manager_owned_snapshot
    job_dir = os.path.join(s.config.base_path, s.job_id, "dstl")
    assert os.path.isdir(job_dir)
    shutil.rmtree(os.path.join(s.config.base_path, s.job_id))
    for i in range(8):  # sqn 0 went with the directory; each persist uploads only the new change set
        w.append(i, b"after-%d" % i)
        handle = w.persist(i + 1, 1).result(20).job_manager_owned_snapshot
        assert read_all(s, handle) == [(i, b"after-%d" % i)]
    assert os.path.isdir(job_dir)
    assert first is not None
    w.close()


def test_failed_deletes_are_retried_with_backoff_and_counted_thread_mode(tmp_path):
    from faultyfs import FAULTS, faulty_url

    from dstl.changelog.storage import open_storage

    FAULTS.reset()
    try:
        s = open_storage(faulty_url(tmp_path), upload_mode="thread", batch_persist_delay="0 ms")
        w = s.create_writer("op", KGR)
        w.append(1, b"x")
        h = w.persist(0, 1).result(20).job_manager_owned_snapshot
        path = h.handles_and_offsets[0][0].path
        local = path[len("faulty://"):] if path.startswith("faulty://") else path
        FAULTS.fail_deletes(2)
        w.truncate(1)  # releases the file
        assert s.registry.wait_for_deletions(20)
        assert not os.path.exists(local), "the deletion must succeed on a retry"
        assert s.metrics["ChangelogStorage.numberOfDeleteFailures"] == 2
        w.close()
        s.close()
    finally:
        FAULTS.reset()


def test_failed_deletes_are_retried_with_backoff_and_counted_process_mode(runtime, tmp_path):
    base = tmp_path / "base"
    base.mkdir()
    s = _storage(gate_url(base), batch_persist_delay="0 ms")
    runtime.remember(s.scheduler.service_pid)
    w = s.create_writer("op", KGR)
    w.append(1, b"x")
    h = w.persist(0, 1).result(20).job_manager_owned_snapshot
    local = h.handles_and_offsets[0][0].path[len("gate://"):]
    (base / ".nodelete").touch()
    w.truncate(1)  # releases the file: its deletion fails until .nodelete goes
    deadline = time.monotonic() + 20
    while s.metrics["ChangelogStorage.numberOfDeleteFailures"] < 2:
        assert time.monotonic() < deadline, "the failed deletion was not retried"
        time.sleep(0.05)
    assert os.path.exists(local)
    os.unlink(base / ".nodelete")
    assert s.registry.wait_for_deletions(30)
    assert not os.path.exists(local), "a retry after the store recovered must delete the file"
    w.close()
    s.close()


_EXITING_CLIENT = r"""
import json, os, signal, sys, time
from dstl.changelog.storage import open_storage
from dstl.types import KeyGroupRange
base, job, how = sys.argv[1], sys.argv[2], sys.argv[3]
s = open_storage(base, upload_mode="process", job_id=job, batch_persist_delay="0 ms")
w = s.create_writer("op", KeyGroupRange(0, 127))
files = []
for i in range(3):
    w.append(i, b"c%d" % i)
    files.append(w.persist(i, 1).result(30).job_manager_owned_snapshot.handles_and_offsets[-1][0].path)
w.confirm(0, 1, 1)
print(json.dumps({"service": s.scheduler.service_pid, "files": files}), flush=True)
if how == "sys.exit":
    sys.exit(0)
elif how == "exception":
    raise RuntimeError("the job failed")
elif how == "sigterm":
    os.kill(os.getpid(), signal.SIGTERM)
    time.sleep(30)
"""


@pytest.mark.parametrize("how", ["sys.exit", "exception", "sigterm"])
def test_a_client_that_exits_without_close_becomes_an_orphan_owner(runtime, tmp_path, monkeypatch, how):
    monkeypatch.setenv("DSTL_ORPHAN_GRACE_MS", "2000")
    base = tmp_path / "base"
    job = uuid.uuid4().hex
    keeper = _storage(base, job_id=job, batch_persist_delay="0 ms")  # keeps the service up
    runtime.remember(keeper.scheduler.service_pid)
    proc = python_child(_EXITING_CLIENT, str(base), job, how)
    try:
        line = proc.stdout.readline()
        assert line, proc.stderr.read()
        info = json.loads(line)
        assert info["service"] == keeper.scheduler.service_pid
        proc.wait(30)
        files = info["files"]
        deadline = time.monotonic() + 30
        while os.path.exists(files[1]) or os.path.exists(files[2]):
            assert time.monotonic() < deadline, "the unconfirmed files of the exited client stayed tracked"
            time.sleep(0.05)
        assert os.path.exists(files[0]), "the confirmed file must stay"
    finally:
        if proc.poll() is None:
            proc.kill()
            proc.wait(10)
        proc.stdout.close()
        proc.stderr.close()
        keeper.close()
