"""ChangeBuffer (Cython and its twin, side by side): canonical seal, append_many inputs, errors."""
from __future__ import annotations

import random
import re
import struct
from multiprocessing import shared_memory

import numpy as np
import pyarrow as pa
import pytest
from hypothesis import given, settings, strategies as st

from dstl import format as fmt
from dstl.types import StateChange

from format_helpers import CYTHON, IMPLS, PYTHON, impl_params


def _decode(body):
    changes, end = fmt.decode_change_set(body)
    assert end == len(body)
    return changes


def _canonical(changes):
    return sorted(changes, key=lambda c: c.key_group)  # stable: append order kept in a group


@impl_params
def test_seal_is_canonical_and_empties_the_buffer(impl):
    buf = impl.ChangeBuffer()
    appended = [(7, b"a"), (3, b"bb"), (-1, b"meta"), (7, b""), (0, b"c"), (3, b"dd"), (-1, b"m2")]
    for kg, data in appended:
        buf.append(kg, data)
    assert len(buf) == 7 and buf.size == 12
    assert buf.key_groups() == [-1, 0, 3, 7]
    assert buf.encoded_size == 4 + 8 * 4 + 4 * 7 + 12
    body = buf.seal()
    assert isinstance(body, bytes) and len(body) == 76
    assert _decode(body) == _canonical([StateChange(k, d) for k, d in appended])
    assert struct.unpack_from(">iii", body, 0) == (4, 2, -1)
    assert len(buf) == 0 and buf.size == 0 and buf.key_groups() == [] and buf.encoded_size == 4
    assert buf.seal() == b"\x00\x00\x00\x00"
    buf.append(1, b"again")  # reusable after a seal
    assert _decode(buf.seal()) == [StateChange(1, b"again")]


@impl_params
def test_append_accepts_bytes_like_and_numpy_ints(impl):
    buf = impl.ChangeBuffer()
    buf.append(np.int16(4), bytearray(b"ab"))
    buf.append(np.int64(4), memoryview(b"xcdx")[1:3])
    buf.append(-1, np.frombuffer(b"\x01\x02", dtype=np.uint8))
    buf.append(2, np.array([1], dtype=">i4"))  # any C-contiguous buffer: its raw bytes
    buf.append(32767, pa.py_buffer(b"pa"))
    assert _decode(buf.seal()) == [StateChange(-1, b"\x01\x02"), StateChange(2, b"\x00\x00\x00\x01"),
                                   StateChange(4, b"ab"), StateChange(4, b"cd"), StateChange(32767, b"pa")]


@impl_params
@pytest.mark.parametrize("kg,data,exc,fragment", [
    (-2, b"x", ValueError, "-1 (metadata) or 0..32767"),
    (32768, b"x", ValueError, "-1 (metadata) or 0..32767"),
    (1 << 70, b"x", ValueError, "-1 (metadata) or 0..32767"),
    (1.0, b"x", TypeError, "key_group must be an int"),
    ("3", b"x", TypeError, "key_group must be an int"),
    (True, b"x", TypeError, "key_group must be an int"),
    (1, "text", TypeError, "bytes-like"),
    (1, 5, TypeError, "bytes-like"),
    (1, None, TypeError, "bytes-like"),
    (1, np.zeros((4, 4), dtype=np.uint8)[:, 1], TypeError, "contiguous"),
])
def test_append_rejects_bad_arguments(impl, kg, data, exc, fragment):
    buf = impl.ChangeBuffer()
    buf.append(0, b"kept")
    with pytest.raises(exc, match=re.escape(fragment)):
        buf.append(kg, data)
    assert len(buf) == 1 and buf.size == 4  # nothing half-added
    assert _decode(buf.seal()) == [StateChange(0, b"kept")]


def _arrow_inputs(rows):
    kgs = [kg for kg, _ in rows]
    arr = pa.array([d for _, d in rows], type=pa.binary())
    return kgs, arr


@impl_params
def test_append_many_takes_arrow_layout_in_many_forms(impl):
    rows = [(5, b"aa"), (-1, b"m"), (2, b""), (5, b"bbb"), (0, b"c")]
    expected = _canonical([StateChange(k, d) for k, d in rows])
    kgs, arr = _arrow_inputs(rows)
    _, off_buf, data_buf = arr.buffers()
    offsets32 = np.frombuffer(off_buf, dtype=np.int32)[:len(rows) + 1]
    forms = [
        (np.array(kgs, dtype=np.int32), data_buf, off_buf),                      # raw Arrow buffers
        (pa.array(kgs, pa.int16()), data_buf, offsets32),                          # pyarrow ints
        (np.array(kgs, dtype=np.int64), bytes(data_buf), offsets32.astype(np.int64)),
        (kgs, bytearray(data_buf), list(offsets32)),                                # plain lists
        (np.array(kgs, dtype=np.int32)[::-1][::-1], memoryview(bytes(data_buf)), offsets32),
        (np.array(kgs, np.int8), np.frombuffer(bytes(data_buf), np.uint8), pa.array(offsets32)),
    ]
    for key_groups, data, offsets in forms:
        buf = impl.ChangeBuffer()
        buf.append_many(key_groups, data, offsets)
        assert len(buf) == 5 and buf.size == 7
        assert _decode(buf.seal()) == expected


@impl_params
def test_append_many_sliced_arrow_array_with_nonzero_first_offset(impl):
    arr = pa.array([b"skip", b"x", b"yy", b"zzz"], pa.large_binary()).slice(1, 3)
    _, off_buf, data_buf = arr.buffers()
    offsets = np.frombuffer(off_buf, dtype=np.int64)[arr.offset:arr.offset + 4]
    assert offsets[0] == 4
    buf = impl.ChangeBuffer()
    buf.append(1, b"before")
    buf.append_many(np.array([3, 1, 3]), data_buf, offsets)
    buf.append(3, b"after")
    assert _decode(buf.seal()) == [StateChange(1, b"before"), StateChange(1, b"yy"), StateChange(3, b"x"),
                                   StateChange(3, b"zzz"), StateChange(3, b"after")]


@impl_params
@pytest.mark.parametrize("kgs,offsets,fragment", [
    ([1, 2, -2], [0, 1, 2, 3], "row 2: key group -2"),
    ([1, 40000, -5], [0, 1, 2, 3], "row 1: key group 40000"),
    ([1, 2, 3], [0, 2, 1, 3], "row 1: offsets decrease"),
    ([1, 2, 3], [0, 1, 2, 99], "row 2: offsets 2..99 are outside data"),
    ([1, 2, 3], [-1, 1, 2, 3], "row 0: offsets -1..1"),
    ([1, 2, 3], [0, 1, 2], "offsets must have len(key_groups) + 1 = 4 entries"),
    ([1, 2], [0, 1, 2, 3], "offsets must have len(key_groups) + 1 = 3 entries"),
])
@pytest.mark.parametrize("dtypes", [(None, None), (np.int32, np.int64)], ids=["converted", "int32-int64"])
def test_append_many_is_all_or_nothing(impl, kgs, offsets, fragment, dtypes):
    """int32 key groups with int64 offsets are checked in one pass (Cython), others converted first:
    both name the same first bad row."""
    buf = impl.ChangeBuffer()
    buf.append(0, b"kept")
    with pytest.raises(ValueError, match=re.escape(fragment)):
        buf.append_many(np.array(kgs, dtypes[0]), b"abcdef", np.array(offsets, dtypes[1]))
    assert len(buf) == 1 and buf.size == 4 and buf.key_groups() == [0]
    assert _decode(buf.seal()) == [StateChange(0, b"kept")]


@impl_params
def test_append_many_type_errors(impl):
    buf = impl.ChangeBuffer()
    with pytest.raises(TypeError, match="key_groups must be an integer array"):
        buf.append_many(np.array([1.5]), b"a", [0, 1])
    with pytest.raises(TypeError, match="data must be bytes-like"):
        buf.append_many([1], "a", [0, 1])
    with pytest.raises(ValueError, match="fits neither int32 nor int64"):
        buf.append_many([1, 2], b"ab", b"\x00" * 5)
    with pytest.raises(ValueError, match="must not contain nulls"):
        buf.append_many(pa.array([1, None]), b"ab", [0, 1, 2])
    assert len(buf) == 0
    buf.append_many(np.zeros(0, np.int32), b"", np.zeros(1, np.int64))  # empty input is fine
    assert len(buf) == 0


@impl_params
def test_append_many_copies_mutable_sources(impl):
    data = bytearray(b"abcd")
    arr = np.frombuffer(bytearray(b"wxyz"), dtype=np.uint8)
    buf = impl.ChangeBuffer()
    buf.append_many([1, 2], data, [0, 2, 4])
    buf.append_many([3], arr, [0, 4])
    data[:] = b"XXXX"  # the caller may reuse its buffers once append_many returns
    arr[:] = 0
    assert _decode(buf.seal()) == [StateChange(1, b"ab"), StateChange(2, b"cd"), StateChange(3, b"wxyz")]


@impl_params
def test_seal_into_writes_into_shared_memory(impl):
    buf = impl.ChangeBuffer()
    buf.append(9, b"nine")
    buf.append(-1, b"m")
    expected_len = buf.encoded_size
    shm = shared_memory.SharedMemory(create=True, size=256)
    try:
        shm.buf[:8] = b"\xee" * 8
        n = buf.seal_into(shm.buf, 8)
        assert n == expected_len and len(buf) == 0
        assert bytes(shm.buf[:8]) == b"\xee" * 8
        assert _decode(bytes(shm.buf[8:8 + n])) == [StateChange(-1, b"m"), StateChange(9, b"nine")]
    finally:
        shm.close()
        shm.unlink()


def _rejects_bad_outputs(write_into, need: int) -> None:
    """`write_into(out[, pos])` refuses a short buffer, a position outside it, and read-only or
    non-buffer outputs."""
    for args in ((bytearray(need - 1),), (bytearray(100), -1), (bytearray(100), 100 - need + 1)):
        with pytest.raises(ValueError, match="do not fit"):
            write_into(*args)
    for out in (b"\x00" * 100, 12):
        with pytest.raises(TypeError, match="writable"):
            write_into(out)


@impl_params
def test_seal_into_errors_keep_the_changes(impl):
    buf = impl.ChangeBuffer()
    buf.append(1, b"abc")
    _rejects_bad_outputs(buf.seal_into, buf.encoded_size)
    assert len(buf) == 1
    out = bytearray(buf.encoded_size)
    assert buf.seal_into(out) == len(out)
    assert _decode(bytes(out)) == [StateChange(1, b"abc")]


@impl_params
@pytest.mark.parametrize("built", [False, True])
def test_sealed_body_write_into_gives_the_sealed_bytes_at_any_position(impl, built):
    """write_into builds the body in place (a mapped segment in process mode); before and after the
    body was built as bytes (tobytes), it writes the same canonical bytes."""
    buf = impl.ChangeBuffer()
    rng = random.Random(5)
    for i in range(3000):
        buf.append(rng.randrange(-1, 200), bytes([i % 251]) * rng.randrange(0, 40))
    body = buf.seal_body()
    if built:
        body.tobytes()
    out = bytearray(b"\xee" * (len(body) + 20))
    assert body.write_into(out, 7) == len(body)
    assert out[:7] == b"\xee" * 7 and out[7 + len(body):] == b"\xee" * 13
    assert bytes(out[7:7 + len(body)]) == body.tobytes()
    shm = shared_memory.SharedMemory(create=True, size=len(body))
    try:
        assert body.write_into(shm.buf) == len(body)
        assert bytes(shm.buf[:len(body)]) == body.tobytes()
    finally:
        shm.close()
        shm.unlink()


@impl_params
def test_sealed_body_write_into_errors(impl):
    buf = impl.ChangeBuffer()
    buf.append(1, b"abc")
    body = buf.seal_body()
    _rejects_bad_outputs(body.write_into, len(body))
    out = bytearray(len(body))
    assert body.write_into(out) == len(body) and _decode(bytes(out)) == [StateChange(1, b"abc")]


@impl_params
def test_clear(impl):
    buf = impl.ChangeBuffer()
    buf.append_many([1, 2], b"abcd", [0, 2, 4])
    buf.append(3, b"x" * 100)
    buf.clear()
    assert len(buf) == 0 and buf.size == 0 and buf.encoded_size == 4 and buf.key_groups() == []
    buf.append(5, b"y")
    assert _decode(buf.seal()) == [StateChange(5, b"y")]


def _random_ops(seed, n_ops=40):
    rng = random.Random(seed)
    ops = []
    kg_pool = [-1, 0, 1, 2, 15, 16, 127, 128, 4095, 32767]
    for _ in range(rng.randrange(0, n_ops)):
        if rng.random() < 0.3:
            m = rng.randrange(0, 30)
            kgs = [rng.choice(kg_pool) for _ in range(m)]
            lens = [rng.choice([0, 1, 3, 17, 300]) for _ in range(m)]
            start = rng.randrange(0, 5)
            offsets = np.concatenate([[start], start + np.cumsum(lens, dtype=np.int64)]).astype(np.int64)
            data = rng.randbytes(int(offsets[-1]) + rng.randrange(0, 4))
            source = rng.choice([bytes, bytearray, pa.py_buffer])(data)
            ops.append(("many", np.array(kgs, dtype=rng.choice([np.int32, np.int64])), source, offsets))
        else:
            ops.append(("one", rng.choice(kg_pool), rng.randbytes(rng.choice([0, 1, 8, 100, 5000]))))
    return ops


def _run(impl, ops):
    buf = impl.ChangeBuffer()
    for op in ops:
        if op[0] == "many":
            buf.append_many(*op[1:])
        else:
            buf.append(*op[1:])
    stats = (len(buf), buf.size, buf.encoded_size, buf.key_groups())
    body = buf.seal()
    assert len(body) == stats[2]
    return stats, body


@pytest.mark.skipif(CYTHON is None, reason="Cython extension not built (pure-Python run)")
@pytest.mark.parametrize("seed", range(30))
def test_cython_and_twin_are_byte_identical(seed):
    ops = _random_ops(seed)
    assert _run(CYTHON, ops) == _run(PYTHON, ops)


@settings(max_examples=60, deadline=None)
@given(st.lists(st.tuples(st.integers(-1, 300), st.binary(max_size=40)), max_size=60))
def test_seal_matches_a_reference_encoding(rows):
    """Both implementations against a straightforward re-statement of docs/format.md §4."""
    groups = {}
    for kg, data in rows:
        groups.setdefault(kg, []).append(data)
    ref = struct.pack(">i", len(groups))
    for kg in sorted(groups):
        ref += struct.pack(">ii", len(groups[kg]), kg)
        for data in groups[kg]:
            ref += struct.pack(">i", len(data)) + data
    for impl in IMPLS:
        buf = impl.ChangeBuffer()
        for kg, data in rows:
            buf.append(kg, data)
        assert buf.seal() == ref
        lens = np.array([len(d) for _, d in rows], dtype=np.int64)
        buf.append_many(np.array([kg for kg, _ in rows], dtype=np.int32), b"".join(d for _, d in rows),
                        np.concatenate([[0], np.cumsum(lens)]))
        assert buf.seal() == ref


def test_facade_uses_the_expected_implementation():
    from conftest import expected_implementation

    assert fmt.IMPLEMENTATION == expected_implementation()
    assert fmt.ChangeBuffer is (CYTHON.ChangeBuffer if expected_implementation() == "cython" else PYTHON.ChangeBuffer)


@pytest.mark.skipif(CYTHON is None, reason="Cython extension not built (pure-Python run)")
def test_cython_buffer_detects_use_while_it_runs_without_the_gil():
    """seal/append_many release the GIL; a concurrent append must fail loudly, never corrupt or lose."""
    import threading

    buf = CYTHON.ChangeBuffer()
    payload = bytes(range(256)) * 4
    kgs = np.arange(20000, dtype=np.int32) % 64
    offsets = np.arange(20001, dtype=np.int64) * 1000
    data = payload * 20000
    bodies, accepted_bg, accepted_main, refused = [], [0], [0], [0]  # one counter per thread
    stop = threading.Event()

    def sealer():
        while not stop.is_set():
            try:
                buf.append_many(kgs, bytearray(data[:20_000_000]), offsets)
                accepted_bg[0] += len(kgs)
                bodies.append(buf.seal())
            except RuntimeError:
                pass

    t = threading.Thread(target=sealer)
    t.start()
    try:
        for _ in range(3000):
            try:
                buf.append(3, b"x")
                accepted_main[0] += 1
            except RuntimeError as exc:
                assert "in use by another thread" in str(exc)
                refused[0] += 1
    finally:
        stop.set()
        t.join(timeout=60)
    bodies.append(buf.seal())
    total = 0
    for body in bodies:
        kg_arr, _, lens, end = fmt.decode_change_set_arrays(body)
        assert end == len(body)
        total += len(kg_arr)
    assert total == accepted_bg[0] + accepted_main[0]  # every accepted change is in exactly one body
