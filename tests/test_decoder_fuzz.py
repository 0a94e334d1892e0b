"""Fuzzing the decoder (hypothesis): malformed input raises only CorruptChangelogError, under both
implementations, and the Cython decoder agrees with its twin on every input."""
from __future__ import annotations

import struct

import numpy as np
from hypothesis import HealthCheck, assume, given, settings, strategies as st

from conftest import heavy
from dstl import format as fmt
from dstl.format import compression
from dstl.errors import CorruptChangelogError
from dstl.types import KeyGroupRange

from format_helpers import IMPLS, PYTHON

pytestmark = heavy  # hypothesis over both implementations in one run

FUZZ = settings(max_examples=300, deadline=None, suppress_health_check=[HealthCheck.too_slow])


def _outcome(fn, *args):
    """What a decoder call gives: ("ok", comparable result) or ("corrupt", offset, message)."""
    try:
        result = fn(*args)
    except CorruptChangelogError as exc:
        return ("corrupt", exc.offset, str(exc))
    if isinstance(result, list):  # walk
        return ("ok", [tuple(i) for i in result])
    if len(result) == 4:
        kgs, offs, lens, end = result
        assert kgs.dtype == np.int32 and offs.dtype == np.int64 and lens.dtype == np.int64
        return ("ok", kgs.tolist(), offs.tolist(), lens.tolist(), end)
    changes, end = result
    return ("ok", [(c.key_group, c.data) for c in changes], end)


def _all_outcomes(data, offset, kgr):
    results = {}
    for impl in IMPLS:
        d = impl.decode
        results[impl.name] = (
            _outcome(d.decode_change_set, data, offset, kgr),
            _outcome(d.decode_change_set_arrays, data, offset, kgr),
            _outcome(d.walk, data),
        )
    return results


def _check(data, offset=0, kgr=None):
    results = _all_outcomes(data, offset, kgr)
    first = results[PYTHON.name]
    for name, got in results.items():
        assert got == first, name  # Cython == twin, errors included
    objects, arrays, _ = first
    assert objects[0] == arrays[0]
    if objects[0] == "ok":
        # the vectorised form describes the same changes, zero copy over `data`
        assert objects[1] == [(k, bytes(data[o:o + n])) for k, o, n in zip(arrays[1], arrays[2], arrays[3])]
        assert objects[2] == arrays[4] <= len(data)
    else:
        assert objects[1] == arrays[1] and 0 <= objects[1] <= max(len(data), offset)


@FUZZ
@given(st.binary(max_size=200), st.integers(0, 210))
def test_random_bytes(data, offset):
    _check(data, offset)


def _i32(value):
    return struct.pack(">i", value)


# structured garbage: plausible headers with hostile counts, lengths and key groups
_field = st.one_of(st.integers(-3, 40), st.sampled_from([-1, 32767, 32768, 2**31 - 1, -2**31, 2**30]))


@st.composite
def _structured(draw):
    parts = [_i32(draw(_field))]
    for _ in range(draw(st.integers(0, 5))):
        parts.append(_i32(draw(_field)) + _i32(draw(_field)))
        for _ in range(draw(st.integers(0, 4))):
            n = draw(_field)
            parts.append(_i32(n) + draw(st.binary(max_size=12)))
    return b"".join(parts)


@FUZZ
@given(_structured(), st.sampled_from([None, KeyGroupRange(0, 3), KeyGroupRange.EMPTY, KeyGroupRange(30, 32767)]))
def test_structured_garbage(data, kgr):
    _check(data, 0, kgr)


@st.composite
def _valid_stream(draw):
    bodies = []
    for _ in range(draw(st.integers(1, 3))):
        rows = draw(st.lists(st.tuples(st.integers(-1, 50), st.binary(max_size=20)), max_size=12))
        buf = fmt.ChangeBuffer()
        for kg, payload in rows:
            buf.append(kg, payload)
        bodies.append(buf.seal())
    return b"".join(bodies)


@FUZZ
@given(_valid_stream(), st.data())
def test_mutated_valid_streams(stream, data):
    mutated = bytearray(stream)
    for _ in range(data.draw(st.integers(0, 4))):
        if mutated:
            i = data.draw(st.integers(0, len(mutated) - 1))
            mutated[i] = data.draw(st.sampled_from([0x00, 0x7F, 0x80, 0xFF, 0x01]))
    cut = data.draw(st.integers(0, len(mutated)))
    _check(bytes(mutated[:cut]), data.draw(st.integers(0, 8)))


@FUZZ
@given(_valid_stream(), st.integers(0, 60))
def test_valid_streams_decode_everywhere(stream, offset):
    assume(offset <= len(stream))
    _check(stream, offset)
    infos = fmt.walk(stream)
    assert sum(i.encoded_size for i in infos) == len(stream)


@FUZZ
@given(st.sampled_from([0, 1, 2, 3, 0xFF]), st.binary(max_size=120))
def test_random_files_raise_only_corrupt_errors(flag, rest):
    data = bytes([flag]) + rest
    try:
        logical = fmt.to_logical(data, "f")
    except CorruptChangelogError as exc:
        assert exc.file == "f" and exc.file_offset and 0 <= exc.offset <= len(data)
        return
    _check(bytes(logical), 0)


@FUZZ
@given(_valid_stream(), st.sampled_from(["snappy", "zstd"]), st.data())
def test_mutated_compressed_files(stream, codec, data):
    file = bytearray(compression.compress_logical(stream, codec))
    for _ in range(data.draw(st.integers(1, 3))):
        i = data.draw(st.integers(1, len(file) - 1))
        file[i] ^= data.draw(st.integers(1, 255))
    cut = data.draw(st.integers(1, len(file)))
    try:
        logical = fmt.to_logical(bytes(file[:cut]))
    except CorruptChangelogError as exc:
        assert exc.file_offset and 0 <= exc.offset <= cut
        return
    if codec == "snappy":  # every data chunk is CRC-checked: what comes out is what went in
        assert bytes(stream).startswith(bytes(logical))
    _check(bytes(logical), 0)
