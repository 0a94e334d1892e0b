"""Upload service building blocks: the registry journal, shared-memory segments, the runtime lock."""
from __future__ import annotations

import json
import os
import subprocess
import sys
import threading
import time
from concurrent.futures import wait

import pytest

from dstl.changelog.upload.service import shm
from dstl.changelog.upload.service.journal import Journal, RegistryState
from dstl.changelog.upload.service.runtime import file_lock, pid_alive


def test_state_counts_shares_and_deletes_exactly_at_zero():
    s = RegistryState()
    assert s.apply(["start", 1, "f", 3, {"a": 2, "b": 1}]) == []
    assert s.apply(["release", 2, "f", "a"]) == []
    assert s.ref_count("f") == 2
    assert s.apply(["release", 2, "f", "a"]) == []  # the same id again: ignored (re-sent after a restart)
    assert s.ref_count("f") == 2
    assert s.apply(["drop_client", 3, "b", 0]) == []  # b's one share becomes an orphan, still counted
    assert s.ref_count("f") == 2 and s.orphans == {"f": [0, 1]}
    assert s.apply(["release", 4, "f", "a"]) == []
    assert s.resolve_orphan("f", keep=False) == ["f"]  # after the grace, unreferenced
    assert s.ref_count("f") is None and s.pending_delete == {"f"}
    # stop_tracking: the checkpoint owns the file; later releases never delete it
    s.apply(["start", 5, "g", 1, {"a": 1}])
    s.apply(["stop", 6, "g"])
    assert s.apply(["release", 7, "g", "a"]) == [] and s.apply(["drop_client", 8, "a"]) == []
    assert s.apply(["discard", 9, "h"]) == ["h"]
    with pytest.raises(ValueError, match="unknown registry operation"):
        s.apply(["bogus", 10])


def test_journal_replays_compacts_and_ignores_a_torn_record(tmp_path):
    j = Journal(str(tmp_path), compact_every=4)
    s = j.load()
    for op in (["start", 10, "a", 2, {"c": 2}], ["start", 11, "b", 1, {"c": 1}], ["release", 12, "b", "c"]):
        s.apply(op)
        j.append(op)
    j.append(["deleted", 0, "b"])
    s.pending_delete.discard("b")
    j.close()
    with open(tmp_path / "journal.log", "ab") as f:
        f.write(b'["release", 13, "a"')  # killed mid-write
    j2 = Journal(str(tmp_path), compact_every=4)
    s2 = j2.load()
    assert s2.last_id == 12 and s2.ref_count("a") == 2 and s2.ref_count("b") is None
    assert s2.pending_delete == set()
    assert (tmp_path / "journal.log").read_bytes().endswith(b"\n")  # torn tail cut off
    op = ["release", 13, "a", "c"]
    s2.apply(op)
    j2.append(op)
    j2.compact(s2)
    j2.close()
    assert (tmp_path / "journal.log").read_bytes() == b""
    snap = json.loads((tmp_path / "snapshot.json").read_text())
    assert snap["last_id"] == 13 and snap["entries"]["a"][0] == 1
    s3 = Journal(str(tmp_path)).load()
    assert s3.ref_count("a") == 1 and s3.last_id == 13


def test_pending_deletions_survive_in_the_journal(tmp_path):
    j = Journal(str(tmp_path))
    s = j.load()
    for op in (["start", 1, "x", 1, {}], ["release", 2, "x", None]):
        s.apply(op)
        j.append(op)
    j.close()
    assert Journal(str(tmp_path)).load().pending_delete == {"x"}  # deletion not confirmed: redo it


def _read_segment(name: str, n: int) -> bytes:
    fd = shm.open_readonly(name)
    try:
        return os.pread(fd, n, 0)
    finally:
        os.close(fd)


class _Streamed:
    """A body that only streams itself (no write_into), in small pieces."""

    def __init__(self, data: bytes):
        self.data = data

    def __len__(self) -> int:
        return len(self.data)

    def write_to(self, write, chunk_size: int) -> int:
        for i in range(0, len(self.data), 3):
            write(self.data[i:i + 3])
        return len(self.data)


def test_segments_take_every_kind_of_body_reuse_grow_and_sweep():
    from dstl._fast import _sealed_py
    from dstl.format import ChangeBuffer

    prefix = shm.segment_prefix(f"{os.getpid()}xunit", os.getpid(), "t1")
    name = prefix + "1"
    buf = ChangeBuffer()
    buf.append(3, b"sealed")
    sealed = buf.seal_body()
    bodies = [b"abc", memoryview(b"defgh"), bytearray(b""), sealed, _sealed_py.SealedBody(b"twin"),
              _Streamed(b"0123456789")]
    expected = b"abcdefgh" + sealed.tobytes() + b"twin0123456789"
    seg = shm.Segment(name, 1)
    try:
        assert seg.size == 64 << 10  # made in 64 KiB steps
        used, spans = seg.write(bodies)
        assert used == len(expected)
        assert spans[:3] == [(0, 3), (3, 5), (8, 0)] and spans[-1] == (len(expected) - 10, 10)
        assert _read_segment(name, used) == expected
        with pytest.raises(FileExistsError):
            shm.Segment(name, 1)
        assert seg.write([b"XY"]) == (2, [(0, 2)])  # reused: overwritten in place
        assert _read_segment(name, 2) == b"XY"
        big = os.urandom((1 << 20) + 5)
        assert seg.write([big]) == (len(big), [(0, len(big))])  # grown, under the same name
        assert seg.size == 2 << 20 and _read_segment(name, len(big)) == big
        assert shm.list_segments(prefix) == [name]
        assert shm.parse_name(name) == (os.getpid(), os.getpid())
        assert shm.sweep(prefix) == 1
        with pytest.raises(FileNotFoundError):  # swept: a kept mapping must not be written unseen
            seg.write([b"x"])
        other = shm.Segment(name, 1)  # the name made anew by someone else is not this segment
        with pytest.raises(FileNotFoundError):
            seg.write([b"x"])
        other.unlink()
    finally:
        seg.close()
        shm.sweep(prefix)
    assert shm.list_segments(prefix) == []
    assert shm.unlink(name) is False


def test_a_full_dev_shm_is_a_clear_error_and_leaves_no_segment(monkeypatch):
    """Pages are reserved with fallocate before the segment is mapped: no SIGBUS on a page later."""
    import errno

    def full(fd, offset, length):
        raise OSError(errno.ENOSPC, "No space left on device")

    monkeypatch.setattr(shm.os, "posix_fallocate", full)
    prefix = shm.segment_prefix(f"{os.getpid()}xunit", os.getpid(), "t9")
    with pytest.raises(OSError, match=r"shared memory \(/dev/shm\) is full: cannot hold 65536 bytes"):
        shm.Segment(prefix + "1", 10)
    assert shm.list_segments(prefix) == []


def test_segment_sizes_step_so_that_similar_bodies_share_segments():
    assert shm.segment_size(1) == 64 << 10
    assert shm.segment_size((64 << 10) + 1) == 128 << 10
    assert shm.segment_size((1 << 20) - 1) == 1 << 20
    assert shm.segment_size((5 << 20) + 1) == 6 << 20


def test_orphan_sweep_only_takes_segments_whose_processes_are_gone():
    dead = subprocess.run([sys.executable, "-c", "import os; print(os.getpid())"], capture_output=True,
                          text=True, check=True)
    dead_pid = int(dead.stdout)
    mine = shm.segment_prefix(f"{os.getpid()}xunit", dead_pid, "t2") + "1"
    orphan = shm.segment_prefix(f"{dead_pid}xunit", dead_pid, "t3") + "1"
    try:
        shm.Segment(mine, 1).close()
        shm.Segment(orphan, 1).close()
        assert shm.sweep_orphans(pid_alive) >= 1
        assert shm.list_segments(orphan) == [] and shm.list_segments(mine) == [mine]
    finally:
        shm.unlink(mine)
        shm.unlink(orphan)


def test_attaching_in_another_process_leaves_no_tracker_warnings():
    name = shm.segment_prefix(f"{os.getpid()}xunit", os.getpid(), "t4") + "1"
    seg = shm.Segment(name, 5)
    seg.write([b"hello"])
    seg.close()
    code = ("import sys; from dstl.changelog.upload.service import shm; s = shm.attach(sys.argv[1]); "
            "print(bytes(s.buf[:5]).decode()); s.close()")
    try:
        r = subprocess.run([sys.executable, "-c", code, name], capture_output=True, text=True, timeout=60,
                           env=dict(os.environ, PYTHONPATH=os.path.dirname(os.path.dirname(__file__))))
        assert r.stdout.strip() == "hello"
        assert "leaked" not in r.stderr and "resource_tracker" not in r.stderr
        assert shm.list_segments(name) == [name]  # the attacher's exit did not unlink it
    finally:
        shm.unlink(name)


def test_file_lock_excludes_and_times_out(tmp_path):
    path = str(tmp_path / "lock")
    held = threading.Event()
    release = threading.Event()

    def holder():
        with file_lock(path):
            held.set()
            release.wait(10)

    t = threading.Thread(target=holder)
    t.start()
    try:
        assert held.wait(10)
        start = time.monotonic()
        with pytest.raises(TimeoutError, match="could not lock"):
            with file_lock(path, timeout_s=0.2):
                pass
        assert time.monotonic() - start >= 0.2
    finally:
        release.set()
        t.join(10)
    with file_lock(path, timeout_s=1):
        pass


def test_a_lock_whose_directory_was_removed_meanwhile_is_not_held(tmp_path):
    """A client waits for the lock of a service directory that the exiting service removes (renamed
    aside, then deleted) while it waits, and another client makes the directory anew and locks the
    new lock file. The waiter must lock that new file, not the removed one: holding the old one, it
    once wrote its service's config.json into the directory the other was still deleting (the chaos
    test's "config.json: No such file" at start-up)."""
    import fcntl

    from dstl.changelog.upload.service import runtime

    d = tmp_path / "svc"
    d.mkdir()
    path = str(d / "lock")
    acquired = threading.Event()
    seen = {}

    def waiter():
        with file_lock(path, timeout_s=10):
            seen["ino"] = os.stat(path).st_ino
            acquired.set()

    other = None
    with file_lock(path):
        t = threading.Thread(target=waiter)
        t.start()
        time.sleep(0.2)  # the waiter has opened the old lock file and waits for it
        runtime._remove_dir(str(d))
        assert not d.exists() and not [n for n in os.listdir(tmp_path) if n.startswith(runtime.TRASH_PREFIX)]
        d.mkdir()
        other = os.open(path, os.O_RDWR | os.O_CREAT, 0o600)
        fcntl.flock(other, fcntl.LOCK_EX)  # the other client holds the new lock file
    try:
        assert not acquired.wait(0.5), "the waiter took the removed lock file as the lock"
    finally:
        new_ino = os.fstat(other).st_ino
        os.close(other)
    assert acquired.wait(10)
    t.join(10)
    assert seen["ino"] == new_ino


def test_sweep_removes_a_removed_directory_whose_remover_died(tmp_path):
    from dstl.changelog.upload.service import runtime

    dead = subprocess.run([sys.executable, "-c", "import os; print(os.getpid())"], capture_output=True,
                          text=True, check=True)
    mine = tmp_path / runtime._trash_name("abc.def")  # the name _remove_dir gives, with a dot in it
    orphan = tmp_path / f"{runtime.TRASH_PREFIX}abc.{dead.stdout.strip()}.00aa12"
    malformed = tmp_path / f"{runtime.TRASH_PREFIX}abc.x.00aa13"
    for d in (mine, orphan, malformed):
        (d / "journal").mkdir(parents=True)
        (d / "config.json").write_text("{}")
    runtime.sweep_runtime_dirs(str(tmp_path), grace_s=0)
    assert mine.exists() and not orphan.exists()  # a live remover finishes its own
    assert not malformed.exists()


def test_uploader_takes_the_file_name_the_service_announced(tmp_path):
    import uuid as _uuid

    from dstl.format import ChangeBuffer, to_logical
    from dstl.metrics import ChangelogStorageMetricGroup
    from dstl.changelog.registry import TaskChangelogRegistry
    from dstl.types import SealedChangeSet
    from dstl.changelog.upload.task import UploadTask
    from dstl.changelog.upload.uploader import StateChangeFsUploader

    job = "0123456789abcdef0123456789abcdef"
    reg = TaskChangelogRegistry()
    try:
        up = StateChangeFsUploader(str(tmp_path), job, None, 1 << 16, reg, ChangelogStorageMetricGroup(),
                                   str(tmp_path / "local"))
        buf = ChangeBuffer()
        buf.append(3, b"abc")
        body = buf.seal()
        task = UploadTask([SealedChangeSet(_uuid.UUID(int=1), 0, body, 3, 1)], lambda r: None, lambda s, e: None)
        name = str(_uuid.uuid4())
        res = up.upload([task], file_name=name)
        assert res.handle.path == f"{tmp_path}/{job}/dstl/{name}"
        assert res.local_handle.path == str(tmp_path / "local" / f"jid_{job}" / "taskowned" / name)
        assert bytes(to_logical(open(res.handle.path, "rb").read())) == bytes(
            to_logical(open(res.local_handle.path, "rb").read()))
        with pytest.raises(FileExistsError):  # an announced name is never overwritten
            up.upload([task], file_name=name)
        for bad in ("", "a/b", ".."):
            with pytest.raises(ValueError, match="invalid changelog file name"):
                up.upload([task], file_name=bad)
        default = up.upload([task])  # without a name: a fresh uuid4
        assert str(_uuid.UUID(os.path.basename(default.handle.path))) == os.path.basename(default.handle.path)
    finally:
        reg.close()


def test_a_dead_clients_shares_become_orphans_that_survive_a_restart(tmp_path):
    j = Journal(str(tmp_path / "j"))
    s = j.load()
    ops = [["start", 1, "common", 3, {"dead": 2, "live": 1}], ["start", 2, "alone", 1, {"dead": 1}],
           ["start", 3, "other", 1, {"live": 1}], ["drop_client", 4, "dead", 1000]]
    for op in ops:
        assert s.apply(op) == []  # nothing is deleted when a client dies
        j.append(op)
    assert s.orphans == {"common": [1000, 2], "alone": [1000, 1]}
    assert s.ref_count("common") == 3 and s.expired_orphans(1999, 1000) == []
    assert s.expired_orphans(2000, 1000) == ["alone", "common"]
    j.close()
    s2 = Journal(str(tmp_path / "j")).load()  # replayed: the orphans and their times are back
    assert s2.orphans == s.orphans and s2.ref_count("common") == 3
    # not referenced: the dead client's shares are released; the live share still holds "common"
    assert s2.resolve_orphan("common", keep=False) == []
    assert s2.ref_count("common") == 1 and s2.apply(["release", 5, "common", "live"]) == ["common"]
    # referenced by a checkpoint: untracked, never deleted by later releases
    assert s2.resolve_orphan("alone", keep=True) == [] and s2.ref_count("alone") is None
    assert s2.orphans == {}
    # a compacted snapshot keeps orphans too
    j3 = Journal(str(tmp_path / "k"))
    s3 = j3.load()
    for op in ops:
        s3.apply(op)
    j3.compact(s3)
    j3.close()
    assert Journal(str(tmp_path / "k")).load().orphans == {"common": [1000, 2], "alone": [1000, 1]}


def test_orphan_sweep_keeps_referenced_and_unreadable_deletes_the_rest(tmp_path, caplog):
    import logging

    from dstl.changelog.handles import ChangelogStateHandleStreamImpl, StreamStateHandle
    from dstl.state.metadata import CheckpointMetadata, SubtaskState, write_checkpoint
    from dstl.types import KeyGroupRange
    from dstl.changelog.upload.service.registry_proc import _Registry

    base = tmp_path / "base"
    files = []
    for i in range(3):
        f = base / "job" / "dstl" / f"f{i}"
        f.parent.mkdir(parents=True, exist_ok=True)
        f.write_bytes(b"\0" + b"x" * 10)
        files.append(str(f))
    reg = _Registry(None, str(tmp_path / "journal"), 1, str(base), grace_ms=1000)

    def op(o):
        with reg.lock:
            reg.state.apply(o)
            reg.journal.append(o)

    for n, path in enumerate(files):
        op(["start", n + 1, path, 1, {"dead": 1}])
    op(["drop_client", 10, "dead", int(time.time() * 1000)])
    handle = ChangelogStateHandleStreamImpl([(StreamStateHandle(files[0], 10), 0)], KeyGroupRange(0, 7), 10)
    write_checkpoint(str(base), CheckpointMetadata(7, 128, 1, [SubtaskState(0, KeyGroupRange(0, 7),
                                                                            changelog=[handle])]))
    reg.sweep()  # within the grace period: nothing happens
    assert sorted(reg.state.orphans) == sorted(files)
    with reg.lock:  # pretend the grace period is over
        for o in reg.state.orphans.values():
            o[0] -= 5000
    reg.sweep()
    wait(list(reg.futures))
    assert os.path.exists(files[0]) and not os.path.exists(files[1]) and not os.path.exists(files[2])
    assert reg.state.orphans == {} and reg.state.ref_count(files[0]) is None
    # unreadable checkpoint metadata: the orphan is kept (logged), not deleted
    f = base / "job" / "dstl" / "f3"
    f.write_bytes(b"\0")
    op(["start", 11, str(f), 1, {"d2": 1}])
    op(["drop_client", 12, "d2", 0])
    (base / "checkpoints" / "chk-8").mkdir()
    (base / "checkpoints" / "chk-8" / "_metadata").write_bytes(b"not a checkpoint")
    with caplog.at_level(logging.WARNING, logger="dstl.changelog.upload.service.registry"):
        reg.sweep()
    wait(list(reg.futures))
    assert f.exists() and reg.state.orphans == {} and "cannot be read" in caplog.text
    reg.finish()
    # the decisions are journaled: a restarted registry does not revisit them
    again = Journal(str(tmp_path / "journal")).load()
    assert again.orphans == {} and again.entries == {} and again.pending_delete == set()


def test_orphan_grace_comes_from_the_environment():
    from dstl.changelog.upload.service.registry_proc import DEFAULT_ORPHAN_GRACE_MS, orphan_grace_ms

    assert orphan_grace_ms({}) == DEFAULT_ORPHAN_GRACE_MS == 600_000
    assert orphan_grace_ms({"DSTL_ORPHAN_GRACE_MS": "250"}) == 250
    for bad in ("-1", "ten", "1.5"):
        with pytest.raises(ValueError, match="DSTL_ORPHAN_GRACE_MS"):
            orphan_grace_ms({"DSTL_ORPHAN_GRACE_MS": bad})


def test_sealed_bodies_are_built_into_the_segment_between_plain_buffers():
    from dstl.format import ChangeBuffer

    bodies, expected = [], []
    for n in (3, 50_000, 1):  # the middle body spans several streamed pieces
        b = ChangeBuffer()
        for i in range(n):
            b.append(i % 7, b"%d" % i * 7)
        body = b.seal_body()
        expected.append(body.tobytes())
        bodies.append(body)
    bodies.insert(1, b"plain")
    expected.insert(1, b"plain")
    prefix = shm.segment_prefix(f"{os.getpid()}xstream", os.getpid(), "t1")
    name = prefix + "1"
    try:
        seg = shm.Segment(name, 1)
        total, spans = seg.write(bodies)  # grows from 64 KiB to hold them
        seg.close()
        assert [n for _, n in spans] == [len(e) for e in expected] and total == sum(map(len, expected))
        seg = shm.attach(name)
        assert [bytes(seg.buf[o:o + n]) for o, n in spans] == expected
        seg.close()
    finally:
        shm.sweep(prefix)

    class Liar:  # claims more bytes than it streams: the segment must not be trusted
        def __len__(self):
            return 10

        def write_to(self, write, chunk_size=1 << 20):
            write(memoryview(b"short"))
            return 5

    seg = shm.Segment(name, 10)
    try:
        with pytest.raises(RuntimeError, match="streamed 5 bytes, but its length is 10"):
            seg.write([Liar()])
    finally:
        assert seg.unlink()


def test_an_operation_journaled_by_a_registry_that_died_before_acknowledging_it_completes(tmp_path, monkeypatch):
    """The registry journals a `start`, then dies before its Ack. The restarted registry says it
    applied it (its last id), so the waiting `apply` returns at once; it used to wait out its timeout
    (60 s in the service: the chaos test's slow runs, with the file tracked meanwhile)."""
    import multiprocessing

    from dstl.changelog.upload.service import journal
    from dstl.changelog.upload.service.forwarder import RegistryForwarder

    marker = tmp_path / "died"
    real_fsync = journal.fsync

    def fsync_then_die_once(fd):  # runs in the forked registry: a `start` is fsynced, then no Ack
        real_fsync(fd)
        if not marker.exists():
            marker.touch()
            os._exit(9)

    monkeypatch.setattr(journal, "fsync", fsync_then_die_once)
    fwd = RegistryForwarder(multiprocessing.get_context("fork"), str(tmp_path / "j"), 1)
    fwd.start()
    first = fwd.pid
    try:
        fwd.apply("start", "f", 2, {"a": 2}, timeout=10)  # raised UploadServiceError after 10 s
        assert marker.exists() and fwd.restarts == 1 and fwd.pid != first
        assert fwd.query("count", "f") == 2  # applied once, not twice
        assert fwd.pending() == 0
    finally:
        fwd.stop(10)
    assert Journal(str(tmp_path / "j")).load().ref_count("f") == 2


def test_a_registry_that_dies_before_its_hello_is_started_again(tmp_path, monkeypatch):
    """A registry process killed before it said hello (the chaos test kills it as an uploader, since
    it has no journal open yet): the service's registry used to stay down, and every attempt waited
    60 s for its intent to be journaled."""
    import multiprocessing

    from dstl.changelog.upload.service import registry_proc
    from dstl.changelog.upload.service.forwarder import RegistryForwarder

    marker = tmp_path / "died"
    real_main = registry_proc.registry_main

    def die_once(*args):  # runs in the forked registry process
        if not marker.exists():
            marker.touch()
            os._exit(9)
        real_main(*args)

    monkeypatch.setattr(registry_proc, "registry_main", die_once)
    fwd = RegistryForwarder(multiprocessing.get_context("fork"), str(tmp_path / "j"), 1)
    fwd.start()  # raised EOFError
    try:
        assert marker.exists()
        fwd.apply("start", "f", 1, {"a": 1}, timeout=10)
        assert fwd.query("count", "f") == 1
    finally:
        fwd.stop(10)


def test_an_uploader_that_dies_before_it_is_ready_is_started_again(tmp_path, monkeypatch):
    """The pool's start-up: one uploader process killed before its WorkerReady used to fail the
    whole start, and the service then failed every later upload."""
    import multiprocessing

    from dstl.changelog.upload.service import worker
    from dstl.changelog.upload.service.pool import UploaderPool

    marker = tmp_path / "died"
    real_main = worker.worker_main

    def die_once(conn):  # runs in the forked uploader process
        if not marker.exists():
            marker.touch()
            os._exit(9)
        real_main(conn)

    monkeypatch.setattr(worker, "worker_main", die_once)
    pool = UploaderPool(multiprocessing.get_context("fork"), 2, start_timeout_s=20)
    try:
        pool.start()  # raised UploadServiceError("an uploader process died while starting")
        assert marker.exists() and len(pool.pids()) == 2
        assert all(pid_alive(p) for p in pool.pids())
    finally:
        pool.close()
