"""Acknowledged means durable: the registry journal under short writes and ENOSPC (issue 9, item 3).

Faults are injected into the registry process's writes of its journal (service_util's shim, enabled
by DSTL_TEST_JOURNAL_FAULTS); the client is a real process killed with SIGKILL, the registry is
killed and restarted from its journal, and the orphan grace period runs for real.
"""
from __future__ import annotations

import json
import os
import signal
import time
import uuid

import pytest

from conftest import heavy
from service_util import JOURNAL_FAULTS_ENV, python_child, wait_dead
from service_util import process_storage as _storage, runtime  # noqa: F401  (runtime: fixture)

from dstl.types import KeyGroupRange

pytestmark = heavy  # real service processes and signals; the service's code is the same under both builds

KGR = KeyGroupRange(0, 127)
GRACE_MS = 3000

# persists 3 files, then confirms on command ("confirm i" on stdin) and answers each with a line
_CLIENT = r"""
import json, sys
from dstl.changelog.storage import open_storage
from dstl.types import KeyGroupRange
base, job = sys.argv[1], sys.argv[2]
s = open_storage(base, upload_mode="process", job_id=job, batch_persist_delay="0 ms")
w = s.create_writer("op", KeyGroupRange(0, 127))
files = []
for i in range(3):
    w.append(i, b"c%d" % i)
    h = w.persist(i, 1).result(30).job_manager_owned_snapshot
    files.append(h.handles_and_offsets[-1][0].path)
print(json.dumps({"service": s.scheduler.service_pid, "files": files}), flush=True)
for line in sys.stdin:
    cmd, i = line.split()
    i = int(i)
    try:
        w.confirm(i, i + 1, 10 + i)
        print(json.dumps({"ok": True}), flush=True)
    except Exception as exc:
        print(json.dumps({"ok": False, "error": f"{type(exc).__name__}: {exc}"}), flush=True)
"""


def _wait(cond, timeout=30.0, what="condition"):
    deadline = time.monotonic() + timeout
    while not cond():
        if time.monotonic() > deadline:
            pytest.fail(f"timed out after {timeout} s waiting for {what}")
        time.sleep(0.02)


def _command(proc, text: str) -> dict:
    proc.stdin.write(text + "\n")
    proc.stdin.flush()
    line = proc.stdout.readline()
    assert line, proc.stderr.read()
    return json.loads(line)


def _restart_registry(keeper) -> None:
    old = keeper.scheduler.status()["registry_pid"]
    os.kill(old, signal.SIGKILL)
    assert wait_dead([old], 10) == []
    _wait(lambda: keeper.scheduler.status()["registry_pid"] not in (None, old), 20, "the registry restart")


def _start_client(base, job):
    import subprocess
    import sys

    from service_util import HERE

    env = dict(os.environ)
    env["PYTHONPATH"] = os.pathsep.join([os.path.dirname(HERE), HERE] + (
        [env["PYTHONPATH"]] if env.get("PYTHONPATH") else []))
    proc = subprocess.Popen([sys.executable, "-c", _CLIENT, str(base), job], env=env, stdin=subprocess.PIPE,
                            stdout=subprocess.PIPE, stderr=subprocess.PIPE, text=True)
    line = proc.stdout.readline()
    assert line, proc.stderr.read()
    return proc, json.loads(line)


def _stop(proc) -> None:
    if proc.poll() is None:
        proc.kill()
    proc.wait(10)
    for f in (proc.stdin, proc.stdout, proc.stderr):
        f.close()


@pytest.fixture
def faults(tmp_path, monkeypatch):
    control = tmp_path / "faults"
    control.mkdir()
    monkeypatch.setenv(JOURNAL_FAULTS_ENV, str(control))
    monkeypatch.setenv("DSTL_ORPHAN_GRACE_MS", str(GRACE_MS))
    return control


def test_short_journal_writes_lose_no_acknowledged_confirm(runtime, tmp_path, faults):
    """Every journal write comes up short: a confirm is still recorded whole, survives a registry
    restart, and the confirmed file of a killed client survives the grace period."""
    base = tmp_path / "base"
    job = uuid.uuid4().hex
    (faults / "short").touch()
    proc, info = _start_client(base, job)
    keeper = None
    try:
        runtime.remember(info["service"])
        keeper = _storage(base, job_id=job, batch_persist_delay="0 ms")  # keeps the service up
        assert keeper.scheduler.service_pid == info["service"]
        assert _command(proc, "confirm 0") == {"ok": True}
        _restart_registry(keeper)  # replays the journal written in 7-byte pieces
        proc.kill()  # the client dies: its unconfirmed files become orphans
        proc.wait(10)
        files = info["files"]
        _wait(lambda: not os.path.exists(files[1]) and not os.path.exists(files[2]), 30,
              "the unconfirmed orphans to be deleted after the grace period")
        assert os.path.exists(files[0]), "an acknowledged confirm was lost: the confirmed file was deleted"
        assert keeper.registry.ref_count(_handle(files[0])) is None
    finally:
        _stop(proc)
        if keeper is not None:
            keeper.close()


def test_enospc_in_the_journal_fails_the_confirm_clearly_and_loses_nothing_acknowledged(runtime, tmp_path, faults,
                                                                                         caplog):
    base = tmp_path / "base"
    job = uuid.uuid4().hex
    proc, info = _start_client(base, job)
    keeper = None
    files = info["files"]
    try:
        runtime.remember(info["service"])
        keeper = _storage(base, job_id=job, batch_persist_delay="0 ms")
        assert _command(proc, "confirm 0") == {"ok": True}  # acknowledged before the disk filled up
        (faults / "enospc").write_bytes(b'"stop"')  # confirm records now fail half-written
        answer = _command(proc, "confirm 1")
        assert not answer["ok"], "a confirm the journal could not record must fail to its client"
        assert "journal" in answer["error"] and "No space left" in answer["error"], answer["error"]
        # and the error is pushed to every client's log (visible even if the service's log is full)
        deadline = time.monotonic() + 10
        while not [r for r in caplog.records if "upload service" in r.getMessage() and "journal" in r.getMessage()]:
            assert time.monotonic() < deadline, "the journal error was not pushed to the other clients"
            time.sleep(0.05)
        # the service keeps serving: uploads still work while confirms fail
        w = keeper.create_writer("op-keeper", KGR)
        w.append(1, b"still uploading")
        w.persist(0, 1).result(30)
        os.unlink(faults / "enospc")  # space again: the client retries its confirm
        assert _command(proc, "confirm 1") == {"ok": True}
        _restart_registry(keeper)  # the torn record must not hide the later acknowledged ones
        proc.kill()
        proc.wait(10)
        _wait(lambda: not os.path.exists(files[2]), 30, "the unconfirmed orphan to be deleted")
        assert os.path.exists(files[0]), "the confirm acknowledged before ENOSPC was lost"
        assert os.path.exists(files[1]), "the confirm acknowledged after ENOSPC was lost"
        w.close()
    finally:
        _stop(proc)
        if keeper is not None:
            keeper.close()


def _handle(path):
    from dstl.changelog.handles import StreamStateHandle

    return StreamStateHandle(path, 1)


def test_journal_unit_short_writes_and_a_failed_record_cut_off(tmp_path, monkeypatch):
    """The journal on its own: short writes are continued; a failed write leaves no torn record in
    the middle (later records replay), and raises JournalError without applying anything."""
    import errno

    from dstl.changelog.upload.service import journal as jmod

    j = jmod.Journal(str(tmp_path / "j"))
    state = j.load()
    real = jmod.os.write
    calls = {"n": 0}

    def short(fd, data):
        calls["n"] += 1
        return real(fd, bytes(data)[:3])

    monkeypatch.setattr(jmod, "write", short)
    op1 = ["start", 1, "/f1", 2, {"c": 2}]
    j.append(op1)
    state.apply(op1)
    assert calls["n"] > 3

    def enospc(fd, data):
        real(fd, bytes(data)[:5])
        raise OSError(errno.ENOSPC, "No space left on device")

    monkeypatch.setattr(jmod, "write", enospc)
    with pytest.raises(jmod.JournalError) as info:
        j.append(["stop", 2, "/f1"])
    assert info.value.errno == errno.ENOSPC and "not applied" in str(info.value)
    monkeypatch.setattr(jmod, "write", real)
    op3 = ["start", 3, "/f2", 1, {"c": 1}]
    j.append(op3)
    j.close()
    again = jmod.Journal(str(tmp_path / "j")).load()
    assert again.ref_count("/f1") == 2 and again.ref_count("/f2") == 1 and again.last_id == 3
