"""write_bodies (Cython and twin): sealed bodies and bytes-like bodies written back to back to real
file descriptors give exactly the bytes of the bodies, to every descriptor, in any piece size; bad
input and a failing write are clear errors."""
from __future__ import annotations

import errno
import os
import random

import numpy as np
import pytest

from conftest import heavy
from dstl._fast import _buffer_py, _filewrite_py

from format_helpers import CYTHON, impl_params


def _write_bodies(impl, name="write_bodies"):
    if impl.name == "python":
        return getattr(_filewrite_py, name)
    from dstl._fast import _filewrite
    return getattr(_filewrite, name)


@pytest.fixture(params=[512 << 10, 4096, 7])
def piece(request):
    """The Cython routine lays sealed bodies out piece by piece: small pieces split records and headers."""
    if CYTHON is None:
        yield request.param
        return
    from dstl._fast import _filewrite
    old = _filewrite._set_piece_size(request.param)
    try:
        yield request.param
    finally:
        _filewrite._set_piece_size(old)


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

    assert fmt.write_bodies.__module__ == ("dstl._fast._filewrite_py" if IMPLEMENTATION == "python"
                                          else "dstl._fast._filewrite")


def _per_record_ops(shape: str, rng: random.Random) -> list:
    """Per-record appends: `dense` (128 groups, many 100-byte changes: several chunks a group, more
    than one writev of iovecs), `large` (changes above the largest chunk among small ones, metadata
    and empty ones), `sparse` (thousands of groups of one small change) and `mixed` (appends, an
    append_many, appends)."""
    if shape == "dense":
        return [(i % 128, rng.randbytes(100)) for i in range(30_000)]
    if shape == "large":
        return [(rng.choice([-1, 0, 9, 64, 32767]), rng.randbytes(rng.choice([0, 3, 100, 20_000, 70_000])))
                for _ in range(300)]
    if shape == "sparse":
        return [(g, rng.randbytes(10)) for g in range(5_000)]
    return [(i % 7, rng.randbytes(300)) for i in range(2_000)]


def _fill_per_record(buf, shape: str, ops: list):
    half = len(ops) // 2 if shape == "mixed" else len(ops)
    for kg, data in ops[:half]:
        buf.append(kg, data)
    if shape == "mixed":  # the Cython buffer reads the records of the changes so far from their chunks
        buf.append_many(np.array([3, 1], np.int32), b"abcde", np.array([0, 2, 5], np.int64))
    for kg, data in ops[half:]:
        buf.append(kg, data)
    return buf


@impl_params
@pytest.mark.parametrize("shape", ["dense", "large", "sparse", "mixed"])
def test_per_record_bodies_are_written_from_their_group_chunks(impl, shape, tmp_path):
    """Per-record appends copy each change as [length][payload] into its group's chunk, so the Cython
    file write takes the chunks as they are (writev) instead of laying the body out: the same bytes as
    the twin's seal, through every path, to every descriptor and at an offset. Many groups of a change
    or two, or changes from append_many, are laid out record by record as before: the Cython buffer
    keeps no records for appends and reads them from the chunks then (and for seal/seal_into)."""
    ops = _per_record_ops(shape, random.Random(shape))
    expected = _fill_per_record(_buffer_py.ChangeBuffer(), shape, ops).seal()
    body = _fill_per_record(impl.ChangeBuffer(), shape, ops).seal_body()
    if impl.name == "cython":
        assert body._chunked == (shape in ("dense", "large"))
    paths = [tmp_path / "a", tmp_path / "b"]
    fds = [os.open(p, os.O_WRONLY | os.O_CREAT | os.O_EXCL) for p in paths]
    try:
        assert _write_bodies(impl)(fds, [b"<", body, b">"]) == len(expected) + 2
    finally:
        for fd in fds:
            os.close(fd)
    for p in paths:
        assert p.read_bytes() == b"<" + expected + b">"
    paths[0].write_bytes(b"\xee" * (len(expected) + 9))
    assert _write_bodies(impl, "write_bodies_at")([str(paths[0])], 4, [body]) == len(expected)
    assert paths[0].read_bytes() == b"\xee" * 4 + expected + b"\xee" * 5
    pieces = []
    body.write_to(lambda v: pieces.append(bytes(v)), 4096)
    assert b"".join(pieces) == expected
    if impl.name == "cython":  # the streamed write_to of a large body: its canonical order from the chunks
        from dstl._fast import _sealed
        streamed = _fill_per_record(impl.ChangeBuffer(), shape, ops).seal_body()
        old = _sealed._set_scatter_max(-1)
        try:
            pieces = []
            streamed.write_to(lambda v: pieces.append(bytes(v)), 4096)
        finally:
            _sealed._set_scatter_max(old)
        assert b"".join(pieces) == expected
    assert bytes(body) == expected
    assert _fill_per_record(impl.ChangeBuffer(), shape, ops).seal() == expected
    out = bytearray(len(expected) + 3)
    assert _fill_per_record(impl.ChangeBuffer(), shape, ops).seal_into(out, 3) == len(expected)
    assert out[3:] == expected

@pytest.mark.skipif(CYTHON is None, reason="the chunked write is the Cython routine's")
def test_a_chunked_write_cut_short_is_an_oserror(tmp_path):
    """A writev that the file-size limit cuts short is finished with write(2), which then fails:
    OSError with the errno, and the bytes before the limit are the body's."""
    import subprocess
    import sys
    script = (
        "import os, resource, signal, sys\n"
        "from dstl._fast import _buffer, _filewrite\n"
        "bufs = [_buffer.ChangeBuffer(), _buffer.ChangeBuffer()]\n"
        "for i in range(20_000):\n"
        "    for buf in bufs:\n"
        "        buf.append(i % 64, bytes([i % 251]) * 100)\n"
        "body = bufs[0].seal_body()\n"
        "assert body._chunked\n"
        "open(sys.argv[2], 'wb').write(bufs[1].seal())\n"
        "signal.signal(signal.SIGXFSZ, signal.SIG_IGN)\n"
        "resource.setrlimit(resource.RLIMIT_FSIZE, (1_000_003, resource.RLIM_INFINITY))\n"
        "fd = os.open(sys.argv[1], os.O_WRONLY | os.O_CREAT | os.O_EXCL)\n"
        "try:\n"
        "    _filewrite.write_bodies([fd], [body])\n"
        "except OSError as exc:\n"
        "    print(exc.errno, flush=True)\n"
    )
    out = subprocess.run([sys.executable, "-c", script, str(tmp_path / "f"), str(tmp_path / "whole")],
                         capture_output=True, text=True, timeout=60)
    assert out.returncode == 0, out.stderr
    assert out.stdout.split() == [str(errno.EFBIG)]
    got, whole = (tmp_path / "f").read_bytes(), (tmp_path / "whole").read_bytes()
    assert len(got) == 1_000_003 and got == whole[:1_000_003]


@heavy
@pytest.mark.skipif(CYTHON is None, reason="the records read from the chunks are the Cython buffer's")
def test_a_buffer_that_runs_out_of_memory_reading_its_records_keeps_every_change():
    """Appends keep no records; a seal laid out change by change, or an append_many, needs them.
    When their arrays cannot be had (an address-space limit, in a subprocess), the call raises
    MemoryError and the buffer is as it was: raise the limit, and it seals every change, the same
    bytes as the twin."""
    import subprocess
    import sys
    script = (
        "import resource, sys\n"
        "import numpy as np\n"
        "from dstl._fast import _buffer, _buffer_py\n"
        "ops = [(g % 5000, bytes([g % 251]) * 10) for g in range(1_500_000)]  # sparse: laid out by records\n"
        "def fill(buf):\n"
        "    for kg, data in ops:\n"
        "        buf.append(kg, data)\n"
        "    return buf\n"
        "many = (np.array([3], np.int32), b'xyz', np.array([0, 3], np.int64))\n"
        "expected = fill(_buffer_py.ChangeBuffer()).seal()\n"
        "twin = fill(_buffer_py.ChangeBuffer())\n"
        "twin.append_many(*many)\n"
        "expected_many = twin.seal()\n"
        "del twin\n"
        "bufs = [fill(_buffer.ChangeBuffer()), fill(_buffer.ChangeBuffer())]\n"
        "used = int(open('/proc/self/statm').read().split()[0]) * resource.getpagesize()\n"
        "soft, hard = resource.getrlimit(resource.RLIMIT_AS)\n"
        "resource.setrlimit(resource.RLIMIT_AS, (used + (1 << 20), hard))  # records need 24 MB\n"
        "for call in (bufs[0].seal_body, lambda: bufs[1].append_many(*many)):\n"
        "    try:\n"
        "        call()\n"
        "        print('no error')\n"
        "    except MemoryError:\n"
        "        print('MemoryError')\n"
        "resource.setrlimit(resource.RLIMIT_AS, (soft, hard))\n"
        "print(len(bufs[0]), len(bufs[1]))\n"
        "print(bufs[0].seal_body().tobytes() == expected)\n"
        "bufs[1].append_many(*many)\n"
        "print(bufs[1].seal() == expected_many)\n"
    )
    # a fixed mmap threshold: the record arrays are fresh mappings, which the limit refuses (else
    # malloc may hand out memory the twin freed)
    env = dict(os.environ, MALLOC_MMAP_THRESHOLD_="65536")
    out = subprocess.run([sys.executable, "-c", script], capture_output=True, text=True, timeout=120, env=env)
    assert out.returncode == 0, out.stderr
    assert out.stdout.split() == ["MemoryError", "MemoryError", "1500000", "1500000", "True", "True"], out.stdout
