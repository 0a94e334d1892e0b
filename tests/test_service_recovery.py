"""The upload service never hangs: stopped, hung or dead uploader processes and a dead worker starter
(the forkserver) are killed and replaced, with real signals (issue 9, items 1 and 2)."""
from __future__ import annotations

import os
import signal
import time

import pytest
from conftest import heavy
from service_util import alive, children_of, wait_dead
from service_util import process_storage as _storage, runtime  # noqa: F401  (runtime: fixture)

from dstl.changelog.upload.service.client import CLIENT_WRITES_ENV
from dstl.types import KeyGroupRange

pytestmark = heavy  # real service processes and signals; the service's code is the same under both builds

KGR = KeyGroupRange(0, 127)


@pytest.fixture(autouse=True)
def _uploaders_write(monkeypatch):
    """These faults hit the uploader processes, which write raw local files only when the clients do
    not write their own change sets (DSTL_CLIENT_WRITES=0); test_service_client_writes.py has the
    faults of the clients' side."""
    monkeypatch.setenv(CLIENT_WRITES_ENV, "0")
CONSTANT_S = 3.0  # the "small constant" of the bound: scheduling, replacement start, round trips


def _bound_s(storage) -> float:
    c = storage.config
    return c.max_attempts * (c.upload_timeout_ms + c.next_attempt_delay_ms) / 1000.0 + CONSTANT_S


def _cmdline(pid: int) -> str:
    try:
        with open(f"/proc/{pid}/cmdline", "rb") as f:
            return f.read().replace(b"\0", b" ").decode(errors="replace")
    except OSError:
        return ""


def _ppid(pid: int) -> int:
    try:
        with open(f"/proc/{pid}/stat") as f:
            return int(f.read().rsplit(")", 1)[1].split()[1])
    except (OSError, ValueError, IndexError):
        return -1


def _forkservers(service_pid: int):
    """The service's own forkserver (its workers are the forkserver's children, same command line)."""
    return [p for p in children_of(service_pid) if _ppid(p) == service_pid and "forkserver" in _cmdline(p)]


def _persist_timed(writer, sqn: int, timeout: float):
    writer.append(sqn % 128, b"v%d" % sqn)
    t = time.monotonic()
    fut = writer.persist(sqn, 1)
    try:
        result = fut.result(timeout)
        err = None
    except Exception as exc:  # noqa: BLE001 - the test judges the outcome below
        result, err = None, exc
    return time.monotonic() - t, result, err


def test_sigstop_every_uploader_then_every_persist_ends_within_the_bound(runtime, tmp_path):
    s = _storage(tmp_path / "base", upload_timeout="1 s", upload_next_attempt_delay="50 ms",
                 batch_persist_delay="0 ms")
    runtime.remember(s.scheduler.service_pid)
    stopped = list(s.scheduler.status()["uploader_pids"])
    assert len(stopped) == s.config.upload_num_threads
    bound = _bound_s(s)
    w = s.create_writer("op", KGR)
    for p in stopped:
        os.kill(p, signal.SIGSTOP)
    try:
        outcomes = [_persist_timed(w, i, bound + 30) for i in range(4)]
        for i, (took, _result, err) in enumerate(outcomes):
            assert took <= bound, f"persist {i} took {took:.1f} s, more than the bound {bound:.1f} s ({err!r})"
        first_err = outcomes[0][2]
        assert first_err is None or isinstance(first_err, TimeoutError), repr(first_err)
        for i, (_took, result, err) in enumerate(outcomes[1:], 1):
            assert err is None, f"persist {i} failed on replacement uploaders: {err!r}"
            assert result is not None
        now = s.scheduler.status()["uploader_pids"]
        assert not set(now) & set(stopped), "the stopped uploaders must have been replaced"
        # the stopped processes were killed (not left behind), never resumed by anybody
        assert wait_dead(stopped, 10) == []
    finally:
        for p in stopped:
            if alive(p):
                os.kill(p, signal.SIGKILL)
    w.close()
    s.close()


def test_sigkill_of_every_idle_uploader_costs_no_attempt(runtime, tmp_path):
    s = _storage(tmp_path / "base", batch_persist_delay="0 ms")
    runtime.remember(s.scheduler.service_pid)
    w = s.create_writer("op", KGR)
    w.append(1, b"warm-up")
    w.persist(0, 1).result(20)
    victims = list(s.scheduler.status()["uploader_pids"])
    for p in victims:
        os.kill(p, signal.SIGKILL)
    assert wait_dead(victims, 10) == []
    took, result, err = _persist_timed(w, 1, 30)
    assert err is None, repr(err)
    assert took <= _bound_s(s)
    m = s.metrics
    assert m["ChangelogStorage.attemptsPerUpload"]["max"] == 1, "a dead idle uploader must cost no attempt"
    assert m["ChangelogStorage.numberOfUploadFailures"] == 0
    assert not set(s.scheduler.status()["uploader_pids"]) & set(victims)
    w.close()
    s.close()


def test_sigkill_of_the_worker_starter_keeps_uploads_and_replacements_working(runtime, tmp_path):
    s = _storage(tmp_path / "base", batch_persist_delay="0 ms")
    pid = runtime.remember(s.scheduler.service_pid)
    w = s.create_writer("op", KGR)
    starters = _forkservers(pid)
    assert len(starters) == 1, [(p, _cmdline(p)) for p in children_of(pid)]
    os.kill(starters[0], signal.SIGKILL)
    assert wait_dead(starters, 10) == []
    for i in range(3):
        took, result, err = _persist_timed(w, i, 30)
        assert err is None, f"persist {i} after the forkserver died: {err!r}"
    assert s.metrics["ChangelogStorage.numberOfUploadFailures"] == 0
    # replacing a worker needs a working starter: kill every uploader, the next persist still succeeds
    victims = list(s.scheduler.status()["uploader_pids"])
    for p in victims:
        os.kill(p, signal.SIGKILL)
    assert wait_dead(victims, 10) == []
    took, result, err = _persist_timed(w, 3, 30)
    assert err is None, repr(err)
    assert s.metrics["ChangelogStorage.numberOfUploadFailures"] == 0
    assert not set(s.scheduler.status()["uploader_pids"]) & set(victims)
    w.close()
    s.close()


def test_an_uploader_hung_mid_attempt_is_killed_once_a_speculative_attempt_won_and_replaced(runtime, tmp_path):
    from service_util import gate_url, held_pids

    base = tmp_path / "base"
    base.mkdir()
    s = _storage(gate_url(base), upload_timeout="500 ms", batch_persist_delay="0 ms")
    runtime.remember(s.scheduler.service_pid)
    w = s.create_writer("op", KGR)
    (base / ".gate-once").touch()  # the first attempt hangs in its uploader
    took, result, err = _persist_timed(w, 0, 30)
    assert err is None, repr(err)
    hung = held_pids(base)
    assert hung, "the first attempt should have been held"
    assert wait_dead(hung, 10) == [], "the hung uploader must be killed once its action is decided"
    deadline = time.monotonic() + 20
    while len(s.scheduler.status()["uploader_pids"]) < s.config.upload_num_threads:
        assert time.monotonic() < deadline, "the killed uploader was not replaced"
        time.sleep(0.05)
    w.close()
    s.close()
    for n in os.listdir(base):
        if n.startswith(".held-") or n.startswith(".gate"):
            os.unlink(base / n)
