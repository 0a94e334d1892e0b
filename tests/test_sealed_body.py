"""ChangeBuffer.seal_body (Cython and twin): the streamed body equals seal() byte for byte, in any
chunking, from several threads, through write_file with and without compression."""
from __future__ import annotations

import io
import random
import threading

import numpy as np
import pytest

from conftest import heavy_twins
from dstl import format as fmt

from format_helpers import CYTHON, impl_params


@pytest.fixture(autouse=True, params=["whole", "streamed"])
def write_path(request):
    """Cython bodies are written whole from a reused buffer up to a size limit and streamed (gathered
    piece by piece) above it: run every test both ways (the twin has one path)."""
    if CYTHON is None or request.param == "whole":
        yield request.param
        return
    from dstl._fast import _sealed
    old = _sealed._set_scatter_max(-1)
    try:
        yield request.param
    finally:
        _sealed._set_scatter_max(old)


def _ops(rng: random.Random):
    """A random mix of append, append_many by reference (bytes) and by copy (bytearray)."""
    ops = []
    for _ in range(rng.randint(0, 25)):
        if rng.random() < 0.4:
            m = rng.randint(0, 30)
            kgs = np.array([rng.choice([-1, 0, 1, 5, 300, 32767]) for _ in range(m)], np.int32)
            lens = [rng.choice([0, 1, 3, 50, 3000]) for _ in range(m)]
            offs = np.concatenate([[0], np.cumsum(lens)]).astype(np.int64)
            data = rng.randbytes(int(offs[-1]))
            ops.append(("many", kgs, data if rng.random() < 0.5 else bytearray(data), offs))
        else:
            ops.append(("one", rng.choice([-1, 0, 2, 7, 32767]), rng.randbytes(rng.choice([0, 1, 9, 5000]))))
    return ops


def _fill(buf, ops):
    for op in ops:
        if op[0] == "many":
            buf.append_many(op[1], op[2], op[3])
        else:
            buf.append(op[1], op[2])


@impl_params
@pytest.mark.parametrize("seed", range(40))
def test_streamed_body_equals_seal_in_any_chunking(impl, seed):
    rng = random.Random(seed)
    ops = _ops(rng)
    a, b = impl.ChangeBuffer(), impl.ChangeBuffer()
    _fill(a, ops)
    _fill(b, ops)
    expected = a.seal()
    body = b.seal_body()
    assert len(b) == 0 and b.size == 0
    assert len(body) == len(expected)
    for chunk in (1, 3, 7, 64, 4096, 1 << 20):
        pieces = []
        assert body.write_to(lambda v: pieces.append(bytes(v)), chunk) == len(expected)
        assert b"".join(pieces) == expected
        assert all(len(p) == chunk for p in pieces[:-1]) and all(pieces)
    assert bytes(body) == expected and bytes(memoryview(body)) == expected
    _fill(b, ops)  # the buffer is reusable after handing its records to the body
    assert b.seal() == expected


@impl_params
def test_empty_body_and_bad_chunk_size(impl):
    body = impl.ChangeBuffer().seal_body()
    assert len(body) == 4 and bytes(body) == b"\x00\x00\x00\x00"
    with pytest.raises(ValueError, match="chunk_size"):
        body.write_to(lambda v: None, 0)


@impl_params
def test_body_outlives_the_buffer_and_its_sources(impl):
    buf = impl.ChangeBuffer()
    data = bytes(range(200))
    buf.append_many(np.array([4, 2, 4], np.int32), memoryview(data)[10:], np.array([0, 5, 50, 190]))
    buf.append(2, bytearray(b"copied"))
    expected = impl.ChangeBuffer()
    expected.append_many(np.array([4, 2, 4], np.int32), data[10:], np.array([0, 5, 50, 190]))
    expected.append(2, b"copied")
    body = buf.seal_body()
    del buf, data
    assert bytes(body) == expected.seal()


@impl_params
def test_concurrent_streams_of_one_body(impl):
    """Retried / speculative upload attempts may stream the same body at the same time."""
    rng = random.Random(7)
    n = 20_000
    kgs = np.array([rng.randrange(-1, 128) for _ in range(n)], np.int32)
    data = rng.randbytes(n * 30)
    offs = np.arange(0, n * 30 + 1, 30, dtype=np.int64)
    ref = impl.ChangeBuffer()
    ref.append_many(kgs, data, offs)
    expected = ref.seal()
    buf = impl.ChangeBuffer()
    buf.append_many(kgs, data, offs)
    body = buf.seal_body()
    outs = [io.BytesIO() for _ in range(4)]
    threads = [threading.Thread(target=body.write_to, args=(o.write, 65536)) for o in outs]
    for t in threads:
        t.start()
    for t in threads:
        t.join(60)
    assert all(o.getvalue() == expected for o in outs)


@impl_params
def test_a_kept_view_is_not_overwritten(impl):
    """Pieces are valid only during the call, but a callback that keeps a view of one must never see
    later pieces through it: its bytes stay those of its own piece."""
    def fill(buf):
        for i in range(64):
            buf.append(i, bytes([i]) * 1000)
    buf, ref = impl.ChangeBuffer(), impl.ChangeBuffer()
    fill(buf)
    fill(ref)
    expected = ref.seal()
    body = buf.seal_body()
    kept = []
    body.write_to(lambda v: kept.append(memoryview(v)), 4096)
    assert b"".join(bytes(v) for v in kept) == expected
    fill(buf)  # the next body's pieces do not land in the kept views either
    buf.seal_body().write_to(lambda v: None, 4096)
    assert b"".join(bytes(v) for v in kept) == expected


@impl_params
@pytest.mark.parametrize("compression", [None, "snappy", "zstd"])
def test_write_file_streams_sealed_bodies(impl, compression):
    rng = random.Random(3)
    sealed, bodies = [], []
    for _ in range(3):
        ops = _ops(rng)
        a, b = impl.ChangeBuffer(), impl.ChangeBuffer()
        _fill(a, ops)
        _fill(b, ops)
        bodies.append(a.seal())
        sealed.append(b.seal_body())
    want, got = io.BytesIO(), io.BytesIO()
    offsets_a = fmt.write_file(want, bodies, compression=compression, buffer_size=1000)
    offsets_b = fmt.write_file(got, sealed, compression=compression, buffer_size=1000)
    assert offsets_a == offsets_b
    assert got.getvalue() == want.getvalue()
    logical = fmt.to_logical(got.getvalue())
    assert bytes(logical) == b"".join(bodies)


@impl_params
def test_bodies_stay_intact_while_buffers_reuse_memory(impl):
    """Dropped bodies hand their memory to later change sets; live bodies must never be touched."""
    rng = random.Random(11)
    buf = impl.ChangeBuffer()
    kept = []
    for round_ in range(30):
        ops = _ops(rng)
        ref = impl.ChangeBuffer()
        _fill(ref, ops)
        _fill(buf, ops)
        body = buf.seal_body()
        if round_ % 3 == 0:
            kept.append((body, ref.seal()))
        else:
            assert bytes(body) == ref.seal()
        del body
    for body, expected in kept:
        parts = []
        body.write_to(lambda v: parts.append(bytes(v)), 4096)
        assert b"".join(parts) == expected


@impl_params
def test_views_pickles_and_equality(impl):
    import gc
    import pickle

    buf, ref = impl.ChangeBuffer(), impl.ChangeBuffer()
    for b in (buf, ref):
        b.append(3, b"abc")
        b.append(-1, b"m")
    expected = ref.seal()
    body = buf.seal_body()
    view = memoryview(body)
    del body
    gc.collect()
    assert view.tobytes() == expected  # the view keeps what it points to alive
    view.release()
    buf.append(3, b"abc")
    buf.append(-1, b"m")
    body = buf.seal_body()
    assert bytes(pickle.loads(pickle.dumps(body))) == expected
    assert body == expected and len(body) == len(expected)


def _bodies(impl, count, changes=50_000, joined=False):
    """`count` sealed bodies of 5 MB each (the default pre-emptive threshold), held alive; `joined`:
    an append_many joins each, so it keeps records (per-record bodies keep none)."""
    payload = bytes(100)
    out = []
    for _ in range(count):
        buf = impl.ChangeBuffer()
        for i in range(changes):
            buf.append(i % 128, payload)
        if joined:
            buf.append_many(np.array([7], np.int32), b"x", np.array([0, 1], np.int64))
        out.append(buf.seal_body())
    return out


@heavy_twins  # memory bounds of each build
def test_dropped_bodies_leave_their_memory_for_the_next_change_sets_within_a_bound(tmp_path):
    """A per-record loop runs ahead of its uploads: when the uploaded bodies are dropped, their arenas
    and record arrays are kept (up to 160 and 32 MiB) for the next change sets, which then reuse them
    instead of faulting fresh pages in. A closing storage frees them. Per-record bodies have no
    record arrays: their chunks are all they keep."""
    from dstl import open_storage, KeyGroupRange
    from dstl._fast import _buffer_py, _spares_py
    spares = fmt._spares
    spares.release_spares()
    assert spares.spare_bytes() == 0
    bodies = _bodies(fmt, 25)  # 25 arenas of 8 MiB
    del bodies
    kept = spares.spare_bytes()
    if spares is _spares_py:
        assert kept == 0  # the twin keeps nothing: Python's allocator reuses its memory
    else:
        assert kept == 160 << 20  # 20 of the arenas fill the pool
        joined = _bodies(fmt, 4, joined=True)  # records for 50,000 changes, doubled for the 50,001st
        del joined
        assert spares.spare_bytes() - kept == 4 * 16 * 100_000  # the arenas found the pool full
        kept = spares.spare_bytes()
        again = _bodies(fmt, 3) + _bodies(fmt, 1, joined=True)
        assert spares.spare_bytes() < kept  # taken from the pool
        assert b"".join(b.tobytes() for b in again) == \
            b"".join(b.tobytes() for b in _bodies(_buffer_py, 3) + _bodies(_buffer_py, 1, joined=True))
    with open_storage(str(tmp_path / "s"), upload_mode="direct") as storage:
        writer = storage.create_writer("w", KeyGroupRange(0, 127))
        for i in range(60_000):
            writer.append(i % 128, bytes(100))
        writer.persist(writer.initial_sequence_number(), 1).result(60)
        writer.close()
        assert (spares.spare_bytes() > 0) == (spares is not _spares_py)
    assert spares.spare_bytes() == 0
