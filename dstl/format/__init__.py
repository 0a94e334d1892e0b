"""The dstl changelog byte format (docs/format.md): encoding, file writing and decoding.

This facade picks the Cython hot path (`dstl._fast._buffer`, `_writer`, `_filewrite`, `_spares`,
`_decode`) or its pure-Python twins (`dstl._fast._buffer_py`, ...) by `dstl._impl.IMPLEMENTATION`; both
give byte-identical results.

    >>> buf = ChangeBuffer(); buf.append(5, b"x"); buf.append(-1, b"meta")
    >>> body = buf.seal()                       # meta group first, then key groups ascending
    >>> data, positions = encode_file([...])    # whole file: flag byte, then change sets
    >>> decode_file(data, positions[0][0])      # -> [StateChange, ...]
"""
from __future__ import annotations

import io
from typing import Iterable, List, Optional, Sequence, Tuple

from dstl import _impl
from dstl.format.compression import FLAG_RAW, FLAG_SNAPPY, FLAG_ZSTD, StreamWriter, codec_flag, to_logical
from dstl.types import SealedChangeSet, StateChange, StateChangeSet, java_uuid_sort_key
from dstl._fast._decode_py import ChangeSetInfo

_buffer, _filewrite, _spares = _impl.kernel("_buffer"), _impl.kernel("_filewrite"), _impl.kernel("_spares")
ChangeBuffer = _buffer.ChangeBuffer
WriterCore = _impl.kernel("_writer").WriterCore
write_bodies, write_bodies_at = _filewrite.write_bodies, _filewrite.write_bodies_at
spare_bytes, release_spares = _spares.spare_bytes, _spares.release_spares
_decode = _impl.kernel("_decode")
decode_change_set, decode_change_set_arrays, walk = _decode.decode_change_set, _decode.decode_change_set_arrays, _decode.walk
iter_change_set, chain_changes = _decode.iter_change_set, _decode.chain_changes

IMPLEMENTATION = _impl.IMPLEMENTATION

__all__ = [
    "FLAG_RAW", "FLAG_SNAPPY", "FLAG_ZSTD", "IMPLEMENTATION", "ChangeBuffer", "ChangeSetInfo", "WriterCore",
    "encode_change_set", "encode_file", "write_file", "to_logical", "decode_change_set",
    "decode_change_set_arrays", "decode_file", "decode_stream", "iter_change_set", "chain_changes", "walk",
    "codec_flag", "write_bodies", "write_bodies_at", "spare_bytes", "release_spares",
]


def encode_change_set(changes: Iterable[StateChange]) -> bytes:
    """The canonical body of one change set (meta group first, key groups ascending, append order kept)."""
    buf = ChangeBuffer()
    for change in changes:
        if isinstance(change, StateChange):
            buf.append(change.key_group, change.data)
        else:
            kg, data = change
            buf.append(kg, data)
    return buf.seal()


def _body_and_size(change_set) -> Tuple[bytes, int]:
    if isinstance(change_set, SealedChangeSet):
        return change_set.body, change_set.size
    if isinstance(change_set, StateChangeSet):
        return encode_change_set(change_set.changes), change_set.size
    raise TypeError(f"change sets must be StateChangeSet or SealedChangeSet, got {type(change_set).__name__}")


def _sort_key(change_set):
    if not isinstance(change_set, (SealedChangeSet, StateChangeSet)):  # before the attribute access below
        raise TypeError(f"change sets must be StateChangeSet or SealedChangeSet, got {type(change_set).__name__}")
    return java_uuid_sort_key(change_set.log_id) + (int(change_set.sequence_number),)


def encode_file(change_sets, *, compression: Optional[str] = None) -> Tuple[bytes, List[Tuple[int, int]]]:
    """The whole file (flag byte first) and each given change set's `(offset, size)` in the given order.

    Change sets are written sorted by (log id in Java UUID order, sequence number) (docs/format.md §5);
    `offset` is logical (flag byte excluded), `size` the change set's payload bytes (docs/format.md §5.6).
    """
    change_sets = list(change_sets)
    order = sorted(range(len(change_sets)), key=lambda i: _sort_key(change_sets[i]))
    encoded = {i: _body_and_size(change_sets[i]) for i in order}
    out = io.BytesIO()
    offsets, _ = write_file(out, [encoded[i][0] for i in order], compression=compression)
    where = {i: off for i, off in zip(order, offsets)}
    return out.getvalue(), [(where[i], encoded[i][1]) for i in range(len(change_sets))]


def write_file(fileobj, bodies: Sequence, *, compression: Optional[str] = None,
               buffer_size: int = 1 << 20) -> Tuple[List[int], int]:
    """Stream the flag byte and `bodies` (in the given order) into a binary file object.

    Returns each body's logical offset and the logical stream length (the stream handle's state
    size). Compression happens block by block as bodies are written.
    """
    writer = StreamWriter(fileobj, compression, buffer_size)
    offsets = []
    for body in bodies:
        offsets.append(writer.logical_size)
        writer.write(body)
    writer.finish()
    return offsets, writer.logical_size


def decode_file(data, offset: int = 0, key_group_range=None, *, file: Optional[str] = None) -> List[StateChange]:
    """The changes of the change set at logical `offset` of a whole file's bytes."""
    logical = to_logical(data, file)
    try:
        changes, _ = decode_change_set(logical, offset, key_group_range)
    except Exception as exc:
        if file is not None and hasattr(exc, "with_file"):
            raise exc.with_file(file) from None
        raise
    return changes


def decode_stream(logical, key_group_range=None) -> List[StateChange]:
    """Every change of a whole logical stream, change set after change set."""
    out: List[StateChange] = []
    pos, end = 0, memoryview(logical).nbytes
    while pos < end:
        changes, pos = decode_change_set(logical, pos, key_group_range)
        out.extend(changes)
    return out
