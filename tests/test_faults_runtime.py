"""Faults around the upload service's runtime directory: paths too long for a Unix socket (a long
TMPDIR or DSTL_RUNTIME_DIR), and a temp cleaner that removes the directory of a running service."""
from __future__ import annotations

import os
import shutil
import signal
import subprocess
import sys
import tempfile

import pytest

from service_util import alive, children_of, process_storage, runtime, wait_dead  # noqa: F401
from dstl import runtime_dir
from dstl.types import KeyGroupRange

KGR = KeyGroupRange(0, 127)
HERE = os.path.dirname(os.path.abspath(__file__))


def _long_dir(parent: str, length: int) -> str:
    """A fresh directory whose absolute path is exactly `length` characters."""
    base = tempfile.mkdtemp(prefix="dlong", dir=parent)
    path = base + "/" + "d" * (length - len(base) - 1)
    os.makedirs(path)
    assert len(path) == length
    return path


def _round_trip(storage, payload: bytes) -> list:
    w = storage.create_writer("op", KGR)
    w.append(1, payload)
    handle = w.persist(0, 1).result(60).job_manager_owned_snapshot
    got = [bytes(c.data) for c in storage.create_reader().get_changes(handle)]
    w.close()
    return got


def test_a_short_root_is_its_own_socket_root_and_a_long_one_gets_a_short_link(tmp_path):
    assert runtime_dir.socket_root("/tmp/dstl-x") == "/tmp/dstl-x"
    long_root = _long_dir(str(tmp_path), 200)
    link = runtime_dir.socket_root(long_root)
    try:
        assert link != long_root and os.path.islink(link) and os.readlink(link) == long_root
        # every socket below the link fits: the service's and the forkserver's listener
        assert len(link) + runtime_dir.SOCKET_TAIL < runtime_dir.SUN_PATH_MAX
        assert oct(os.stat(os.path.dirname(link)).st_mode & 0o777) == "0o700"
        assert runtime_dir.socket_root(long_root) == link  # idempotent
        # a link to a removed root is swept
        shutil.rmtree(long_root)
        assert runtime_dir.sweep_socket_links() >= 1 and not os.path.lexists(link)
    finally:
        if os.path.lexists(link):
            os.unlink(link)


def test_without_a_short_directory_the_error_names_path_limit_and_variable(tmp_path, monkeypatch):
    long_root = _long_dir(str(tmp_path), 200)
    nowhere = _long_dir(str(tmp_path), 120)  # a link base too long to help
    monkeypatch.setattr(runtime_dir, "_link_bases", lambda: [nowhere])
    with pytest.raises(OSError) as info:
        runtime_dir.socket_root(long_root)
    msg = str(info.value)
    assert "\n" not in msg
    assert long_root in msg and f"{runtime_dir.SUN_PATH_MAX - 1}-byte limit" in msg and "DSTL_RUNTIME_DIR" in msg
    # a link directory of another mode (or owner) is refused, not used
    monkeypatch.setattr(runtime_dir, "_link_bases", lambda: [str(tmp_path)])
    os.makedirs(tmp_path / f"dstl-sock-{os.getuid()}", mode=0o755)
    os.chmod(tmp_path / f"dstl-sock-{os.getuid()}", 0o755)
    with pytest.raises(OSError, match="DSTL_RUNTIME_DIR"):
        runtime_dir.socket_root(long_root)


_CHILD = r"""
import os, sys, uuid
from dstl.changelog.storage import open_storage
from dstl.types import KeyGroupRange
s = open_storage(sys.argv[1], upload_mode='process', job_id=uuid.uuid4().hex)
print(s.scheduler.service_pid, flush=True)
w = s.create_writer("op", KeyGroupRange(0, 127))
w.append(1, b"long-path" * 10)
h = w.persist(0, 1).result(60).job_manager_owned_snapshot
assert [bytes(c.data) for c in s.create_reader().get_changes(h)] == [b"long-path" * 10]
status = s.scheduler.status()
print(len(status["uploader_pids"]), status["registry_pid"], flush=True)
w.close()
s.close()
print("ok", flush=True)
"""


def test_process_mode_round_trip_under_a_200_character_tmpdir_and_runtime_dir(tmp_path):
    """Default process mode, in a fresh process whose TMPDIR and DSTL_RUNTIME_DIR are 200 characters
    each: the service, its forkserver and its uploaders start, a persist round-trips, and the
    service exits after its linger, leaving no process behind."""
    tmpdir = _long_dir("/tmp", 200)
    rundir = _long_dir("/tmp", 200)
    env = dict(os.environ, TMPDIR=tmpdir, DSTL_RUNTIME_DIR=rundir, DSTL_SERVICE_LINGER_MS="300")
    env["PYTHONPATH"] = os.pathsep.join([os.path.dirname(HERE), HERE] + [p for p in [env.get("PYTHONPATH")] if p])
    service = None
    try:
        p = subprocess.run([sys.executable, "-c", _CHILD, str(tmp_path / "base")], env=env, timeout=180,
                           capture_output=True, text=True)
        lines = p.stdout.split()
        assert p.returncode == 0, p.stderr[-3000:]
        service = int(lines[0])
        assert int(lines[1]) >= 1 and lines[2] != "None" and lines[-1] == "ok"
        assert wait_dead([service], 20) == [], "the service must exit after its linger"
        service = None
        # its directory went with it or holds only the journal of files awaiting their grace period
        for d in os.listdir(rundir):
            assert not os.path.exists(os.path.join(rundir, d, "sock"))
            assert not os.path.exists(os.path.join(rundir, d, "pid"))
    finally:
        if service is not None:
            for pid in [service] + children_of(service):
                try:
                    os.kill(pid, signal.SIGKILL)
                except ProcessLookupError:
                    pass
        shutil.rmtree(os.path.dirname(tmpdir), ignore_errors=True)
        shutil.rmtree(os.path.dirname(rundir), ignore_errors=True)
        runtime_dir.sweep_socket_links()


def _service_dir(storage) -> str:
    return storage.scheduler.connection.paths.directory


def test_a_service_whose_directory_a_temp_cleaner_removed_finishes_and_exits(runtime, tmp_path):
    s = process_storage(tmp_path / "base")
    pid = runtime.remember(s.scheduler.service_pid)
    family = [pid] + children_of(pid)
    assert len(family) >= 3  # the service, its forkserver, its registry and uploaders
    assert _round_trip(s, b"a" * 10) == [b"a" * 10]
    directory = _service_dir(s)
    shutil.rmtree(directory)  # what systemd-tmpfiles or an operator does
    # the connected client goes on: its persists still work
    assert _round_trip(s, b"b" * 10) == [b"b" * 10]
    s.close()
    # it noticed, finished, and exits once idle (linger 300 ms, checked every second)
    assert wait_dead(family, 15) == [], "the orphaned service and its children must exit"
    # the next client starts a fresh service in a fresh directory
    s2 = process_storage(tmp_path / "base")
    pid2 = runtime.remember(s2.scheduler.service_pid)
    assert pid2 != pid and os.path.isdir(directory)
    assert _round_trip(s2, b"c" * 10) == [b"c" * 10]
    family2 = [pid2] + children_of(pid2)
    s2.close()
    assert wait_dead(family2, 15) == []


def test_an_orphaned_service_leaves_the_fresh_service_in_its_old_path_alone(runtime, tmp_path):
    old = process_storage(tmp_path / "base")
    pid = runtime.remember(old.scheduler.service_pid)
    old_family = [pid] + children_of(pid)
    directory = _service_dir(old)
    shutil.rmtree(directory)
    # a new client while the old one is still connected: a fresh service in a new directory there
    new = process_storage(tmp_path / "base")
    pid2 = runtime.remember(new.scheduler.service_pid)
    assert pid2 != pid
    paths = new.scheduler.connection.paths
    assert paths.read_pid() == pid2
    assert _round_trip(old, b"o" * 10) == [b"o" * 10]  # the old service still serves its client
    old.close()
    assert wait_dead(old_family, 15) == []
    # the old one touched nothing of the new one's: socket, pid file, and it still serves
    assert os.path.exists(paths.socket) and paths.read_pid() == pid2 and alive(pid2)
    assert _round_trip(new, b"n" * 10) == [b"n" * 10]
    family2 = [pid2] + children_of(pid2)
    new.close()
    assert wait_dead(family2, 15) == []
