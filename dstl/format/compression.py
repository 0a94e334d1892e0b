"""The flag byte and the compressed wrappings of a changelog file (docs/format.md §3, §6, §7).

* flag 0: raw; flag 1: Snappy framing format (stream identifier, 64 KiB blocks, masked CRC-32C,
  0.85 rule, as xerial's SnappyFramedOutputStream writes it); flag 2: concatenated zstd frames.
* `StreamWriter` compresses block by block as bodies arrive (no second copy of a large upload).
* `to_logical` turns whole-file bytes into the logical stream, verifying every Snappy CRC and every
  zstd content checksum (dstl writes zstd frames with one); framing errors raise
  CorruptChangelogError with the *file* offset of the chunk or frame. Raw files have no checksum.
"""
from __future__ import annotations

import struct
from typing import List, Optional, Tuple

import cramjam
import crc32c as _crc32c

from dstl.errors import CorruptChangelogError

FLAG_RAW = 0
FLAG_SNAPPY = 1
FLAG_ZSTD = 2

SNAPPY_BLOCK = 65536
SNAPPY_MIN_RATIO = 0.85
SNAPPY_IDENTIFIER = b"\xff\x06\x00\x00sNaPpY"
SNAPPY_MAX_EXPANSION = 32  # generous bound on decompressed/compressed bytes for real Snappy data
ZSTD_BLOCK = 1 << 20  # logical bytes per zstd frame: frames stay independently decodable
ZSTD_LEVEL = 3

_CODECS = {None: FLAG_RAW, "none": FLAG_RAW, "raw": FLAG_RAW, "snappy": FLAG_SNAPPY, "zstd": FLAG_ZSTD}
_ZSTD_MAGIC = 0xFD2FB528
ZSTD_MAX_BLOCK = 1 << 17  # RFC 8878 Block_Maximum_Size


def codec_flag(compression: Optional[str]) -> int:
    """The flag byte for a codec name: None/"none" -> 0, "snappy" -> 1, "zstd" -> 2."""
    key = compression.lower() if isinstance(compression, str) else compression
    if key not in _CODECS:
        raise ValueError(f"unknown compression {compression!r}: use None, 'snappy' or 'zstd'")
    return _CODECS[key]


def crc32c(data) -> int:
    """CRC-32C (Castagnoli); crc32c(b"123456789") == 0xE3069283."""
    return _crc32c.crc32c(data)


def mask_crc(crc: int) -> int:
    """Snappy's CRC mask: rotate right by 15, then add 0xA282EAD8 (mod 2^32)."""
    return ((((crc >> 15) | (crc << 17)) & 0xFFFFFFFF) + 0xA282EAD8) & 0xFFFFFFFF


def zstd_compressor():
    """A zstd compressor whose frames carry their content size and a content checksum (XXH64), which
    readers verify (libzstd does when the frame has one): a flipped bit is an error, not other data."""
    import zstandard

    return zstandard.ZstdCompressor(level=ZSTD_LEVEL, write_checksum=True, write_content_size=True)


def snappy_chunk(block) -> bytes:
    """One data chunk for a block of at most 64 KiB (compressed unless that saves < 15 %)."""
    length = len(block)
    crc = struct.pack("<I", mask_crc(_crc32c.crc32c(block)))
    compressed = cramjam.snappy.compress_raw(block)
    if len(compressed) / length <= SNAPPY_MIN_RATIO:  # same double comparison as xerial
        return b"\x00" + (len(compressed) + 4).to_bytes(3, "little") + crc + bytes(compressed)
    return b"\x01" + (length + 4).to_bytes(3, "little") + crc + bytes(block)


class StreamWriter:
    """Writes the flag byte, then logical bytes (raw or compressed on the fly) into a binary file object.

    `write` may be called with bodies of any size; large bodies are compressed straight from the
    caller's buffer, one block at a time. Call `finish()` once at the end (it does not close the file).
    """

    def __init__(self, fileobj, compression: Optional[str] = None, buffer_size: int = 1 << 20):
        self.flag = codec_flag(compression)
        self._file = fileobj
        self._buffer_size = max(int(buffer_size), 1)
        self._out = bytearray()
        self._pending = bytearray()
        self._block = {FLAG_RAW: 0, FLAG_SNAPPY: SNAPPY_BLOCK, FLAG_ZSTD: ZSTD_BLOCK}[self.flag]
        self.logical_size = 0
        self.file_size = 0
        self._finished = False
        self._zstd_ctx = None
        self._emit(bytes([self.flag]))
        if self.flag == FLAG_SNAPPY:
            self._emit(SNAPPY_IDENTIFIER)

    def _emit(self, piece) -> None:
        self.file_size += len(piece)
        if len(piece) >= self._buffer_size:
            self._flush_out()
            self._file.write(piece)
            return
        self._out += piece
        if len(self._out) >= self._buffer_size:
            self._flush_out()

    def _flush_out(self) -> None:
        if self._out:
            self._file.write(self._out)  # handed over, never touched again: no extra copy
            self._out = bytearray()

    def _emit_block(self, block) -> None:
        if self.flag == FLAG_SNAPPY:
            self._emit(snappy_chunk(block))
        else:
            self._emit(self._zstd().compress(block))

    def _zstd(self):
        """This writer's zstd compressor (a context is not thread-safe: one per stream)."""
        if self._zstd_ctx is None:
            self._zstd_ctx = zstd_compressor()
        return self._zstd_ctx

    def write(self, data) -> None:
        """Append logical bytes: a bytes-like object, or a body that streams itself (`write_to`, e.g.
        a `SealedBody`), which is then produced piece by piece straight into the file or compressor."""
        if self._finished:
            raise ValueError("StreamWriter is finished")
        if hasattr(data, "write_to"):
            if self.flag != FLAG_RAW:
                data.write_to(self.write, self._buffer_size)
                return
            self._flush_out()
            n = data.write_to(self._file.write, self._buffer_size)
            self.logical_size += n
            self.file_size += n
            return
        view = memoryview(data).cast("B") if not isinstance(data, (bytes, bytearray)) else memoryview(data)
        n = len(view)
        self.logical_size += n
        if self.flag == FLAG_RAW:
            self._emit(view)
            return
        block = self._block
        pos = 0
        if self._pending:
            take = min(block - len(self._pending), n)
            self._pending += view[:take]
            pos = take
            if len(self._pending) < block:
                return
            self._emit_block(bytes(self._pending))
            self._pending = bytearray()
        while n - pos >= block:
            self._emit_block(view[pos:pos + block])
            pos += block
        if pos < n:
            self._pending += view[pos:]

    def finish(self) -> None:
        """Write the last (short) block and flush everything to the file object."""
        if self._finished:
            return
        if self._pending:
            self._emit_block(bytes(self._pending))
            self._pending = bytearray()
        self._flush_out()
        self._finished = True


def compress_logical(logical, compression: Optional[str]) -> bytes:
    """Whole file bytes (flag first) for a logical stream."""
    import io

    buf = io.BytesIO()
    writer = StreamWriter(buf, compression)
    writer.write(logical)
    writer.finish()
    return buf.getvalue()


# ---------------------------------------------------------------------------------------------- read


def _corrupt(reason: str, file_offset: int, file: Optional[str]) -> CorruptChangelogError:
    return CorruptChangelogError(reason, file_offset, file, file_offset=True)


def snappy_chunks(view: memoryview, base: int, file: Optional[str] = None) -> List[Tuple[int, int, int, int]]:
    """Parse the chunk structure of a framed stream: [(type, file offset, body start, body end)].

    `view` is the part after the flag byte and `base` its file offset. Checks identifier, chunk
    types and lengths (not the CRCs: `snappy_unframe` does that while decompressing).
    """
    chunks = []
    pos, end = 0, len(view)
    if end == 0:
        raise _corrupt("Snappy stream has no stream identifier", base, file)
    while pos < end:
        if end - pos < 4:
            raise _corrupt(f"truncated chunk header ({end - pos} of 4 bytes)", base + pos, file)
        ctype = view[pos]
        length = view[pos + 1] | (view[pos + 2] << 8) | (view[pos + 3] << 16)
        body = pos + 4
        if length > end - body:
            raise _corrupt(f"chunk of type 0x{ctype:02X} claims {length} bytes, {end - body} remain",
                           base + pos, file)
        if ctype == 0xFF:
            if bytes(view[pos:body + length]) != SNAPPY_IDENTIFIER:
                raise _corrupt("malformed Snappy stream identifier", base + pos, file)
        elif not chunks:
            raise _corrupt(f"Snappy stream does not start with the stream identifier (chunk type 0x{ctype:02X})",
                           base + pos, file)
        elif ctype in (0x00, 0x01):
            if length < 4:
                raise _corrupt(f"data chunk of {length} bytes is shorter than its CRC", base + pos, file)
            if ctype == 0x01 and length - 4 > SNAPPY_BLOCK:
                raise _corrupt(f"uncompressed chunk holds {length - 4} bytes, more than {SNAPPY_BLOCK}",
                               base + pos, file)
        elif ctype <= 0x7F:
            raise _corrupt(f"reserved unskippable chunk type 0x{ctype:02X}", base + pos, file)
        chunks.append((ctype, base + pos, body, body + length))
        pos = body + length
    return chunks


def _flipped_data_chunk(view: memoryview, start: int, stop: int, compressed: bool) -> bool:
    """Whether a skippable chunk's body is a valid data chunk (CRC and all), i.e. a data chunk whose
    type byte got its top bit flipped (0x00 -> 0x80, 0x01 -> 0x81). Skipping it would drop data
    silently; a genuine skippable chunk matches a CRC only by a 2^-32 chance."""
    if stop - start < 4:
        return False
    payload = view[start + 4:stop]
    try:
        if compressed:
            if cramjam.snappy.decompress_raw_len(payload) > SNAPPY_BLOCK:
                return False
            payload = cramjam.snappy.decompress_raw(payload)
        elif len(payload) > SNAPPY_BLOCK:
            return False
    except Exception:  # not Snappy data: a genuine skippable chunk
        return False
    return mask_crc(_crc32c.crc32c(payload)) == int.from_bytes(view[start:start + 4], "little")


def snappy_unframe(view: memoryview, base: int = 1, file: Optional[str] = None) -> bytearray:
    """Decompress a Snappy framed stream, verifying every data chunk's CRC-32C."""
    chunks = snappy_chunks(view, base, file)
    sizes = []
    total = 0
    for ctype, where, start, stop in chunks:
        if ctype in (0x80, 0x81) and _flipped_data_chunk(view, start, stop, ctype == 0x80):
            raise _corrupt(f"skippable chunk of type 0x{ctype:02X} holds a valid data chunk (a flipped "
                           f"chunk-type bit)", where, file)
        if ctype == 0x00:
            try:
                n = cramjam.snappy.decompress_raw_len(view[start + 4:stop])
            except Exception as exc:  # cramjam raises its own error types
                raise _corrupt(f"invalid Snappy data: {exc}", where, file) from None
            if n > SNAPPY_BLOCK:
                raise _corrupt(f"compressed chunk expands to {n} bytes, more than {SNAPPY_BLOCK}", where, file)
        elif ctype == 0x01:
            n = stop - start - 4
        else:
            n = 0
        sizes.append(n)
        total += n
    # Chunk headers only *claim* sizes: preallocate the whole stream only when the claim is within
    # what Snappy can produce from this many bytes; otherwise grow as chunks are verified.
    preallocate = total <= SNAPPY_MAX_EXPANSION * len(view) + SNAPPY_BLOCK
    out = bytearray(total) if preallocate else bytearray()
    mv = memoryview(out) if preallocate else None
    pos = 0
    for (ctype, where, start, stop), n in zip(chunks, sizes):
        if ctype not in (0x00, 0x01):
            continue
        target = mv[pos:pos + n] if preallocate else memoryview(bytearray(n))
        if ctype == 0x00:
            try:
                got = cramjam.snappy.decompress_raw_into(view[start + 4:stop], target)
            except Exception as exc:
                raise _corrupt(f"invalid Snappy data: {exc}", where, file) from None
            if got != n:
                raise _corrupt(f"Snappy block decoded to {got} bytes, its header says {n}", where, file)
        else:
            target[:] = view[start + 4:stop]
        expected = int.from_bytes(view[start:start + 4], "little")
        actual = mask_crc(_crc32c.crc32c(target))
        if actual != expected:
            raise _corrupt(f"CRC-32C mismatch (stored 0x{expected:08X}, computed 0x{actual:08X})", where, file)
        if not preallocate:
            out += target
        pos += n
    return out


def zstd_frames(view: memoryview, base: int = 1, file: Optional[str] = None) -> List[Tuple[int, int, int]]:
    """Split concatenated zstd frames (RFC 8878): [(file offset, start, end)]; skippable frames dropped."""
    frames = []
    pos, end = 0, len(view)

    def need(k: int, what: str, frame_at: int) -> None:
        if end - pos < k:
            raise _corrupt(f"truncated zstd frame: {what} needs {k} bytes, {end - pos} remain", base + frame_at, file)

    while pos < end:
        at = pos
        need(4, "magic number", at)
        magic = int.from_bytes(view[pos:pos + 4], "little")
        pos += 4
        if 0x184D2A50 <= magic <= 0x184D2A5F:  # skippable frame
            need(4, "skippable frame size", at)
            size = int.from_bytes(view[pos:pos + 4], "little")
            pos += 4
            need(size, "skippable frame", at)
            pos += size
            continue
        if magic != _ZSTD_MAGIC:
            raise _corrupt(f"not a zstd frame (magic 0x{magic:08X})", base + at, file)
        need(1, "frame header", at)
        fhd = view[pos]
        pos += 1
        if fhd & 0x08:
            raise _corrupt("zstd frame header has the reserved bit set", base + at, file)
        single = (fhd >> 5) & 1
        fcs = (fhd >> 6) & 3
        dict_len = (0, 1, 2, 4)[fhd & 3]
        fcs_len = ((1 if single else 0), 2, 4, 8)[fcs]
        header = (0 if single else 1) + dict_len + fcs_len
        need(header, "frame header", at)
        content_size = None
        if fcs_len:
            content_size = int.from_bytes(view[pos + header - fcs_len:pos + header], "little")
            if fcs_len == 2:
                content_size += 256
        pos += header
        bound = 0  # most bytes the blocks can produce; checked before libzstd allocates anything
        while True:
            need(3, "block header", at)
            bh = view[pos] | (view[pos + 1] << 8) | (view[pos + 2] << 16)
            pos += 3
            btype, bsize = (bh >> 1) & 3, bh >> 3
            if btype == 3:
                raise _corrupt("zstd block of the reserved type", base + at, file)
            if bsize > ZSTD_MAX_BLOCK:
                raise _corrupt(f"zstd block of {bsize} bytes exceeds {ZSTD_MAX_BLOCK}", base + at, file)
            body = 1 if btype == 1 else bsize
            need(body, "block", at)
            pos += body
            bound += ZSTD_MAX_BLOCK if btype == 2 else bsize
            if bh & 1:
                break
        if fhd & 0x04:
            need(4, "content checksum", at)
            pos += 4
        if content_size is not None and content_size > bound:
            raise _corrupt(f"zstd frame claims {content_size} bytes, its blocks hold at most {bound}",
                           base + at, file)
        frames.append((base + at, at, pos))
    return frames


def zstd_unframe(view: memoryview, base: int = 1, file: Optional[str] = None):
    """Decompress concatenated zstd frames (content checksums are verified by libzstd when present)."""
    frames = zstd_frames(view, base, file)
    parts = []
    for where, start, stop in frames:
        try:
            parts.append(cramjam.zstd.decompress(view[start:stop]))
        except Exception as exc:  # DecompressionError, or MemoryError for an absurd content size
            raise _corrupt(f"invalid zstd frame: {exc}", where, file) from None
    if len(parts) == 1:
        return memoryview(parts[0]).cast("B") if memoryview(parts[0]).format != "B" else memoryview(parts[0])
    out = bytearray()
    for p in parts:
        out += memoryview(p)
    return out


def to_logical(data, file: Optional[str] = None):
    """Whole file bytes -> the logical stream (bytes-like; a raw file gives a zero-copy view)."""
    try:
        view = memoryview(data)
    except TypeError:
        raise TypeError(f"file data must be bytes-like, got {type(data).__name__}") from None
    if view.format != "B" or view.ndim != 1:
        view = view.cast("B") if view.ndim <= 1 else view.cast("B", (view.nbytes,))
    if len(view) == 0:
        return b""
    flag = view[0]
    if flag == FLAG_RAW:
        return view[1:]
    if flag == FLAG_SNAPPY:
        return snappy_unframe(view[1:], 1, file)
    if flag == FLAG_ZSTD:
        return zstd_unframe(view[1:], 1, file)
    raise _corrupt(f"unknown compression flag 0x{flag:02X}", 0, file)


def file_flag(data) -> Optional[int]:
    """The flag byte of whole-file bytes, None for a 0-byte file."""
    view = memoryview(data)
    return view.cast("B")[0] if view.nbytes else None
