"""Nothing left behind: clients and upload services killed with SIGKILL in a loop, then one more
client: the counts of runtime directories, download caches and shared-memory segments return to
their baseline. Closing a reader's storage removes its download cache."""
from __future__ import annotations

import os
import signal
import time
import uuid

from conftest import heavy
from service_util import children_of, python_child, wait_dead
from service_util import runtime  # noqa: F401  (fixture)

_CLIENT = r"""
import os, sys, time
from dstl.changelog.storage import open_storage
from dstl.types import KeyGroupRange
base, job, mode = sys.argv[1], sys.argv[2], sys.argv[3]
s = open_storage(base, upload_mode="process", job_id=job, batch_persist_delay="1 ms", upload_timeout="20 s")
w = s.create_writer("op", KeyGroupRange(0, 127))
reader = s.create_reader()  # its download cache: a temporary directory
if mode == "work":
    for j in range(50):
        w.append(j % 128, b"x" * 2000)
    w.persist(0, 1).result(60)
    for j in range(50):  # appended, not persisted: the next persist's body is built in shared memory
        w.append(j % 128, b"y" * 2000)
print("READY", s.scheduler.connection.service_pid, flush=True)
if mode == "close":
    w.close()
    s.close()
    sys.exit(0)
time.sleep(600)
"""


def _kill(pids):
    for p in pids:
        try:
            os.kill(p, signal.SIGKILL)
        except ProcessLookupError:
            pass
    assert wait_dead(pids, 20) == []


def _segments(pids):
    """Our /dev/shm segments: those whose name carries one of `pids` (other test runs share /dev/shm)."""
    from dstl.changelog.upload.service import shm

    out = []
    for n in shm.list_segments():
        owner = shm.parse_name(n)
        if owner is not None and (owner[0] in pids or owner[1] in pids):
            out.append(n)
    return out


def _start(base, job, mode, env):
    p = python_child(_CLIENT, str(base), job, mode, env=env)
    line = p.stdout.readline().split()
    assert line[:1] == ["READY"], p.stderr.read() if p.poll() is not None else line
    return p, int(line[1])


@heavy  # a kill loop
def test_kill_loop_leaves_nothing_behind(runtime, tmp_path):
    tmp = tmp_path / "tmp"
    tmp.mkdir()
    # DSTL_CLIENT_WRITES=0: bodies bound for raw local files go through shared memory, which is what
    # a killed client can leave behind (its own writes leave nothing there)
    env = dict(os.environ, TMPDIR=str(tmp), DSTL_ORPHAN_GRACE_MS="200", DSTL_SERVICE_LINGER_MS="2000",
               DSTL_SWEEP_GRACE_S="0", DSTL_CLIENT_WRITES="0")
    base = tmp_path / "base"
    base.mkdir()
    other = tmp_path / "other"  # another configuration: a service of its own, killed while idle
    other.mkdir()
    job = uuid.uuid4().hex
    seen = set()
    children = []
    caches = lambda: sorted(n for n in os.listdir(tmp) if n.startswith("dstl-download-cache-"))  # noqa: E731
    dirs = lambda: sorted(os.listdir(runtime.root))  # noqa: E731
    assert (caches(), dirs()) == ([], [])
    try:
        for i in range(4):
            p, service = _start(base, job, "work", env)
            children.append(p)
            seen |= {p.pid, service}
            family = [service] + children_of(service)
            assert caches() and dirs() and _segments({p.pid})
            victims = [p.pid] + (family if i % 2 else [])  # odd rounds: the service dies too
            _kill(victims)
            runtime.remember(service)
        p, service = _start(other, uuid.uuid4().hex, "idle", env)
        children.append(p)
        seen |= {p.pid, service}
        runtime.remember(service)
        _kill([p.pid, service] + children_of(service))
        # each new client swept its dead predecessors' caches: only the last killed one's is left
        assert len(dirs()) == 2 and caches() == [c for c in caches() if f"-{p.pid}-" in c] and len(caches()) == 1
        # one more client: it sweeps, its service replays the dead one's journal (whose orphans go
        # after the grace period); it writes nothing itself and closes cleanly
        p, service = _start(base, job, "close", env)
        children.append(p)
        runtime.remember(service)
        seen |= {p.pid, service}
        assert p.wait(60) == 0
        deadline = time.monotonic() + 60
        while time.monotonic() < deadline and (dirs() or caches() or _segments(seen)):
            time.sleep(0.1)
        left = {d: sorted(os.listdir(os.path.join(runtime.root, d))) for d in dirs()}
        if left:  # say why: the journal's state and the service log
            from dstl.changelog.upload.service.journal import Journal
            for d in left:
                j = Journal(os.path.join(runtime.root, d, "journal"))
                st = j.load()
                j.close()
                left[d].append(repr((st.entries, st.orphans, st.pending_delete, st.intents)))
                try:
                    left[d].append(open(os.path.join(runtime.root, d, "service.log")).read()[-1500:])
                except OSError:
                    pass
        assert (left, caches(), _segments(seen)) == ({}, [], [])
        assert not os.listdir(tmp)  # no pymp-* either: the services' temporary files were in their dirs
    finally:
        for c in children:
            if c.poll() is None:
                c.kill()
            c.wait()


def test_closing_a_storage_removes_its_download_cache(tmp_path, monkeypatch):
    import gc

    from dstl.changelog.reader import DownloadCache
    from dstl.changelog.storage import open_storage

    monkeypatch.setenv("TMPDIR", str(tmp_path))
    import tempfile

    monkeypatch.setattr(tempfile, "tempdir", None)  # re-read TMPDIR
    with open_storage(str(tmp_path / "base"), upload_mode="direct") as s:
        s.create_reader()
        directory = s._cache.directory
        assert os.path.isdir(directory) and os.path.basename(directory).startswith(f"dstl-download-cache-{os.getpid()}-")
    assert not os.path.exists(directory)
    cache = DownloadCache(1000)  # never closed: it goes with its object
    directory = cache.directory
    del cache
    gc.collect()
    assert not os.path.exists(directory)
    dead = tmp_path / "dstl-download-cache-999999999-x"  # no such pid
    dead.mkdir()
    from dstl.changelog.reader import sweep_download_caches

    assert sweep_download_caches(str(tmp_path)) == 1 and not dead.exists()
