"""Raw local files in process mode: the clients write their own change sets into the file the
service's attempt made (WriteRegion / Written), nothing goes through shared memory, and a client
that is gone or stalled is left out of the batch instead of failing the others' changes."""
from __future__ import annotations

import json
import os
import signal
import time
import uuid

import pytest

from conftest import heavy
from service_util import python_child, wait_dead
from service_util import process_storage as _storage, runtime  # noqa: F401  (runtime: fixture)

from dstl.changelog.handles import ChangelogStateHandleStreamImpl
from dstl.changelog.upload.service.client import CLIENT_WRITES_ENV
from dstl.changelog.upload.uploader import HeldSpan, StateChangeFsUploader
from dstl.types import KeyGroupRange

pytestmark = heavy  # real service processes and signals; the service's code is the same under both builds

KGR = KeyGroupRange(0, 127)


def _read(storage, handle):
    return [(c.key_group, bytes(c.data)) for c in storage.create_reader().get_changes(handle)]


def _in_file_order(changes):
    return sorted(changes, key=lambda c: c[0])  # by key group, appends in order inside one (stable)


def _file_of(handle) -> str:
    paths = {h.path for h, _ in handle.handles_and_offsets}
    assert len(paths) == 1, paths
    return paths.pop()


def _changes(n: int, tag: bytes):
    return [(i % 128, tag + b"-%05d-" % i + bytes([i % 251]) * (i % 300)) for i in range(n)]


def _persisted(storage, changes, sqn_to=1):
    w = storage.create_writer("op", KGR)
    for kg, data in changes:
        w.append(kg, data)
    res = w.persist(w.initial_sequence_number(), sqn_to).result(30)
    w.close()
    return res


@pytest.mark.parametrize("local_recovery", [False, True])
def test_the_client_writes_the_same_file_bytes_as_the_uploaders(runtime, tmp_path, monkeypatch, local_recovery):
    changes = _changes(3_000, b"cw")
    files = {}
    for mode in ("1", "0"):  # the client writes / an uploader process copies from shared memory
        monkeypatch.setenv(CLIENT_WRITES_ENV, mode)
        opts = {"local_recovery_dir": str(tmp_path / f"lr{mode}")} if local_recovery else {}
        s = _storage(tmp_path / f"base{mode}", **opts)
        runtime.remember(s.scheduler.service_pid)
        try:
            conn = s.scheduler.connection
            assert conn.holds is (mode == "1")
            res = _persisted(s, changes)
            handle = res.job_manager_owned_snapshot
            assert _read(s, handle) == _in_file_order(changes)
            with open(_file_of(handle), "rb") as f:
                files[mode] = f.read()
            if local_recovery:
                local = res.task_local_snapshot
                assert local is not None and _read(s, local) == _in_file_order(changes)
                with open(_file_of(local), "rb") as f:
                    assert f.read() == files[mode], "the local copy must hold the file's bytes"
            if mode == "1":
                assert conn.bytes_shared == 0 and conn.bytes_written == len(files[mode]) - 1
            else:
                assert conn.bytes_shared == len(files[mode]) - 1 and conn.bytes_written == 0
        finally:
            s.close()
    assert files["1"] == files["0"]


_CHILD = r"""
import json, os, sys, time
from dstl.changelog.storage import open_storage
from dstl.types import KeyGroupRange
base, job, delay = sys.argv[1], sys.argv[2], sys.argv[3]
s = open_storage(base, upload_mode="process", job_id=job, batch_persist_delay=delay, upload_timeout="300 ms")
w = s.create_writer("child", KeyGroupRange(0, 127))
for i in range(200):
    w.append(i % 128, b"child-%d" % i)
f = w.persist(w.initial_sequence_number(), 1)
conn = s.scheduler.connection
while conn._unsent or not conn._pending:  # the descriptor is on its way: the task is the service's
    time.sleep(0.001)
print(json.dumps({"service": conn.service_pid}), flush=True)
try:
    h = f.result(60).job_manager_owned_snapshot
    print(json.dumps({"file": sorted({x.path for x, _ in h.handles_and_offsets}), "handle": h.to_bytes().hex()}),
          flush=True)
except Exception as exc:
    print(json.dumps({"error": repr(exc)}), flush=True)
s.close()
"""


def _child(base, job, delay, client_writes="1"):
    proc = python_child(_CHILD, str(base), job, delay, env=dict(os.environ, **{CLIENT_WRITES_ENV: client_writes}))
    line = proc.stdout.readline()
    assert line, proc.stderr.read()
    return proc, json.loads(line)["service"]


def _finish(proc):
    if proc.poll() is None:
        proc.kill()
    wait_dead([proc.pid], 10)
    proc.wait(10)
    if proc.stdout.closed:
        return []
    out = proc.stdout.read()
    proc.stdout.close()
    proc.stderr.close()
    return [json.loads(x) for x in out.splitlines() if x.strip()]


@pytest.mark.parametrize("child_writes", ["1", "0"])
def test_two_clients_write_their_own_regions_of_one_file(runtime, tmp_path, child_writes, monkeypatch):
    """Both clients' tasks go into one file; with DSTL_CLIENT_WRITES=0 in the other client, its part
    comes from shared memory (the service's attempt copies it) and this one's from this client."""
    monkeypatch.setenv(CLIENT_WRITES_ENV, "1")
    base = tmp_path / "base"
    job = uuid.uuid4().hex
    proc, service = _child(base, job, "1500 ms", child_writes)  # its task waits for company
    try:
        runtime.remember(service)
        s = _storage(base, job_id=job, batch_persist_delay="1500 ms", upload_timeout="300 ms")
        assert s.scheduler.service_pid == service
        mine = _changes(500, b"parent")
        handle = _persisted(s, mine).job_manager_owned_snapshot
        assert _read(s, handle) == _in_file_order(mine)
        proc.wait(30)
        child = _finish(proc)
        assert child and child[0]["file"] == [_file_of(handle)], child
        theirs = ChangelogStateHandleStreamImpl.from_bytes(bytes.fromhex(child[0]["handle"]))
        assert _read(s, theirs) == _in_file_order([(i % 128, b"child-%d" % i) for i in range(200)])
        assert s.scheduler.connection.bytes_shared == 0
        s.close()
    finally:
        _finish(proc)


@pytest.mark.parametrize("fault", ["SIGSTOP", "SIGKILL"])
def test_a_stalled_or_dead_client_is_left_out_and_the_others_changes_are_written(runtime, tmp_path, fault,
                                                                                  monkeypatch):
    monkeypatch.setenv(CLIENT_WRITES_ENV, "1")
    base = tmp_path / "base"
    job = uuid.uuid4().hex
    proc, service = _child(base, job, "1000 ms")
    try:
        runtime.remember(service)
        s = _storage(base, job_id=job, batch_persist_delay="1000 ms", upload_timeout="300 ms")
        os.kill(proc.pid, getattr(signal, fault))  # its task is in the service's batch by now
        mine = _changes(500, b"survivor")
        t0 = time.monotonic()
        handle = _persisted(s, mine).job_manager_owned_snapshot
        assert time.monotonic() - t0 < 15
        assert _read(s, handle) == _in_file_order(mine)  # the other client's changes are not in this file
        if fault == "SIGSTOP":  # in the batch: the first attempt waited for it, a later one left it out
            assert s.metrics["ChangelogStorage.attemptsPerUpload"]["max"] >= 2
        d = os.path.dirname(_file_of(handle))
        deadline = time.monotonic() + 20
        while os.listdir(d) != [os.path.basename(_file_of(handle))]:  # a given-up attempt's file goes
            assert time.monotonic() < deadline, os.listdir(d)
            time.sleep(0.05)
        s.close()
    finally:
        if proc.poll() is None:
            os.kill(proc.pid, signal.SIGKILL)
        _finish(proc)


def test_client_writes_are_on_by_default_off_with_0_and_a_bad_value_is_refused(runtime, tmp_path, monkeypatch):
    monkeypatch.delenv(CLIENT_WRITES_ENV, raising=False)
    s = _storage(tmp_path / "base")
    runtime.remember(s.scheduler.service_pid)
    try:
        assert s.scheduler.connection.holds is True
        monkeypatch.setenv(CLIENT_WRITES_ENV, "0")
        s2 = _storage(tmp_path / "base")  # the same service; this client sends its bodies through memory
        try:
            assert s2.scheduler.connection.holds is False
            assert s2.scheduler.service_pid == s.scheduler.service_pid
        finally:
            s2.close()
        monkeypatch.setenv(CLIENT_WRITES_ENV, "yes")
        with pytest.raises(ValueError, match="DSTL_CLIENT_WRITES='yes'"):
            _storage(tmp_path / "base")
    finally:
        s.close()


def test_held_bodies_need_a_delegate_and_a_raw_local_file(tmp_path):
    from dstl.changelog.upload.task import UploadTask
    from dstl.types import SealedChangeSet

    class _M:
        def __init__(self):
            from dstl.changelog.upload.service.worker import _AttemptMetrics
            self.__dict__.update(vars(_AttemptMetrics()))

    def task():
        cs = SealedChangeSet(uuid.uuid4(), 0, HeldSpan(10, 0, 0), 10, 1)
        return [UploadTask([cs], lambda *_: None, lambda *_: None)]

    class _Reg:
        def start_tracking(self, *_a):
            pass

    raw = StateChangeFsUploader(str(tmp_path / "raw"), "j", None, 1 << 16, _Reg(), _M())
    with pytest.raises(ValueError, match="need a delegate"):
        raw.upload(task())
    assert os.listdir(raw.directory) == [], "the partial file of a refused attempt is deleted"
    snappy = StateChangeFsUploader(str(tmp_path / "snappy"), "j", "snappy", 1 << 16, _Reg(), _M())
    with pytest.raises(ValueError, match="raw local files"):
        snappy.upload(task())
    seen = []

    def delegate(paths, held):  # what a client does: its bytes at the given offset of the made file
        seen.append((paths, [(o, s.length) for o, s in held]))
        fd = os.open(paths[0], os.O_WRONLY)
        os.pwrite(fd, b"0123456789", held[0][0])
        os.close(fd)

    res = raw.upload(task(), delegate=delegate)
    (paths, held), = seen
    assert held == [(1, 10)] and paths == [res.handle.path]
    with open(paths[0], "rb") as f:
        assert f.read()[1:] == b"0123456789"
