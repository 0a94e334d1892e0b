"""The uploader process's kept segment mappings (MappedSegments) on real POSIX shared memory: reused
while the segment is the same, renewed when it grew or was made anew, dropped when it is gone, bounded
in bytes; and a FileSpan writes from a kept mapping exactly the bytes a pread gives."""
from __future__ import annotations

import os
import uuid

import pytest

from dstl.changelog.upload.service import shm
from dstl.changelog.upload.service.mapped import MappedSegments
from dstl.changelog.upload.uploader import FileSpan


@pytest.fixture
def segments():
    made = []

    def make(size: int, fill: bytes = b"") -> shm.Segment:
        seg = shm.Segment(f"dstl_test_{os.getpid()}_{uuid.uuid4().hex[:8]}_m_{len(made)}", size)
        made.append(seg)
        if fill:
            seg.write([fill])
        return seg

    yield make
    for seg in made:
        seg.unlink()


def test_a_kept_mapping_is_reused_until_the_segment_changes(segments):
    seg = segments(1 << 20, b"a" * 1000)
    kept = MappedSegments()
    fd = shm.open_readonly(seg.name)
    try:
        m = kept.get(seg.name, fd, 1000)
        assert m is not None and m[:1000] == b"a" * 1000
        assert kept.get(seg.name, fd, 1000) is m and (kept.hits, kept.misses) == (1, 1)
        seg.write([b"b" * 3 * (1 << 20)])  # the client grows it: same inode, another size
        m2 = kept.get(seg.name, fd, 3 << 20)
        assert m2 is not m and m2[:10] == b"b" * 10 and kept.misses == 2
        assert len(kept) == 1 and kept.mapped_bytes == seg.size
        assert kept.get(seg.name, fd, seg.size + 1) is None  # shorter than the span: the caller reports it
    finally:
        os.close(fd)
        kept.clear()
    assert len(kept) == 0 and kept.mapped_bytes == 0


def test_gone_and_remade_segments_are_dropped(segments):
    a, b = segments(64 << 10, b"x"), segments(64 << 10, b"y")
    kept = MappedSegments()
    for seg in (a, b):
        fd = shm.open_readonly(seg.name)
        kept.get(seg.name, fd, 1)
        os.close(fd)
    assert kept.prune() == 0 and len(kept) == 2
    a.unlink()  # the client let it go: a kept mapping would pin its pages
    assert kept.prune() == 1 and len(kept) == 1
    b.unlink()
    again = shm.Segment(b.name, 64 << 10)  # the same name made anew: another inode
    try:
        assert kept.prune() == 1 and len(kept) == 0
    finally:
        again.unlink()


def test_the_kept_bytes_are_bounded(segments):
    segs = [segments(1 << 20, bytes([i]) * 10) for i in range(4)]
    kept = MappedSegments(max_bytes=2 << 20)
    for seg in segs:
        fd = shm.open_readonly(seg.name)
        assert kept.get(seg.name, fd, 10)[:10] == bytes([segs.index(seg)]) * 10
        os.close(fd)
    assert len(kept) == 2 and kept.mapped_bytes == 2 << 20  # least recently used went first
    big = segments(3 << 20, b"z")
    fd = shm.open_readonly(big.name)
    try:
        assert kept.get(big.name, fd, 1) is None  # larger than the bound: not kept (pread/map path)
    finally:
        os.close(fd)
    kept.clear()


def test_a_span_writes_the_same_bytes_from_a_kept_mapping(segments, tmp_path):
    payload = os.urandom(3 << 20)
    seg = segments(4 << 20, payload)
    kept = MappedSegments()
    fd = shm.open_readonly(seg.name)
    try:
        m = kept.get(seg.name, fd, len(payload))
        for name, span in (("mapped", FileSpan(fd, 12345, 2 << 20, m)), ("plain", FileSpan(fd, 12345, 2 << 20))):
            out = os.open(tmp_path / name, os.O_WRONLY | os.O_CREAT | os.O_EXCL)
            try:
                span.send_to(out)
            finally:
                os.close(out)
            assert (tmp_path / name).read_bytes() == payload[12345:12345 + (2 << 20)]
    finally:
        os.close(fd)
        kept.clear()
