"""write_bodies (Cython and twin): sealed bodies and bytes-like bodies written back to back to real
file descriptors give exactly the bytes of the bodies, to every descriptor, in any piece size; bad
input and a failing write are clear errors."""
from __future__ import annotations

import errno
import os
import random

import numpy as np
import pytest

from dstl._fast import _buffer_py

from format_helpers import CYTHON, impl_params


def _write_bodies(impl, name="write_bodies"):
    if impl.name == "python":
        return getattr(_buffer_py, name)
    from dstl._fast import _buffer
    return getattr(_buffer, name)


@pytest.fixture(params=[512 << 10, 4096, 7])
def piece(request):
    """The Cython routine lays sealed bodies out piece by piece: small pieces split records and headers."""
    if CYTHON is None:
        yield request.param
        return
    from dstl._fast import _buffer
    old = _buffer._set_piece_size(request.param)
    try:
        yield request.param
    finally:
        _buffer._set_piece_size(old)


def _bodies_and_bytes(impl, seed: int):
    rng = random.Random(seed)
    bodies, expected = [], []
    for kind in ("sealed", "bytes", "sealed", "view", "empty", "sealed"):
        if kind in ("sealed", "empty"):
            a, b = impl.ChangeBuffer(), impl.ChangeBuffer()
            rows = 0 if kind == "empty" else rng.randint(1, 400)
            lens = [rng.choice([0, 1, 4, 100, 3000]) for _ in range(rows)]
            offs = np.concatenate([[0], np.cumsum(lens)]).astype(np.int64)
            kgs = np.array([rng.choice([-1, 0, 3, 127, 32767]) for _ in range(rows)], np.int32)
            data = rng.randbytes(int(offs[-1]))
            for buf in (a, b):
                if rows:
                    buf.append_many(kgs, data, offs)
                buf.append(5, b"single")
            expected.append(a.seal())
            bodies.append(b.seal_body())
        else:
            raw = rng.randbytes(rng.randint(0, 5000))
            expected.append(raw)
            bodies.append(raw if kind == "bytes" else memoryview(bytearray(raw)))
    return bodies, b"".join(expected)


@impl_params
@pytest.mark.parametrize("seed", range(6))
def test_bodies_reach_every_descriptor_byte_for_byte(impl, seed, piece, tmp_path):
    bodies, expected = _bodies_and_bytes(impl, seed)
    paths = [tmp_path / "a", tmp_path / "b"]
    fds = [os.open(p, os.O_WRONLY | os.O_CREAT | os.O_EXCL) for p in paths]
    try:
        os.write(fds[0], b"\x00")  # the flag byte: bodies go on at each descriptor's position
        os.write(fds[1], b"\x00")
        assert _write_bodies(impl)(fds, bodies) == len(expected)
        assert _write_bodies(impl)(fds[:1], bodies[:1]) == len(bytes(bodies[0]))  # a body can be written again
    finally:
        for fd in fds:
            os.close(fd)
    assert paths[0].read_bytes() == b"\x00" + expected + bytes(bodies[0])
    assert paths[1].read_bytes() == b"\x00" + expected


@impl_params
def test_nothing_to_write(impl, tmp_path):
    fd = os.open(tmp_path / "f", os.O_WRONLY | os.O_CREAT)
    try:
        assert _write_bodies(impl)([fd], []) == 0
        assert _write_bodies(impl)([], [b"x"]) == 0
    finally:
        os.close(fd)
    assert (tmp_path / "f").read_bytes() == b""


@impl_params
def test_bad_input_is_named(impl, tmp_path):
    write_bodies = _write_bodies(impl)
    fd = os.open(tmp_path / "f", os.O_WRONLY | os.O_CREAT)
    try:
        with pytest.raises(TypeError, match="body 1 is not a sealed body or a contiguous bytes-like object, got str"):
            write_bodies([fd], [b"ok", "text"])
        with pytest.raises(TypeError, match="body 0 .* got memoryview"):
            write_bodies([fd], [memoryview(bytearray(8))[::2]])
        with pytest.raises(ValueError, match="invalid file descriptor -1"):
            write_bodies([-1], [b"x"])
        with pytest.raises(ValueError, match="at most 4 file descriptors"):
            write_bodies([fd] * 5, [b"x"])
        with pytest.raises(TypeError, match="file descriptors must be ints, got str"):
            write_bodies(["3"], [b"x"])
    finally:
        os.close(fd)
    assert (tmp_path / "f").read_bytes() == b""  # checked before anything was written


@impl_params
def test_a_failing_write_is_an_oserror(impl, tmp_path):
    buf = impl.ChangeBuffer()
    buf.append(1, b"payload" * 100)
    body = buf.seal_body()
    (tmp_path / "ro").write_bytes(b"")
    fd = os.open(tmp_path / "ro", os.O_RDONLY)
    try:
        with pytest.raises(OSError, match="write failed at byte 0") as info:
            _write_bodies(impl)([fd], [body])
        assert info.value.errno == errno.EBADF
    finally:
        os.close(fd)


@impl_params
@pytest.mark.parametrize("seed", range(3))
def test_bodies_at_an_offset_of_existing_files(impl, seed, piece, tmp_path):
    """write_bodies_at opens files that exist (never creating or truncating them), writes from the
    offset and closes them: what an upload-service client does into the file the service made."""
    bodies, expected = _bodies_and_bytes(impl, seed)
    paths = [tmp_path / "a", tmp_path / "b"]
    for p in paths:
        p.write_bytes(b"H" + b"\xee" * (len(expected) + 20))  # made and sized by someone else
    assert _write_bodies(impl, "write_bodies_at")([str(p) for p in paths], 11, bodies) == len(expected)
    for p in paths:
        got = p.read_bytes()
        assert len(got) == len(expected) + 21, "the file was truncated or extended"
        assert got[:11] == b"H" + b"\xee" * 10 and got[11:11 + len(expected)] == expected
        assert got[11 + len(expected):] == b"\xee" * 10


@impl_params
def test_bodies_at_refuse_missing_files_and_bad_input(impl, tmp_path):
    at = _write_bodies(impl, "write_bodies_at")
    (tmp_path / "there").write_bytes(b"")
    missing = tmp_path / "gone"
    with pytest.raises(OSError, match="cannot open .*gone at byte 5") as info:
        at([str(tmp_path / "there"), str(missing)], 5, [b"payload"])
    assert info.value.errno == errno.ENOENT and info.value.filename == str(missing)
    assert not missing.exists(), "a missing file must not be created"
    with pytest.raises(ValueError, match="negative offset"):
        at([str(tmp_path / "there")], -1, [b"x"])
    with pytest.raises(ValueError, match="at most 4 paths"):
        at([str(tmp_path / "there")] * 5, 0, [b"x"])
    assert at([str(tmp_path / "there")], 0, []) == 0


@impl_params
@pytest.mark.parametrize("size", [0, 3 << 20])
def test_bodies_at_new_files_made_exclusively(impl, size, tmp_path):
    """With create, the files are made (never an existing one), reserved when large, written and
    closed; a failure on any of them removes what the call made and nothing else."""
    at = _write_bodies(impl, "write_bodies_at")
    bodies, expected = _bodies_and_bytes(impl, 1)
    pad = b"\x00" * size  # a large body: the compiled routine reserves the size first
    paths = [str(tmp_path / "a"), str(tmp_path / "b")]
    total = 1 + len(expected) + len(pad)
    assert at(paths, 0, [b"\x00"] + bodies + [pad], create=True, size=total) == total
    for p in paths:
        with open(p, "rb") as f:
            assert f.read() == b"\x00" + expected + pad
        assert os.stat(p).st_mode & 0o777 == 0o666 & ~_umask()
    with pytest.raises(FileExistsError, match="cannot make .*a at byte 0"):
        at([paths[0]], 0, [b"new"], create=True, size=3)
    with open(paths[0], "rb") as f:
        assert f.read() == b"\x00" + expected + pad, "an existing file must be left alone"
    fresh, nowhere = str(tmp_path / "fresh"), str(tmp_path / "no-dir" / "x")
    with pytest.raises(FileNotFoundError):
        at([fresh, nowhere], 0, [b"x"], create=True, size=1)
    assert not os.path.exists(fresh), "a file made by a failed call is removed again"


def _umask() -> int:
    old = os.umask(0)
    os.umask(old)
    return old


def test_the_facade_picks_the_loaded_implementation():
    from dstl import format as fmt
    from dstl._impl import IMPLEMENTATION

    assert fmt.write_bodies.__module__.endswith("_buffer_py" if IMPLEMENTATION == "python" else "_buffer")
