"""A full local disk (ENOSPC, on a real tmpfs of a few hundred KiB): the local-recovery directory and
the download cache fall back to the base path and say so once; a full runtime directory fails with a
clear error; nothing is lost, and once space returns the next persist or read is normal again.

The tmpfs needs `mount` (root, or a container that allows it); elsewhere these tests are skipped.
"""
from __future__ import annotations

import logging
import os
import subprocess
import uuid

import pytest

from faultyfs import faulty  # noqa: F401  (fixture)
from service_util import process_storage, runtime  # noqa: F401  (runtime: fixture)
from dstl.changelog.storage import open_storage
from dstl.types import KeyGroupRange

KGR = KeyGroupRange(0, 127)
PAYLOAD = 40_000  # a change set larger than what is left on the full tmpfs


@pytest.fixture
def tmpfs(tmp_path):
    """A 256 KiB tmpfs at `tmp_path/small`, unmounted afterwards."""
    mnt = tmp_path / "small"
    mnt.mkdir()
    p = subprocess.run(["mount", "-t", "tmpfs", "-o", "size=256k,mode=0700", "tmpfs", str(mnt)],
                       capture_output=True, text=True)
    if p.returncode != 0:
        pytest.skip(f"cannot mount a tmpfs here: {p.stderr.strip()}")
    try:
        yield mnt
    finally:
        subprocess.run(["umount", "-l", str(mnt)], check=False)


def _fill(directory) -> str:
    """Fill the file system of `directory` (a filler file); returns its path."""
    filler = os.path.join(directory, "filler")
    fd = os.open(filler, os.O_WRONLY | os.O_CREAT | os.O_TRUNC, 0o600)
    try:
        for size in (65536, 4096, 512, 1):  # down to the last byte
            try:
                while True:
                    os.write(fd, b"\0" * size)
            except OSError:
                pass
    finally:
        os.close(fd)
    return filler


def _persist(storage, writer, payload: bytes, cid: int):
    """Persist one new change set (only it: its handle has a local copy or not)."""
    sqn = writer.next_sequence_number()
    writer.append(1, payload)
    r = writer.persist(sqn, cid).result(60)
    got = [bytes(c.data) for c in storage.create_reader().get_changes(r.job_manager_owned_snapshot)]
    return r, got


@pytest.mark.parametrize("mode", ["thread", "process"])
def test_a_full_local_recovery_directory_costs_the_local_copy_not_the_persist(mode, tmpfs, tmp_path, runtime,
                                                                              caplog):
    caplog.set_level(logging.WARNING)
    local = tmpfs / "lr"
    s = open_storage(str(tmp_path / "base"), upload_mode=mode, job_id=uuid.uuid4().hex,
                     local_recovery_dir=str(local), batch_persist_delay="0 ms")
    if mode == "process":
        runtime.remember(s.scheduler.service_pid)
    w = s.create_writer("op", KGR)
    r, _ = _persist(s, w, b"a" * 100, 1)
    assert r.task_local_snapshot is not None  # room: a local copy
    filler = _fill(str(tmpfs))
    payloads = [bytes([65 + i]) * PAYLOAD for i in range(1, 4)]
    for i, p in enumerate(payloads, start=2):
        r, got = _persist(s, w, p, i)
        assert got == [p]  # nothing lost: the change reads back
        assert r.task_local_snapshot is None  # ... from the base path, without a local copy
    os.remove(filler)  # space returns
    r, got = _persist(s, w, b"z" * 100, 5)
    assert r.task_local_snapshot is not None and got == [b"z" * 100]
    assert all(os.path.exists(stream.path) for stream, _off in r.task_local_snapshot.handles_and_offsets)
    w.close()
    s.close()
    if mode == "thread":
        text = caplog.text
    else:
        from service_util import wait_dead

        wait_dead([runtime.seen[0]], 15)
        logs = [os.path.join(runtime.root, d, "service.log") for d in os.listdir(runtime.root)]
        text = "".join(open(p).read() for p in logs if os.path.exists(p))
        text += caplog.text
    assert text.count("local-recovery directory") and text.count("is full") == 1, text[-3000:]
    assert text.count("has room again:") == 1


def test_a_full_download_cache_reads_from_the_base_path_and_says_so_once(tmpfs, faulty, caplog):
    """The cache's directory on the full tmpfs; the files on a store that is not the local disk
    (the tests' `faulty://` wrapper, without faults: fsspec's memory:// would be read in place)."""
    from dstl.changelog.reader import DownloadCache
    from faultyfs import faulty_url

    caplog.set_level(logging.WARNING)
    s = open_storage(faulty_url(tmpfs.parent / "store"), upload_mode="thread", job_id=uuid.uuid4().hex,
                     batch_persist_delay="0 ms")
    w = s.create_writer("op", KGR)
    streams = []
    for i in range(3):
        w.append(1, bytes([97 + i]) * PAYLOAD)
        h = w.persist(0, i + 1).result(60).job_manager_owned_snapshot
        streams.append(h.handles_and_offsets[-1][0])
    cache = DownloadCache(600_000, directory=str(tmpfs / "cache"))
    try:
        assert cache.applies_to(streams[0])
        filler = _fill(str(tmpfs))
        uncached = []
        for stream in streams:  # every file read, none cached: the disk is full
            src = cache.open(stream)
            uncached.append(bytes(src.logical))
            src.close()
        assert all(bytes([97 + i]) * PAYLOAD in data for i, data in enumerate(uncached))
        assert cache.downloads == 0 and cache.cached_paths() == []
        assert caplog.text.count("is full") == 1
        os.remove(filler)  # space returns: the next download is cached again
        src = cache.open(streams[-1])
        assert bytes(src.logical) == uncached[-1]
        src.close()
        assert cache.downloads == 1 and cache.cached_paths() == [streams[-1].path]
        assert caplog.text.count("has room again:") == 1, caplog.text
    finally:
        cache.close()
        w.close()
        s.close()


def test_a_full_runtime_directory_fails_with_a_clear_error(tmpfs, tmp_path, monkeypatch):
    root = tmpfs / "rt"
    monkeypatch.setenv("DSTL_RUNTIME_DIR", str(root))
    os.makedirs(root, mode=0o700)
    filler = _fill(str(tmpfs))
    with pytest.raises(OSError) as info:
        process_storage(tmp_path / "base")
    msg = str(info.value)
    assert "No space left on device" in msg and str(root) in msg, msg
    os.remove(filler)
    s = process_storage(tmp_path / "base")  # space is back: a service starts
    pid = s.scheduler.service_pid
    try:
        w = s.create_writer("op", KGR)
        w.append(1, b"x" * 10)
        h = w.persist(0, 1).result(60).job_manager_owned_snapshot
        assert [bytes(c.data) for c in s.create_reader().get_changes(h)] == [b"x" * 10]
        w.close()
        s.close()
    finally:
        from service_util import stop_services_under

        stop_services_under(str(root))
        assert pid
