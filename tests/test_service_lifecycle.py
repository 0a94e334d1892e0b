"""Upload service (process mode): start-up under the file lock, sharing, linger, shared memory, batching."""
from __future__ import annotations

import json
import os
import shutil
import time
import uuid

import pytest

from conftest import heavy
from service_util import alive, children_of, gate_url, held_pids, python_child, wait_dead
from service_util import process_storage as _storage, runtime  # noqa: F401  (runtime: fixture)

from dstl.types import KeyGroupRange

pytestmark = heavy  # real service processes and signals; the service's code is the same under both builds

KGR = KeyGroupRange(0, 127)



def _segments(prefix="dstl_"):
    return sorted(n for n in os.listdir("/dev/shm") if n.startswith(prefix))


def test_two_storages_share_one_service_and_it_stops_after_the_last(runtime, tmp_path):
    a = _storage(tmp_path / "base")
    b = _storage(tmp_path / "base")
    pid = runtime.remember(a.scheduler.service_pid)
    assert b.scheduler.service_pid == pid
    status = a.scheduler.status()
    assert len(status["clients"]) == 2 and status["registry_pid"] and status["uploader_pids"]
    wa, wb = a.create_writer("op", KGR), b.create_writer("op", KGR)
    wa.append(1, b"a" * 10)
    wb.append(2, b"b" * 10)
    fa, fb = wa.persist(0, 1), wb.persist(0, 1)
    ra, rb = fa.result(20), fb.result(20)
    # one drain took both writers' tasks: both change sets are in one file
    pa = ra.job_manager_owned_snapshot.handles_and_offsets[0][0].path
    pb = rb.job_manager_owned_snapshot.handles_and_offsets[0][0].path
    assert os.path.dirname(pa) != os.path.dirname(pb) or pa == pb  # different jobs -> different dirs
    a.close()
    assert alive(pid)  # b is still connected
    wa.close()
    wb.close()
    b.close()
    family = [pid] + children_of(pid)
    assert wait_dead(family, 15) == [], "service and its children must stop after the linger"
    assert not os.path.exists(os.path.join(runtime.root, os.listdir(runtime.root)[0], "sock"))
    assert _segments(f"dstl_{status['instance']}") == []


def test_same_job_writers_of_two_clients_share_a_file(runtime, tmp_path):
    job = uuid.uuid4().hex
    a = _storage(tmp_path / "base", job_id=job, batch_persist_delay="300 ms")
    b = _storage(tmp_path / "base", job_id=job, batch_persist_delay="300 ms")
    runtime.remember(a.scheduler.service_pid)
    wa, wb = a.create_writer("op", KGR), b.create_writer("op", KGR)
    wa.append(1, b"a" * 10)
    wb.append(2, b"b" * 10)
    fa, fb = wa.persist(0, 1), wb.persist(0, 1)
    ha = fa.result(20).job_manager_owned_snapshot
    hb = fb.result(20).job_manager_owned_snapshot
    assert ha.handles_and_offsets[0][0].path == hb.handles_and_offsets[0][0].path
    assert os.listdir(tmp_path / "base" / job / "dstl") == [os.path.basename(ha.handles_and_offsets[0][0].path)]
    assert [bytes(c.data) for c in a.create_reader().get_changes(ha)] == [b"a" * 10]
    assert [bytes(c.data) for c in b.create_reader().get_changes(hb)] == [b"b" * 10]
    assert a.metrics["ChangelogStorage.uploadBatchSizes"]["max"] == 2
    for x in (wa, wb, a, b):
        x.close()


def test_racing_processes_start_exactly_one_service(runtime, tmp_path):
    code = (
        "import sys, uuid\n"
        "from dstl.changelog.storage import open_storage\n"
        "s = open_storage(sys.argv[1], upload_mode='process', job_id=uuid.uuid4().hex)\n"
        "print(s.scheduler.service_pid, flush=True)\n"
        "sys.stdin.read() if False else None\n"
        "import time; time.sleep(1.0)\n"
        "s.close()\n"
    )
    procs = [python_child(code, str(tmp_path / "base")) for _ in range(4)]
    try:
        outs = [p.communicate(timeout=90) for p in procs]
    finally:
        for p in procs:
            if p.poll() is None:
                p.kill()
    pids = {int(o.strip()) for o, _ in outs}
    for p in pids:
        runtime.remember(p)
    assert all(p.returncode == 0 for p in procs), [e for _, e in outs]
    assert len(pids) == 1


def test_segment_lives_while_the_upload_runs_and_is_unlinked_after(runtime, tmp_path):
    base = tmp_path / "base"
    base.mkdir()
    s = _storage(gate_url(base))
    runtime.remember(s.scheduler.service_pid)
    prefix = s.scheduler.connection.prefix
    w = s.create_writer("op", KGR)
    w.append(3, b"x" * 1000)
    (base / ".gate").touch()
    f = w.persist(0, 1)
    deadline = time.monotonic() + 20
    while not held_pids(base) and time.monotonic() < deadline:
        time.sleep(0.01)
    assert held_pids(base), "the upload never reached the file system"
    segs = _segments(prefix)
    assert len(segs) == 1
    assert os.path.getsize(f"/dev/shm/{segs[0]}") >= 1000
    os.unlink(base / ".gate")
    r = f.result(20)
    assert r.job_manager_owned_snapshot.state_size == 1000
    # the finished task's segment is kept for reuse by this client (at most a few), never more
    assert len(_segments(prefix)) <= 1
    w.append(4, b"y" * 10)
    assert w.persist(1, 2).result(20).job_manager_owned_snapshot.state_size == 10
    assert len(_segments(prefix)) <= 1
    w.close()
    s.close()
    assert _segments(prefix) == []


def test_back_pressure_is_shared_by_every_client(runtime, tmp_path):
    base = tmp_path / "base"
    base.mkdir()
    opts = dict(upload_max_in_flight="1 kb", batch_persist_size_threshold="1 kb", batch_persist_delay="0 ms")
    a = _storage(gate_url(base), **opts)
    b = _storage(gate_url(base), **opts)
    runtime.remember(a.scheduler.service_pid)
    wa = a.create_writer("op", KGR)
    (base / ".gate").touch()
    wa.append(1, b"z" * 2000)
    fa = wa.persist(0, 1)
    deadline = time.monotonic() + 10
    while b.get_availability_provider().is_available() and time.monotonic() < deadline:
        time.sleep(0.01)
    # a's bytes fill the service: b (another client) sees it as unavailable too
    assert not b.get_availability_provider().is_available()
    assert b.metrics["ChangelogStorage.availability"] == 0
    fut = b.get_availability_provider().future
    assert not fut.done()
    os.unlink(base / ".gate")
    fa.result(20)
    fut.result(10)
    assert b.get_availability_provider().is_available()
    for x in (wa, a, b):
        x.close()


def test_storage_start_up_is_fast_once_the_service_runs(runtime, tmp_path):
    a = _storage(tmp_path / "base")
    runtime.remember(a.scheduler.service_pid)
    t = time.perf_counter()
    b = _storage(tmp_path / "base")
    connect_s = time.perf_counter() - t
    assert b.scheduler.service_pid == a.scheduler.service_pid
    assert connect_s < 5.0  # generous bound: this is a liveness check, speed lives in bench/
    assert b.scheduler.ping() < 5.0
    a.close()
    b.close()


def test_service_config_file_and_bad_runtime_dir(runtime, tmp_path):
    from dstl.config import StorageConfig
    from dstl.changelog.upload.service.runtime import ServicePaths, service_key

    c1 = StorageConfig(str(tmp_path / "b"), upload_mode="process")
    c2 = c1.replace(compression_enabled=True)
    c3 = c1.replace(preemptive_persist_threshold=1)
    assert service_key(c1) != service_key(c2)  # different files -> different services
    assert service_key(c1) == service_key(c3)  # client-side option only
    assert service_key(c1) == service_key(StorageConfig(str(tmp_path / "b") + "/", upload_mode="process"))
    s = _storage(tmp_path / "b")
    runtime.remember(s.scheduler.service_pid)
    with open(ServicePaths.for_config(c1).config_file) as f:
        assert json.load(f)["dstl.dfs.base-path"] == str(tmp_path / "b")
    s.close()
    long_dir = "/tmp/" + "x" * 120
    os.environ["DSTL_RUNTIME_DIR"] = long_dir
    try:  # a runtime directory too long for a socket path is reached through a short link
        paths = ServicePaths.for_config(c1)
        assert paths.directory.startswith(long_dir) and not paths.socket.startswith(long_dir)
        assert os.path.realpath(os.path.dirname(paths.socket)) == os.path.realpath(paths.directory)
    finally:
        os.environ["DSTL_RUNTIME_DIR"] = runtime.root
        shutil.rmtree(long_dir, ignore_errors=True)


def _task(sets):
    from concurrent.futures import Future

    from dstl.changelog.upload.task import UploadTask

    f = Future()
    return UploadTask(sets, f.set_result, lambda sqns, exc: f.set_exception(exc)), f


def _sealed(kg: int, data: bytes, sqn: int = 0, log_id=None):
    from dstl.format import ChangeBuffer
    from dstl.types import SealedChangeSet

    b = ChangeBuffer()
    b.append(kg, data)
    return SealedChangeSet(log_id or uuid.uuid4(), sqn, b.seal(), len(data), 1)


def test_open_service_client_with_local_recovery_writes_and_tracks_both_copies(runtime, tmp_path):
    from dstl.config import StorageConfig
    from dstl.metrics import ChangelogStorageMetricGroup
    from dstl.changelog.upload.service import open_service_client

    cfg = StorageConfig(str(tmp_path / "base"), upload_mode="process")
    metrics = ChangelogStorageMetricGroup()
    sched, reg = open_service_client(cfg, uuid.uuid4().hex, metrics, local_recovery_dir=str(tmp_path / "local"))
    runtime.remember(sched.service_pid)
    log = uuid.uuid4()
    task, fut = _task([_sealed(3, b"hello", 1, log), _sealed(4, b"world!", 0, log)])
    sched.upload(task)
    results = fut.result(20)
    assert [(int(r.sequence_number), r.size) for r in results] == [(0, 6), (1, 5)]  # sorted by (log id, sqn)
    r = results[0]
    assert r.local_stream_handle is not None and r.offset == r.local_offset
    with open(r.stream_handle.path, "rb") as a, open(r.local_stream_handle.path, "rb") as b:
        assert a.read() == b.read()
    assert reg.ref_count(r.stream_handle) == 2 and reg.ref_count(r.local_stream_handle) == 2
    for h in (r.stream_handle, r.local_stream_handle):
        reg.release(h)
        reg.release(h)
    assert reg.wait_for_deletions(20)
    assert not os.path.exists(r.stream_handle.path) and not os.path.exists(r.local_stream_handle.path)
    snap = metrics.snapshot()
    assert snap["ChangelogStorage.numberOfUploadRequests"] == 1
    assert snap["ChangelogStorage.uploadSizes"]["max"] == 4 + 8 + 4 + 5 + 4 + 8 + 4 + 6
    sched.close()
    reg.close()


def test_upload_failures_come_back_to_the_task_and_closed_scheduler_cancels(runtime, tmp_path):
    from concurrent.futures import CancelledError

    from dstl.config import StorageConfig
    from dstl.metrics import ChangelogStorageMetricGroup
    from dstl.changelog.upload.service import open_service_client

    blocker = tmp_path / "file-not-dir"
    blocker.write_text("a file where the base directory should be")
    cfg = StorageConfig(str(blocker), upload_mode="process", retry_policy="none")
    metrics = ChangelogStorageMetricGroup()
    sched, reg = open_service_client(cfg, uuid.uuid4().hex, metrics)
    runtime.remember(sched.service_pid)
    task, fut = _task([_sealed(1, b"x")])
    sched.upload(task)
    with pytest.raises(OSError):
        fut.result(20)
    assert metrics.snapshot()["ChangelogStorage.numberOfUploadFailures"] == 1
    sched.close()
    task2, fut2 = _task([_sealed(1, b"y")])
    sched.upload(task2)
    with pytest.raises(CancelledError):
        fut2.result(5)
    reg.close()
    assert [n for n in os.listdir("/dev/shm") if n.startswith(sched.connection.prefix)] == []


def test_flush_uploads_the_queue_now_and_gauges_see_the_whole_service(runtime, tmp_path):
    a = _storage(tmp_path / "base", batch_persist_delay="60 s")
    b = _storage(tmp_path / "base", batch_persist_delay="60 s")
    runtime.remember(a.scheduler.service_pid)
    wa, wb = a.create_writer("op", KGR), b.create_writer("op", KGR)
    wa.append(1, b"a" * 100)
    wb.append(2, b"b" * 50)
    fa, fb = wa.persist(0, 1), wb.persist(0, 1)
    time.sleep(0.2)
    assert not fa.done() and not fb.done()
    # every client sees the service's queue and in-flight bytes, not only its own
    assert a.metrics["ChangelogStorage.uploadQueueSize"] == 2
    assert b.metrics["ChangelogStorage.inFlightBytes"] == 150
    a.scheduler.flush()
    assert fa.result(20).job_manager_owned_snapshot.state_size == 100
    assert fb.result(20).job_manager_owned_snapshot.state_size == 50
    assert a.metrics["ChangelogStorage.uploadQueueSize"] == 0
    assert a.metrics["ChangelogStorage.inFlightBytes"] == 0
    for x in (wa, wb, a, b):
        x.close()


def test_a_service_that_cannot_start_is_reported_quickly_with_its_log(runtime, tmp_path, monkeypatch):
    from dstl.errors import UploadServiceError

    monkeypatch.setenv("DSTL_SERVICE_IMPORTS", "no_such_module_for_dstl_tests")
    t = time.monotonic()
    with pytest.raises(UploadServiceError, match="no_such_module_for_dstl_tests"):
        _storage(tmp_path / "base")
    assert time.monotonic() - t < 30


def test_open_service_client_rejects_a_bad_job_id(runtime, tmp_path):
    from dstl.config import StorageConfig
    from dstl.changelog.upload.service import open_service_client

    with pytest.raises(ValueError, match="job_id"):
        open_service_client(StorageConfig(str(tmp_path)), "../escape")


def test_storage_local_recovery_in_process_mode(runtime, tmp_path, monkeypatch):
    """SEMANTICS §10 through the service: the local copy is written by the service's uploader, the
    result carries a task-local snapshot, and the local registry deletes copies on confirm/reset;
    truncate releases both copies through the service's registry."""
    monkeypatch.chdir(tmp_path)  # a relative local directory resolves in the client's directory
    job = uuid.uuid4().hex
    s = _storage(tmp_path / "remote", job_id=job, local_recovery_dir="local", batch_persist_delay="0 ms")
    local_dir = tmp_path / "local" / f"jid_{job}" / "taskowned"
    names = lambda: sorted(os.listdir(local_dir)) if local_dir.exists() else []  # noqa: E731
    try:
        runtime.remember(s.scheduler.service_pid)
        w = s.create_writer("op", KGR)
        w.append_meta(b"m")
        w.append(3, b"abc")
        r1 = w.persist(0, 1).result(20)
        remote, local = r1.job_manager_owned_snapshot, r1.task_local_snapshot
        assert local is not None and local.state_size == remote.state_size
        [(rh, roff)] = remote.handles_and_offsets
        [(lh, loff)] = local.handles_and_offsets
        assert roff == loff and lh.path == str(local_dir / os.path.basename(rh.path))
        assert open(rh.path, "rb").read() == open(lh.path, "rb").read()
        it = s.create_reader().get_changes(local)
        assert [(c.key_group, bytes(c.data)) for c in it] == [(-1, b"m"), (3, b"abc")]
        assert s.registry.ref_count(rh) == 1 and s.registry.ref_count(lh) == 1
        # confirm of a later checkpoint that does not use the copy deletes it (local registry)
        nxt = w.next_sequence_number()
        w.confirm(0, nxt, 1)
        assert names() == [os.path.basename(lh.path)]
        w.append(1, b"b")
        w.persist(nxt, 2).result(20)
        assert len(names()) == 2
        w.confirm(nxt, w.next_sequence_number(), 3)
        s.local_registry.wait_for_deletions(20)
        assert names() == []
        assert os.path.exists(rh.path)  # owned by checkpoint 1
        # reset of an aborted checkpoint discards its copy
        start = w.next_sequence_number()
        w.append(2, b"c")
        w.persist(start, 5).result(20)
        assert len(names()) == 1
        w.reset(start, w.next_sequence_number(), 5)
        s.local_registry.wait_for_deletions(20)
        assert names() == []
        # truncate releases the unconfirmed upload: the service deletes remote and local copy
        start = w.next_sequence_number()
        w.append(4, b"d")
        r6 = w.persist(start, 6).result(20)
        [(rh6, _)] = r6.job_manager_owned_snapshot.handles_and_offsets
        [(lh6, _)] = r6.task_local_snapshot.handles_and_offsets
        assert os.path.exists(lh6.path)
        w.truncate(w.next_sequence_number())
        assert s.registry.wait_for_deletions(20)
        assert not os.path.exists(rh6.path) and not os.path.exists(lh6.path)
        w.close()
    finally:
        s.close()
