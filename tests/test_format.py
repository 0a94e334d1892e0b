"""The byte format (docs/format.md): worked examples, file layout, compression, malformed input."""
from __future__ import annotations

import io
import struct
import uuid

import pytest

from dstl import format as fmt
from dstl.format import compression
from dstl.errors import CorruptChangelogError
from dstl.types import KeyGroupRange, SealedChangeSet, StateChange, StateChangeSet

from format_helpers import impl_params

LOG0 = uuid.UUID(int=0)

EXAMPLE_A = bytes.fromhex(
    "00" "00000004"
    "00000001ffffffff" "00000007" "4d4554412d7631"
    "0000000200000000" "00000008" "0001020304050607" "00000008" "0001020304050607"
    "0000000200000001" "00000008" "1f20212223242526" "00000008" "1f20212223242526"
    "0000000200000002" "00000008" "3e3f404142434445" "00000008" "3e3f404142434445")

EXAMPLE_B = bytes.fromhex(
    "00"
    "00000003" "00000001ffffffff00000001aa" "00000001000000030000000103"
    "0000000200000005" "000000020102" "0000000104"
    "00000002" "00000001000000050000000111" "00000001000000150000000110")


def example_a_changes():
    changes = [StateChange(-1, b"META-v1")]
    for i in range(6):
        k = i % 3
        changes.append(StateChange(k, bytes((31 * k + j) & 0xFF for j in range(8))))
    return changes


def example_b_sets():
    cs0 = StateChangeSet(LOG0, 0, [StateChange(-1, b"\xaa"), StateChange(5, b"\x01\x02"),
                                   StateChange(3, b"\x03"), StateChange(5, b"\x04")])
    cs1 = StateChangeSet(LOG0, 1, [StateChange(21, b"\x10"), StateChange(5, b"\x11")])
    return cs0, cs1


def test_worked_example_a_raw_is_byte_exact():
    data, positions = fmt.encode_file([StateChangeSet(LOG0, 0, example_a_changes())])
    assert data == EXAMPLE_A and len(data) == 120
    assert positions == [(0, 55)]
    assert memoryview(fmt.to_logical(data)).nbytes == 119
    decoded = fmt.decode_file(data, 0)
    assert decoded[0] == StateChange(-1, b"META-v1")
    assert [c.key_group for c in decoded] == [-1, 0, 0, 1, 1, 2, 2]


def test_worked_example_a_snappy_framing():
    data, positions = fmt.encode_file([StateChangeSet(LOG0, 0, example_a_changes())], compression="snappy")
    assert positions == [(0, 55)]
    assert data[:11] == b"\x01" + compression.SNAPPY_IDENTIFIER
    assert data[11] == 0x00  # compressed chunk: 91/119 <= 0.85 in the spec's Snappy
    length = int.from_bytes(data[12:15], "little")
    assert len(data) == 15 + length
    assert data[15:19] == bytes.fromhex("6BE04F8E")  # masked CRC of the 119 logical bytes
    assert bytes(fmt.to_logical(data)) == EXAMPLE_A[1:]


def test_worked_example_b_two_change_sets():
    cs0, cs1 = example_b_sets()
    data, positions = fmt.encode_file([cs1, cs0])  # positions come back in the given order
    assert data == EXAMPLE_B and len(data) == 80
    assert positions == [(49, 2), (0, 5)]
    assert fmt.decode_file(data, 49) == [StateChange(5, b"\x11"), StateChange(21, b"\x10")]
    assert fmt.decode_file(data, 0) == [StateChange(-1, b"\xaa"), StateChange(3, b"\x03"),
                                        StateChange(5, b"\x01\x02"), StateChange(5, b"\x04")]
    infos = fmt.walk(fmt.to_logical(data))
    assert [(i.offset, i.encoded_size, i.num_groups, i.num_changes, i.size, i.group_order) for i in infos] == [
        (0, 49, 3, 4, 5, (-1, 3, 5)), (49, 30, 2, 2, 2, (5, 21))]
    z, _ = fmt.encode_file([cs0, cs1], compression="snappy")
    assert z[15:19] == bytes.fromhex("82B0C395")
    assert fmt.decode_file(z, 49) == fmt.decode_file(data, 49)


def test_crc32c_check_value_and_mask():
    assert compression.crc32c(b"123456789") == 0xE3069283
    assert compression.mask_crc(0x7AC9F5E6) == 0x8E4FE06B
    assert compression.mask_crc(0x62D579A0) == 0x95C3B082


def test_one_change_of_33_bytes_encodes_to_49():
    assert len(fmt.encode_change_set([StateChange(7, b"x" * 33)])) == 49


def test_file_order_is_java_uuid_order_then_sequence_number():
    high = uuid.UUID("80000000-0000-0000-0000-000000000000")  # negative in Java, so it sorts first
    low = uuid.UUID("00000000-0000-0000-0000-000000000001")
    sets = [StateChangeSet(low, 1, [StateChange(0, b"c")]), StateChangeSet(low, 0, [StateChange(0, b"b")]),
            StateChangeSet(high, 5, [StateChange(0, b"a")])]
    data, positions = fmt.encode_file(sets)
    assert [off for off, _ in positions] == [34, 17, 0]
    assert [fmt.decode_file(data, off)[0].data for off, _ in positions] == [b"c", b"b", b"a"]
    assert high > low  # Python's unsigned order would put it last


def test_sealed_change_sets_are_written_as_given():
    buf = fmt.ChangeBuffer()
    buf.append(4, b"zz")
    buf.append(-1, b"m")
    sealed = SealedChangeSet(LOG0, 3, buf.seal(), 3, 2)
    data, positions = fmt.encode_file([sealed])
    assert positions == [(0, 3)]
    assert fmt.decode_file(data) == [StateChange(-1, b"m"), StateChange(4, b"zz")]


def test_empty_files():
    assert fmt.encode_file([]) == (b"\x00", [])
    data, _ = fmt.encode_file([], compression="snappy")
    assert data == b"\x01" + compression.SNAPPY_IDENTIFIER and len(data) == 11
    assert fmt.to_logical(data) == bytearray()
    assert fmt.to_logical(b"") == b""
    with pytest.raises(CorruptChangelogError, match="truncated") as info:
        fmt.decode_file(b"", 0)
    assert info.value.offset == 0
    zdata, _ = fmt.encode_file([], compression="zstd")
    assert zdata == b"\x02" and bytes(fmt.to_logical(zdata)) == b""


@pytest.mark.parametrize("codec", [None, "snappy", "zstd"])
def test_write_file_streams_bodies_of_any_size(codec):
    import random

    rng = random.Random(7)
    bodies = []
    for size in (0, 1, 65535, 65536, 65537, 200_000, 3, (1 << 20) + 5, 10):
        kind = rng.random()
        if kind < 0.4:
            payload = bytes(rng.randrange(256) for _ in range(min(size, 5000))) * (size // 5000 + 1)
        else:
            payload = bytes(rng.randrange(4) for _ in range(size))
        bodies.append(fmt.encode_change_set([StateChange(rng.randrange(10), payload[:size])]))
    out = io.BytesIO()
    offsets, size = fmt.write_file(out, bodies, compression=codec, buffer_size=4096)
    data = out.getvalue()
    logical = b"".join(bodies)
    assert size == len(logical)
    assert offsets == [sum(len(b) for b in bodies[:i]) for i in range(len(bodies))]
    assert data[0] == compression.codec_flag(codec)
    assert bytes(fmt.to_logical(data)) == logical
    assert data == compression.compress_logical(logical, codec)  # same as compressing in one go
    for off, body in zip(offsets, bodies):
        assert fmt.decode_file(data, off) == fmt.decode_change_set(body)[0]
    if codec == "snappy":
        chunks = compression.snappy_chunks(memoryview(data)[1:], 1)
        assert len(chunks) == 1 + -(-len(logical) // 65536)
        assert {c[0] for c in chunks[1:]} == {0x00, 0x01}
    if codec == "zstd":
        assert len(compression.zstd_frames(memoryview(data)[1:])) == -(-len(logical) // compression.ZSTD_BLOCK)


def test_unknown_codec_is_rejected():
    with pytest.raises(ValueError, match="unknown compression"):
        fmt.encode_file([], compression="lz4")


@pytest.mark.parametrize("bad", [[1, 2], [None], [b"not a change set"]])
def test_encode_file_rejects_non_change_sets_by_type(bad):
    with pytest.raises(TypeError, match="StateChangeSet or SealedChangeSet"):
        fmt.encode_file(bad)


def test_decode_arrays_point_into_the_logical_stream():
    cs0, cs1 = example_b_sets()
    data, _ = fmt.encode_file([cs0, cs1])
    logical = fmt.to_logical(data)
    kgs, offs, lens, end = fmt.decode_change_set_arrays(logical, 49)
    assert end == 79 and kgs.tolist() == [5, 21]
    assert kgs.dtype.name == "int32" and offs.dtype.name == "int64" and lens.dtype.name == "int64"
    assert [bytes(logical[o:o + n]) for o, n in zip(offs, lens)] == [b"\x11", b"\x10"]
    kgs, offs, lens, end = fmt.decode_change_set_arrays(logical, 0, KeyGroupRange(4, 10))
    assert kgs.tolist() == [-1, 5, 5]  # metadata always kept


# ------------------------------------------------------------------------------ malformed input

def _be(*ints):
    return b"".join(struct.pack(">i", i) for i in ints)


MALFORMED = [
    # (name, logical bytes, offset, error offset, message fragment)
    ("empty stream", b"", 0, 0, "truncated: group count"),
    ("short G", b"\x00\x00\x00", 0, 0, "truncated: group count"),
    ("negative G", _be(-1), 0, 0, "negative group count"),
    ("G overruns", _be(2) + _be(1, 0, 0), 0, 0, "group count 2"),
    ("huge G", _be(0x7FFFFFFF), 0, 0, "group count 2147483647"),
    ("G claims more than the header bytes", _be(1) + b"\x00\x00\x00\x01\x00\x00\x00", 0, 0, "group count 1 needs"),
    ("truncated group header", _be(2, 1, 3, 0) + b"\x00\x00\x00\x01", 0, 16, "truncated: group header"),
    ("negative N", _be(1, -3, 0), 0, 4, "negative change count"),
    ("key group below -1", _be(1, 0, -2), 0, 8, "invalid key group -2"),
    ("key group above 32767", _be(1, 0, 32768), 0, 8, "invalid key group 32768"),
    ("N overruns", _be(1, 5, 0, 1) + b"x", 0, 4, "change count 5"),
    ("huge N", _be(1, 0x7FFFFFFF, 0), 0, 4, "change count 2147483647"),
    ("payload cut", _be(1, 2, 0, 1) + b"x" + b"\x00\x00\x00\x01", 0, 17, "change length 1 runs past"),
    ("truncated length", _be(1, 2, 0, 3) + b"abc" + b"\x00\x00", 0, 19, "truncated: change length"),
    ("length field cut", _be(1, 2, 0, 0) + b"\x00\x00", 0, 4, "change count 2"),
    ("negative length", _be(1, 1, 0, -1), 0, 12, "negative change length"),
    ("length overruns", _be(1, 1, 0, 10) + b"abc", 0, 12, "change length 10"),
    ("huge length", _be(1, 1, 0, 0x7FFFFFFF), 0, 12, "change length 2147483647"),
    ("offset past end", _be(0), 5, 5, "outside the logical stream"),
    ("offset at end", _be(0), 4, 4, "truncated: group count"),
    ("second set truncated", _be(1, 1, 0, 1) + b"x" + _be(1, 1, 3), 17, 21, "change count 1"),
]


@impl_params
@pytest.mark.parametrize("name,logical,offset,where,fragment", MALFORMED, ids=[m[0] for m in MALFORMED])
def test_malformed_change_sets(impl, name, logical, offset, where, fragment):
    for decode in (impl.decode.decode_change_set, impl.decode.decode_change_set_arrays):
        with pytest.raises(CorruptChangelogError) as info:
            decode(logical, offset)
        assert info.value.offset == where, str(info.value)
        assert fragment in str(info.value)
        assert not info.value.file_offset
    if offset == 0 and logical:
        with pytest.raises(CorruptChangelogError):
            impl.decode.walk(logical)


@impl_params
def test_walk_needs_the_last_change_set_to_end_at_the_end(impl):
    good = _be(1, 1, 3, 1) + b"x"
    assert [i.offset for i in impl.decode.walk(good + good)] == [0, 17]
    with pytest.raises(CorruptChangelogError) as info:
        impl.decode.walk(good + b"\x00\x00")
    assert info.value.offset == 17
    assert impl.decode.walk(b"") == []


@impl_params
def test_decoder_reads_exactly_one_change_set(impl):
    good = _be(1, 1, 3, 1) + b"x"
    changes, end = impl.decode.decode_change_set(good + b"garbage", 0)
    assert end == 17 and changes == [StateChange(3, b"x")]
    changes, end = impl.decode.decode_change_set(_be(0), 0)  # G = 0 is accepted
    assert changes == [] and end == 4
    # any group order, repeated groups and N = 0 are accepted and kept in stream order
    body = _be(4, 1, 9, 1) + b"a" + _be(0, 2) + _be(1, -1, 1) + b"m" + _be(1, 9, 1) + b"b"
    changes, end = impl.decode.decode_change_set(body, 0)
    assert changes == [StateChange(9, b"a"), StateChange(-1, b"m"), StateChange(9, b"b")]
    assert impl.decode.walk(body)[0].group_order == (9, 2, -1, 9)


def _snappy_file(logical: bytes) -> bytearray:
    return bytearray(compression.compress_logical(logical, "snappy"))


SNAPPY_LOGICAL = (_be(1, 3, 7, 5) + b"hello" + _be(5) + b"world" + _be(4) + b"abcd") * 2000  # 2 chunks


def _framing_cases():
    ident = b"\x01" + compression.SNAPPY_IDENTIFIER
    good = _snappy_file(SNAPPY_LOGICAL)
    crc = bytearray(good)
    crc[15] ^= 0xFF
    bad_data = bytearray(good)
    bad_data[20] ^= 0xFF  # inside the compressed block
    second = bytearray(good)
    chunks = compression.snappy_chunks(memoryview(good)[1:], 1)
    second_at = chunks[2][1]
    second[second_at + 5] ^= 0x01  # CRC of the second data chunk
    raw_big = ident + b"\x01" + (65541).to_bytes(3, "little") + b"\x00" * 65541
    expand = bytes(compression.cramjam.snappy.compress_raw(b"\x00" * 70000))
    comp_big = ident + b"\x00" + (len(expand) + 4).to_bytes(3, "little") + b"\x00" * 4 + expand
    return [
        ("no identifier", b"\x01", 1, "no stream identifier"),
        ("data first", b"\x01" + b"\x01\x05\x00\x00" + b"\x00" * 5, 1, "does not start with the stream identifier"),
        ("wrong identifier", b"\x01\xff\x06\x00\x00sNaPpX", 1, "malformed Snappy stream identifier"),
        ("reserved type", ident + b"\x02\x00\x00\x00", 11, "reserved unskippable chunk type 0x02"),
        ("short chunk", ident + b"\x00\x03\x00\x00abc", 11, "shorter than its CRC"),
        ("truncated header", ident + b"\x00\x03", 11, "truncated chunk header"),
        ("chunk overruns", ident + b"\x01\xff\x00\x00abcd", 11, "claims 255 bytes"),
        ("crc mismatch", bytes(crc), 11, "CRC-32C mismatch"),
        ("crc mismatch in second chunk", bytes(second), second_at, "CRC-32C mismatch"),
        ("invalid snappy data", bytes(bad_data), 11, ""),
        ("uncompressed chunk too big", raw_big, 11, "more than 65536"),
        ("compressed chunk too big", comp_big, 11, "more than 65536"),
        ("unknown flag", b"\x07abc", 0, "unknown compression flag 0x07"),
        ("zstd bad magic", b"\x02\x00\x01\x02\x03\x04", 1, "not a zstd frame"),
        ("zstd truncated", bytes(compression.compress_logical(SNAPPY_LOGICAL, "zstd"))[:-3], 1, "truncated zstd frame"),
        ("zstd reserved bit", b"\x02\x28\xb5\x2f\xfd\x08\x00\x01\x00\x00", 1, "reserved bit"),
        ("zstd absurd content size", b"\x02\x28\xb5\x2f\xfd\xe0" + b"\xff" * 7 + b"\x7f" + b"\x01\x00\x00", 1,
         "claims"),
    ]


FRAMING = _framing_cases()


@pytest.mark.parametrize("name,data,where,fragment", FRAMING, ids=[c[0] for c in FRAMING])
def test_framing_errors_carry_the_file_offset(name, data, where, fragment):
    with pytest.raises(CorruptChangelogError) as info:
        fmt.to_logical(data, "s3://bucket/job/dstl/file")
    err = info.value
    assert err.file_offset and err.offset == where, str(err)
    assert err.file == "s3://bucket/job/dstl/file"
    assert fragment in str(err)
    with pytest.raises(CorruptChangelogError):
        fmt.decode_file(data, 0)


def test_zstd_corrupted_content_and_checksum():
    import cramjam

    logical = SNAPPY_LOGICAL
    good = b"\x02" + bytes(cramjam.zstd.compress(b"first"))
    garbage_block = b"\x28\xb5\x2f\xfd\x20\x10\x2d\x00\x00" + b"\xff" * 5  # compressed block of junk
    with pytest.raises(CorruptChangelogError, match="invalid zstd frame") as info:
        fmt.to_logical(good + garbage_block)
    assert info.value.file_offset and info.value.offset == len(good)
    two = b"\x02" + bytes(cramjam.zstd.compress(b"abc")) + bytes(cramjam.zstd.compress(logical))
    assert bytes(fmt.to_logical(two)) == b"abc" + logical
    skippable = b"\x02" + b"\x50\x2a\x4d\x18" + (3).to_bytes(4, "little") + b"xyz" + bytes(cramjam.zstd.compress(b"q"))
    assert bytes(fmt.to_logical(skippable)) == b"q"


def test_snappy_skippable_chunks_and_repeated_identifiers_are_accepted():
    good = bytes(_snappy_file(b"0123456789"))
    padded = good[:11] + b"\xfe\x02\x00\x00\x00\x00" + compression.SNAPPY_IDENTIFIER + good[11:]
    assert bytes(fmt.to_logical(padded)) == b"0123456789"


@impl_params
def test_decoded_changes_are_ordinary_state_changes(impl):
    import pickle

    body = fmt.encode_change_set([StateChange(-1, b"m"), StateChange(3, b"abc"), StateChange(3, b"")])
    changes, _ = impl.decode.decode_change_set(body)
    assert all(type(c) is impl.StateChange for c in changes)
    assert changes == [StateChange(-1, b"m"), StateChange(3, b"abc"), StateChange(3, b"")]
    assert hash(changes[1]) == hash(StateChange(3, b"abc"))
    assert pickle.loads(pickle.dumps(changes)) == changes
    kg, data = changes[1]
    assert (kg, data, changes[0].is_meta()) == (3, b"abc", True)
    with pytest.raises(AttributeError):
        changes[1].key_group = 4


def test_snappy_size_claims_are_not_allocated_up_front():
    """30k tiny chunks each claiming 64 KiB: the first bad chunk fails before 2 GB are reserved."""
    import tracemalloc

    claim = b"\x80\x80\x04" + b"\x00"  # varint 65536, then junk
    chunk = b"\x00" + (4 + len(claim)).to_bytes(3, "little") + b"\x00" * 4 + claim
    data = b"\x01" + compression.SNAPPY_IDENTIFIER + chunk * 30_000
    tracemalloc.start()
    try:
        with pytest.raises(CorruptChangelogError) as info:
            fmt.to_logical(data)
        peak = tracemalloc.get_traced_memory()[1]
    finally:
        tracemalloc.stop()
    assert info.value.offset == 11 and info.value.file_offset
    assert peak < 200 * len(data)


@pytest.mark.parametrize("bound", [compression.SNAPPY_MAX_EXPANSION, 1])
def test_snappy_decodes_with_and_without_preallocation(bound, monkeypatch):
    logical = b"\x00" * (3 * 65536 + 17) + bytes(range(256)) * 300
    data = compression.compress_logical(logical, "snappy")
    monkeypatch.setattr(compression, "SNAPPY_MAX_EXPANSION", bound)  # 1: the grow-as-verified path
    assert bytes(fmt.to_logical(data)) == logical
    bad = bytearray(data)
    bad[-3] ^= 0x40
    with pytest.raises(CorruptChangelogError):
        fmt.to_logical(bytes(bad))
