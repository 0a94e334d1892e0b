"""The fault-injecting test filesystem behaves as documented (other suites rely on it)."""
from __future__ import annotations

import threading
import time

import fsspec
import pytest

from faultyfs import FAULTS, FaultyFileSystem, faulty, faulty_url  # noqa: F401


@pytest.fixture
def fs_and_dir(faulty, tmp_path):
    fs, root = fsspec.core.url_to_fs(faulty_url(tmp_path))
    assert isinstance(fs, FaultyFileSystem) and root == str(tmp_path)
    return fs, tmp_path


def _write(fs, path, data=b"hello world", mode="wb"):
    with fs.open(path, mode) as f:
        f.write(data)


def test_plain_operations_and_counters(fs_and_dir):
    fs, d = fs_and_dir
    url = faulty_url(d) + "/x/f"
    fs.makedirs(faulty_url(d) + "/x", exist_ok=True)
    _write(fs, url)
    assert (d / "x" / "f").read_bytes() == b"hello world"
    assert fs.cat_file(url) == b"hello world" and fs.cat_file(url, 6) == b"world"
    assert fs.cat_file(url, 0, 5) == b"hello" and fs.exists(url)
    assert fs.unstrip_protocol(str(d / "x" / "f")) == url
    fs.pipe_file(url + "2", b"abc")
    assert (d / "x" / "f2").read_bytes() == b"abc"
    fs.rm_file(url)
    assert not (d / "x" / "f").exists()
    assert (FAULTS.write_opens, FAULTS.completed_writes, FAULTS.read_opens, FAULTS.deletes) == (2, 2, 3, 1)
    assert FAULTS.bytes_written == 14 and FAULTS.failed_writes == 0
    with fsspec.open(url + "3", "wb") as f:  # the top-level API reaches it too
        f.write(b"z")
    assert (d / "x" / "f3").read_bytes() == b"z"


def test_exclusive_create(fs_and_dir):
    fs, d = fs_and_dir
    url = faulty_url(d) + "/f"
    _write(fs, url, mode="xb")
    with pytest.raises(FileExistsError):
        _write(fs, url, mode="xb")


def test_fail_writes_at_open_and_at_write_in_fifo_order(fs_and_dir):
    fs, d = fs_and_dir
    url = faulty_url(d) + "/f"
    FAULTS.fail_writes(2)
    FAULTS.fail_writes(1, at="write")
    for _ in range(2):
        with pytest.raises(OSError, match="at open"):
            _write(fs, url)
    assert not (d / "f").exists()
    with pytest.raises(OSError, match="at write"):
        _write(fs, url)
    _write(fs, url)  # the queue is empty: works
    assert (d / "f").read_bytes() == b"hello world"
    assert FAULTS.failed_writes == 3 and FAULTS.write_opens == 4 and FAULTS.completed_writes == 1
    assert [e[2] for e in FAULTS.events] == ["open", "open", "write", None]


def test_fail_after_bytes_keeps_k_bytes(fs_and_dir):
    fs, d = fs_and_dir
    url = faulty_url(d) + "/f"
    FAULTS.fail_after_bytes(4)
    with pytest.raises(OSError, match="after 4 bytes"):
        with fs.open(url, "wb") as f:
            f.write(b"ab")
            f.write(b"cdef")
    assert (d / "f").read_bytes() == b"abcd"


def test_partial_then_fail_at_close_and_fail_at_close(fs_and_dir):
    fs, d = fs_and_dir
    FAULTS.partial_then_fail_at_close(3)
    FAULTS.fail_at_close()
    with pytest.raises(OSError, match="at close after keeping 3 bytes"):
        _write(fs, faulty_url(d) + "/p")
    assert (d / "p").read_bytes() == b"hel"
    with pytest.raises(OSError, match="at close"):
        _write(fs, faulty_url(d) + "/c")
    assert (d / "c").read_bytes() == b"hello world"  # complete, yet the close failed
    assert FAULTS.failed_writes == 2 and FAULTS.completed_writes == 0


def test_succeed_places_faults_later(fs_and_dir):
    fs, d = fs_and_dir
    FAULTS.succeed(2)
    FAULTS.fail_writes(1)
    _write(fs, faulty_url(d) + "/1")
    _write(fs, faulty_url(d) + "/2")
    with pytest.raises(OSError):
        _write(fs, faulty_url(d) + "/3")
    assert FAULTS.pending_write_faults() == 0


@pytest.mark.parametrize("where", ["open", "write", "close"])
def test_hang_is_bounded_and_then_proceeds(fs_and_dir, where):
    fs, d = fs_and_dir
    FAULTS.hang(0.2, where=where)
    t0 = time.monotonic()
    _write(fs, faulty_url(d) + "/f")
    assert time.monotonic() - t0 >= 0.19
    assert (d / "f").read_bytes() == b"hello world" and FAULTS.completed_writes == 1


def test_hang_then_fail(fs_and_dir):
    fs, d = fs_and_dir
    FAULTS.hang(0.05, then="fail")
    with pytest.raises(OSError, match="after hanging"):
        _write(fs, faulty_url(d) + "/f")
    assert FAULTS.failed_writes == 1


def test_release_hangs_wakes_a_long_hang(fs_and_dir):
    fs, d = fs_and_dir
    FAULTS.hang(30)
    done = threading.Event()
    t = threading.Thread(target=lambda: (_write(fs, faulty_url(d) + "/f"), done.set()))
    t0 = time.monotonic()
    t.start()
    time.sleep(0.1)
    assert not done.is_set()
    FAULTS.release_hangs()
    t.join(5)
    assert done.is_set() and time.monotonic() - t0 < 5


def test_read_and_delete_faults(fs_and_dir):
    fs, d = fs_and_dir
    url = faulty_url(d) + "/f"
    _write(fs, url)
    FAULTS.fail_reads(1)
    with pytest.raises(OSError, match="reading"):
        fs.cat_file(url)
    assert fs.cat_file(url) == b"hello world" and FAULTS.failed_reads == 1
    FAULTS.hang_reads(0.05)
    t0 = time.monotonic()
    assert fs.cat_file(url) == b"hello world" and time.monotonic() - t0 >= 0.045
    FAULTS.fail_deletes(1)
    with pytest.raises(OSError, match="deleting"):
        fs.rm_file(url)
    assert (d / "f").exists()
    fs.rm(url)
    assert not (d / "f").exists() and FAULTS.deletes == 1


def test_bad_specs():
    with pytest.raises(ValueError):
        FAULTS.fail_writes(1, at="close")
    with pytest.raises(ValueError):
        FAULTS.hang(1, then="explode")
