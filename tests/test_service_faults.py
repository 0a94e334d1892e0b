"""Upload service faults with real processes and signals: uploader, scheduler, registry and client killed."""
from __future__ import annotations

import json
import os
import signal
import time
import uuid

import pytest

from conftest import heavy
from service_util import alive, children_of, gate_url, held_pids, python_child, wait_dead
from service_util import process_storage as _storage, runtime  # noqa: F401  (runtime: fixture)

from dstl.errors import UploadServiceError
from dstl.types import KeyGroupRange

pytestmark = heavy  # real service processes and signals; the service's code is the same under both builds

KGR = KeyGroupRange(0, 127)



def _wait(cond, timeout=20.0, what="condition"):
    deadline = time.monotonic() + timeout
    while not cond():
        if time.monotonic() > deadline:
            pytest.fail(f"timed out after {timeout} s waiting for {what}")
        time.sleep(0.01)


def _files(base, job):
    d = os.path.join(str(base), job, "dstl")
    return sorted(os.listdir(d)) if os.path.isdir(d) else []


def _local(path: str) -> str:
    return path[len("gate://"):] if path.startswith("gate://") else path


def _read(storage, handle):
    return [(c.key_group, bytes(c.data)) for c in storage.create_reader().get_changes(handle)]


def test_uploader_killed_mid_upload_is_a_failed_attempt_and_the_batch_is_retried(runtime, tmp_path):
    base = tmp_path / "base"
    base.mkdir()
    job = uuid.uuid4().hex
    s = _storage(gate_url(base), job_id=job, upload_next_attempt_delay="10 ms", upload_timeout="0 ms")
    runtime.remember(s.scheduler.service_pid)
    before = set(s.scheduler.status()["uploader_pids"])
    w = s.create_writer("op", KGR)
    w.append(5, b"payload")
    (base / ".gate").touch()
    f = w.persist(0, 1)
    _wait(lambda: held_pids(base), what="an uploader to start writing")
    victim = held_pids(base)[0]
    assert victim in before
    os.kill(victim, signal.SIGKILL)
    assert wait_dead([victim], 10) == []
    os.unlink(base / ".gate")
    result = f.result(20)
    handle = result.job_manager_owned_snapshot
    assert _read(s, handle) == [(5, b"payload")]
    # the killed attempt's file was deleted; only the winning file remains, and it is tracked once
    path = handle.handles_and_offsets[0][0].path
    _wait(lambda: _files(base, job) == [os.path.basename(path)], what="the partial file to be deleted")
    assert s.registry.ref_count(handle.handles_and_offsets[0][0]) == 1
    m = s.metrics
    assert m["ChangelogStorage.numberOfUploadRequests"] == 2
    assert m["ChangelogStorage.numberOfUploadFailures"] == 1
    assert m["ChangelogStorage.attemptsPerUpload"]["max"] == 2
    _wait(lambda: len(s.scheduler.status()["uploader_pids"]) == len(before), what="a replacement uploader")
    assert victim not in s.scheduler.status()["uploader_pids"]
    w.close()
    s.close()


def test_timeout_starts_a_speculative_attempt_and_the_loser_is_discarded(runtime, tmp_path):
    base = tmp_path / "base"
    base.mkdir()
    job = uuid.uuid4().hex
    s = _storage(gate_url(base), job_id=job, upload_timeout="300 ms")
    runtime.remember(s.scheduler.service_pid)
    w = s.create_writer("op", KGR)
    w.append(5, b"speculative")
    (base / ".gate-once").touch()
    handle = w.persist(0, 1).result(20).job_manager_owned_snapshot  # won by attempt 2
    assert held_pids(base), "attempt 1 should still be held"
    m = s.metrics
    # attempt 2 started at the timeout and won (or, on a slow machine, a third one did)
    assert m["ChangelogStorage.attemptsPerUpload"]["max"] in (2, 3)
    assert m["ChangelogStorage.totalAttemptsPerUpload"]["max"] >= 2
    os.unlink(base / ".gate-claimed")  # attempt 1 finishes late: its file is discarded
    winner = os.path.basename(handle.handles_and_offsets[0][0].path)
    _wait(lambda: _files(base, job) == [winner], what="the losing attempt's file to be deleted")
    assert _read(s, handle) == [(5, b"speculative")]
    assert s.registry.ref_count(handle.handles_and_offsets[0][0]) == 1
    w.close()
    s.close()


def test_scheduler_killed_fails_pending_futures_and_the_next_storage_starts_a_fresh_service(runtime, tmp_path):
    base = tmp_path / "base"
    base.mkdir()
    job = uuid.uuid4().hex
    s = _storage(gate_url(base), job_id=job)
    pid = runtime.remember(s.scheduler.service_pid)
    family = [pid] + children_of(pid)
    w = s.create_writer("op", KGR)
    w.append(1, b"early")
    early = w.persist(0, 1).result(20).job_manager_owned_snapshot
    w.append(2, b"late")
    other = _storage(gate_url(base), job_id=job)  # a second client of the same service
    assert other.scheduler.service_pid == pid
    wo = other.create_writer("op-other", KGR)
    wo.append(3, b"other")
    (base / ".gate").touch()
    pending = [w.persist(0, 1), wo.persist(0, 1)]
    _wait(lambda: held_pids(base), what="the upload to hang")
    t = time.monotonic()
    os.kill(pid, signal.SIGKILL)
    for fut in pending:  # every client's pending futures fail, clearly and quickly
        with pytest.raises(OSError) as info:
            fut.result(s.config.upload_timeout_ms / 1000.0 + 5)
        assert isinstance(info.value, UploadServiceError) or isinstance(info.value.__cause__, UploadServiceError)
    assert time.monotonic() - t < s.config.upload_timeout_ms / 1000.0 + 5
    # later uploads fail at once, clearly
    w2 = s.create_writer("op2", KGR)
    w2.append(3, b"x")
    with pytest.raises(OSError):
        w2.persist(0, 1).result(5)
    os.unlink(base / ".gate")
    # the service's children notice their parent is gone and exit
    assert wait_dead(family, 20) == []
    assert [n for n in os.listdir("/dev/shm") if n.startswith(s.scheduler.connection.prefix)] == []
    # a new storage starts a fresh service; the handle returned before still reads back
    s2 = _storage(gate_url(base), job_id=job)
    pid2 = runtime.remember(s2.scheduler.service_pid)
    assert pid2 != pid and alive(pid2)
    assert _read(s2, early) == [(1, b"early")]
    w3 = s2.create_writer("op", KGR)
    w3.append(4, b"fresh")
    assert _read(s2, w3.persist(0, 1).result(20).job_manager_owned_snapshot) == [(4, b"fresh")]
    for x in (w, w2, w3, wo):
        x.close()
    s.close()
    other.close()
    s2.close()


def test_registry_killed_and_restarted_keeps_referenced_files_and_deletes_released_ones(runtime, tmp_path):
    base = tmp_path / "base"
    job = uuid.uuid4().hex
    s = _storage(base, job_id=job, batch_persist_delay="0 ms")
    runtime.remember(s.scheduler.service_pid)
    w = s.create_writer("op", KGR)
    handles = []
    for i in range(3):
        w.append(i, b"v%d" % i)
        handles.append(w.persist(i, 1).result(20).job_manager_owned_snapshot)
    files = [h.handles_and_offsets[-1][0] for h in handles]
    assert len({f.path for f in files}) == 3
    old = s.scheduler.status()["registry_pid"]
    os.kill(old, signal.SIGKILL)
    assert wait_dead([old], 10) == []
    # while it is down: confirm the first change set, release the second (truncate)
    w.confirm(0, 1, 1)
    w.truncate(2)
    assert s.registry.wait_for_deletions(30)
    st = s.scheduler.status()
    assert st["registry_pid"] != old and st["registry_restarts"] == 1
    assert os.path.exists(files[0].path), "confirmed file must never be deleted"
    assert not os.path.exists(files[1].path), "released file must be deleted after the restart"
    assert os.path.exists(files[2].path) and s.registry.ref_count(files[2]) == 1
    # kill it again right after a release: the release is applied exactly once
    w.truncate(3)
    os.kill(s.scheduler.status()["registry_pid"], signal.SIGKILL)
    assert s.registry.wait_for_deletions(30)
    assert not os.path.exists(files[2].path)
    assert os.path.exists(files[0].path)
    w.close()
    s.close()


def test_journal_survives_a_service_restart(runtime, tmp_path):
    base = tmp_path / "base"
    job = uuid.uuid4().hex
    s = _storage(base, job_id=job)
    pid = runtime.remember(s.scheduler.service_pid)
    w = s.create_writer("op", KGR)
    w.append(1, b"kept until released")
    h = w.persist(0, 1).result(20).job_manager_owned_snapshot
    f = h.handles_and_offsets[0][0]
    w.close()
    s.close()  # releases nothing: the file stays tracked in the journal
    assert wait_dead([pid] + children_of(pid), 15) == []
    s2 = _storage(base, job_id=job)
    runtime.remember(s2.scheduler.service_pid)
    assert s2.scheduler.service_pid != pid
    assert s2.registry.ref_count(f) == 1
    s2.registry.release(f)
    assert s2.registry.wait_for_deletions(30)
    assert not os.path.exists(f.path)
    s2.close()


_CLIENT = r"""
import json, os, sys, time, uuid
from dstl.changelog.storage import open_storage
from dstl.types import KeyGroupRange
base, job, local = sys.argv[1], sys.argv[2], sys.argv[3]
s = open_storage(base, upload_mode="process", job_id=job)
w = s.create_writer("op", KeyGroupRange(0, 127))
out = {"service": s.scheduler.service_pid, "prefix": s.scheduler.connection.prefix, "files": [], "handles": []}
for i in range(4):
    w.append(i, b"c%d" % i)
    h = w.persist(i, 1).result(20).job_manager_owned_snapshot
    out["files"].append(h.handles_and_offsets[-1][0].path)
    out["handles"].append(h.to_bytes().hex())
w.confirm(0, 1, 1)                      # the first file belongs to a checkpoint now
open(os.path.join(local, ".gate"), "w").close()
w.append(9, b"stuck" * 100)
w.persist(4, 2)                         # hangs in the uploader: a segment of ours is in flight
print(json.dumps(out), flush=True)
time.sleep(60)
"""

GRACE_MS = 4000


def test_client_killed_with_sigkill_its_files_are_orphans_until_the_grace_ends(runtime, tmp_path, monkeypatch):
    """A dead client's shared memory goes at once; its unconfirmed files become orphans: after the grace
    period, a file that a checkpoint (written by another process, like a Spark driver) references is
    kept, and the others are deleted."""
    from dstl.changelog.handles import ChangelogStateHandleStreamImpl
    from dstl.state.metadata import CheckpointMetadata, SubtaskState, write_checkpoint

    monkeypatch.setenv("DSTL_ORPHAN_GRACE_MS", str(GRACE_MS))
    base = tmp_path / "base"
    base.mkdir()
    job = uuid.uuid4().hex
    proc = python_child(_CLIENT, gate_url(base), job, str(base))
    keeper = None
    try:
        line = proc.stdout.readline()
        assert line, proc.stderr.read()
        info = json.loads(line)
        runtime.remember(info["service"])
        keeper = _storage(gate_url(base), job_id=job)  # another client keeps the service up meanwhile
        assert keeper.scheduler.service_pid == info["service"]
        files = [_local(p) for p in info["files"]]
        # the "driver" completed a checkpoint that references the second file
        referenced = ChangelogStateHandleStreamImpl.from_bytes(bytes.fromhex(info["handles"][1]))
        write_checkpoint(gate_url(base), CheckpointMetadata(
            2, 128, 1, [SubtaskState(0, KGR, changelog=[referenced])], job_id=job))
        _wait(lambda: held_pids(base), what="the hanging upload")
        assert [n for n in os.listdir("/dev/shm") if n.startswith(info["prefix"])], "no segment in flight"
        killed_at = time.monotonic()
        proc.kill()
        proc.wait(10)
        _wait(lambda: not [n for n in os.listdir("/dev/shm") if n.startswith(info["prefix"])], 20,
              "the dead client's segments to go")
        if time.monotonic() - killed_at < GRACE_MS / 1000 - 0.5:  # checkable only while the grace runs
            assert all(os.path.exists(f) for f in files), "an orphan was deleted before its grace period"
        # the registry dies during the grace period: the orphans come back from its journal
        old_registry = keeper.scheduler.status()["registry_pid"]
        os.kill(old_registry, signal.SIGKILL)
        _wait(lambda: keeper.scheduler.status()["registry_pid"] not in (None, old_registry), 20,
              "the registry to be restarted")
        os.unlink(base / ".gate")
        _wait(lambda: not os.path.exists(files[2]) and not os.path.exists(files[3]), 30,
              "the unreferenced orphans to go")
        assert time.monotonic() - killed_at >= GRACE_MS / 1000 - 0.2
        assert os.path.exists(files[0]), "a confirmed file must survive its writer's death"
        assert os.path.exists(files[1]), "a file a complete checkpoint references must survive"
        _wait(lambda: keeper.registry.ref_count(referenced.handles_and_offsets[0][0]) is None, 10,
              "the referenced orphan to be untracked (the checkpoint owns it)")
        # the upload that was in flight finished after the death: its file goes after the grace as well
        _wait(lambda: _files(base, job) == sorted(os.path.basename(f) for f in files[:2]), 30,
              "the late file to go")
        assert _read(keeper, referenced) == [(1, b"c1")]
    finally:
        if proc.poll() is None:
            proc.kill()
        proc.stdout.close()
        proc.stderr.close()
        if keeper is not None:
            keeper.close()


def test_a_stopped_service_fails_pending_uploads_instead_of_hanging(runtime, tmp_path, monkeypatch):
    monkeypatch.setenv("DSTL_SERVICE_LIVENESS_MS", "500")
    base = tmp_path / "base"
    base.mkdir()
    s = _storage(gate_url(base), upload_timeout="500 ms")
    pid = runtime.remember(s.scheduler.service_pid)
    w = s.create_writer("op", KGR)
    w.append(1, b"x")
    (base / ".gate").touch()
    f = w.persist(0, 1)
    _wait(lambda: held_pids(base), what="the upload to hang")
    os.kill(pid, signal.SIGSTOP)
    try:
        t = time.monotonic()
        with pytest.raises(OSError) as info:
            f.result(15)
        assert time.monotonic() - t < 10
        err = info.value if isinstance(info.value, UploadServiceError) else info.value.__cause__
        assert isinstance(err, UploadServiceError) and "no answer" in str(err)
    finally:
        os.kill(pid, signal.SIGCONT)
        os.unlink(base / ".gate")
    w.close()
    s.close()


def test_sigterm_stops_the_service_cleanly(runtime, tmp_path):
    from concurrent.futures import CancelledError

    s = _storage(tmp_path / "base", batch_persist_delay="60 s")
    pid = runtime.remember(s.scheduler.service_pid)
    instance = s.scheduler.connection.instance
    sock = os.path.join(s.scheduler.connection.paths.directory, "sock")
    family = [pid] + children_of(s.scheduler.service_pid)
    w = s.create_writer("op", KGR)
    w.append(1, b"queued, never uploaded")
    f = w.persist(0, 1)
    os.kill(pid, signal.SIGTERM)
    with pytest.raises((OSError, CancelledError)):
        f.result(20)
    left = wait_dead(family, 20)
    assert left == [], [open(f"/proc/{p}/cmdline").read().replace("\0", " ")[:150] for p in left]
    assert not os.path.exists(sock)
    assert [n for n in os.listdir("/dev/shm") if n.startswith(f"dstl_{instance}_")] == []
    w.close()
    s.close()
