"""Integrity of compressed changelog files: a flipped bit is a CorruptChangelogError naming the file
and offset, never other data. Snappy chunks carry a CRC-32C; dstl writes zstd frames with a content
checksum. Raw files keep Flink's format, which has no checksum."""
from __future__ import annotations

import os
import random

import numpy as np
import pytest

from dstl import format as fmt
from dstl.changelog.handles import ChangelogStateHandleStreamImpl, StreamStateHandle
from dstl.changelog.reader import StateChangelogReader
from dstl.errors import CorruptChangelogError
from dstl.format import compression
from dstl.types import KeyGroupRange

KGR = KeyGroupRange(0, 63)
FLIPS = 100


def _bodies(total_bytes: int, seed: int = 11):
    """Change sets of mixed payloads: random (incompressible) and repetitive (compressible) values."""
    rng = np.random.default_rng(seed)
    bodies, changes, size = [], [], 0
    while size < total_bytes:
        buf = fmt.ChangeBuffer()
        batch = []
        noise = len(bodies) % 2 == 1  # every other change set is incompressible: stored Snappy chunks
        for i in range(int(rng.integers(200, 600))):
            n = int(rng.integers(0, 400 if noise else 200))
            random_value = noise or i % 2
            value = rng.integers(0, 256, n, dtype=np.uint8).tobytes() if random_value else bytes([i % 7]) * n
            kg = int(rng.integers(-1, 64))
            buf.append(kg, value)
            batch.append((kg, value))
            size += n
        bodies.append(buf.seal())
        changes.append(sorted(batch, key=lambda c: c[0]))  # canonical order: stable by key group
    return bodies, changes


def _write(path, compression_name, total_bytes):
    bodies, changes = _bodies(total_bytes)
    with open(path, "wb") as f:
        offsets, size = fmt.write_file(f, bodies, compression=compression_name)
    stream = StreamStateHandle(str(path), size)
    handle = ChangelogStateHandleStreamImpl([(stream, o) for o in offsets], KGR, size)
    return handle, [c for cs in changes for c in cs]


def _read(handle):
    with StateChangelogReader().get_changes(handle) as it:
        return [(c.key_group, c.data) for c in it]


@pytest.mark.parametrize("codec,total", [("snappy", 300_000), ("zstd", 2_500_000)])
def test_random_single_bit_flips_raise_or_read_back_the_original(tmp_path, codec, total):
    path = tmp_path / f"changes-{codec}"
    handle, original = _write(path, codec, total)
    assert _read(handle) == original
    clean = path.read_bytes()
    rng = random.Random(f"flips-{codec}")
    raised = 0
    for _ in range(FLIPS):
        pos, bit = rng.randrange(len(clean)), rng.randrange(8)
        bad = bytearray(clean)
        bad[pos] ^= 1 << bit
        path.write_bytes(bytes(bad))
        try:
            got = _read(handle)
        except CorruptChangelogError as exc:
            raised += 1
            assert str(path) in str(exc) and isinstance(exc.offset, int), (pos, bit, exc)
        else:
            assert got == original, f"bit {bit} of byte {pos} flipped: different data read back without an error"
    assert raised >= FLIPS * 9 // 10  # nearly every flip is caught (a few may land in bits that do not matter)


def test_zstd_frames_carry_a_content_checksum(tmp_path):
    handle, _ = _write(tmp_path / "z", "zstd", 2_500_000)
    data = memoryview((tmp_path / "z").read_bytes())
    frames = compression.zstd_frames(data[1:])
    assert len(frames) >= 3
    for _, start, _ in frames:
        assert data[1 + start + 4] & 0x04, "frame header descriptor without the Content_Checksum_flag"


def test_zstd_checksum_mismatch_names_file_and_frame_offset(tmp_path):
    path = tmp_path / "z"
    handle, _ = _write(path, "zstd", 50_000)
    bad = bytearray(path.read_bytes())
    bad[-1] ^= 0x10  # the last byte is the frame's checksum
    path.write_bytes(bytes(bad))
    with pytest.raises(CorruptChangelogError, match="checksum") as e:
        _read(handle)
    assert e.value.file == str(path) and e.value.file_offset and e.value.offset == 1


def test_snappy_data_chunk_turned_skippable_is_caught(tmp_path):
    """0x00 -> 0x80 (or 0x01 -> 0x81) makes a data chunk skippable: it must not vanish silently."""
    path = tmp_path / "s"
    handle, original = _write(path, "snappy", 200_000)
    clean = path.read_bytes()
    chunks = compression.snappy_chunks(memoryview(clean)[1:], 1)
    kinds = {ctype for ctype, *_ in chunks}
    assert {0x00, 0x01} <= kinds  # both compressed and stored chunks are exercised
    for ctype, where, _, _ in chunks[1:4] + chunks[-2:]:
        bad = bytearray(clean)
        bad[where] ^= 0x80
        path.write_bytes(bytes(bad))
        with pytest.raises(CorruptChangelogError, match="flipped chunk-type bit") as e:
            _read(handle)
        assert e.value.offset == where and e.value.file == str(path)
    path.write_bytes(clean)
    assert _read(handle) == original


def test_genuine_skippable_chunks_are_still_skipped():
    block = b"0123456789" * 10
    good = compression.compress_logical(block, "snappy")
    skippable = b"\x80\x08\x00\x00" + os.urandom(8)  # not a data chunk: skipped as the format says
    assert bytes(fmt.to_logical(good[:11] + skippable + good[11:])) == block


def test_raw_files_have_no_checksum(tmp_path):
    """Raw files are Flink's format: a flipped payload bit reads back as other data (documented)."""
    path = tmp_path / "r"
    handle, original = _write(path, None, 20_000)
    bad = bytearray(path.read_bytes())
    bad[-1] ^= 0x01  # inside the last change's payload
    path.write_bytes(bytes(bad))
    got = _read(handle)
    assert got != original and len(got) == len(original)
