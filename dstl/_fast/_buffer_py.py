"""Pure-Python twin of `dstl._fast._buffer`: the change buffer that seals change-set bodies.

A change set body (docs/format.md §4) is written in canonical order: the metadata group (-1) first, then
one group per key group ascending, changes of a group in append order. The Cython module produces
byte-identical output; `coerce_many` (the validation of `append_many` input) is shared by both.
"""
from __future__ import annotations

import operator
import os
import struct
import threading
from array import array
from typing import List, Tuple

import numpy as np

META_KEY_GROUP = -1
MAX_KEY_GROUP = 32767
INT32_MAX = 2**31 - 1

_BE_I32 = struct.Struct(">i")
_BE_2I32 = struct.Struct(">ii")


def check_key_group(key_group) -> int:
    """`key_group` as an int in -1..32767 (TypeError for non-integers, ValueError when out of range)."""
    if type(key_group) is not int:
        if isinstance(key_group, bool) or not hasattr(key_group, "__index__"):
            raise TypeError(f"key_group must be an int, got {type(key_group).__name__}")
        key_group = key_group.__index__()
    if key_group < META_KEY_GROUP or key_group > MAX_KEY_GROUP:
        raise ValueError(f"key_group must be -1 (metadata) or 0..{MAX_KEY_GROUP}, got {key_group}")
    return key_group


def byte_view(data, what: str = "change data") -> memoryview:
    """A flat unsigned-byte view of a C-contiguous bytes-like object (TypeError otherwise)."""
    if isinstance(data, str):
        raise TypeError(f"{what} must be bytes-like, got str")
    try:
        mv = memoryview(data)
    except TypeError:
        raise TypeError(f"{what} must be bytes-like, got {type(data).__name__}") from None
    if not mv.c_contiguous:
        raise TypeError(f"{what} must be a contiguous buffer")
    if mv.format == "B" and mv.ndim == 1:
        return mv
    return mv.cast("B") if mv.ndim <= 1 else mv.cast("B", (mv.nbytes,))


def writable_view(out) -> memoryview:
    """A flat writable byte view of `out` (TypeError when it is not a writable contiguous buffer)."""
    try:
        mv = memoryview(out)
    except TypeError:
        raise TypeError(f"out must be a writable buffer, got {type(out).__name__}") from None
    if mv.readonly:
        raise TypeError("out must be a writable buffer, got a read-only one")
    if not mv.c_contiguous:
        raise TypeError("out must be a contiguous buffer")
    return mv.cast("B") if mv.ndim <= 1 else mv.cast("B", (mv.nbytes,))


def _int_array(values, what: str) -> np.ndarray:
    arr = values
    if hasattr(values, "null_count") and hasattr(values, "to_numpy"):  # pyarrow (Chunked)Array
        if values.null_count:
            raise ValueError(f"{what} must not contain nulls ({values.null_count} found)")
        arr = values.to_numpy()
    arr = np.asarray(arr)
    if arr.ndim != 1:
        raise ValueError(f"{what} must be one-dimensional, got shape {arr.shape}")
    if arr.dtype.kind not in "iu" or arr.dtype == np.bool_:
        if arr.size == 0 and arr.dtype.kind == "f":  # np.asarray([]) is float64
            return arr.astype(np.int64)
        raise TypeError(f"{what} must be an integer array, got dtype {arr.dtype}")
    return arr


def _offsets_array(offsets, n: int) -> np.ndarray:
    """Offsets as int64; a raw buffer (e.g. `pa.array(...).buffers()[1]`) is read as int32 or int64
    by its byte length (4·(n+1) or 8·(n+1)), in native byte order as Arrow stores it."""
    if not isinstance(offsets, np.ndarray) and not hasattr(offsets, "to_numpy") and not isinstance(
            offsets, (list, tuple, range)):
        try:
            mv = memoryview(offsets)
        except TypeError:
            mv = None
        if mv is not None and mv.format in ("B", "b", "c"):
            raw = byte_view(mv, "offsets")
            if raw.nbytes == 4 * (n + 1):
                return np.frombuffer(raw, dtype=np.int32).astype(np.int64)
            if raw.nbytes == 8 * (n + 1):
                return np.frombuffer(raw, dtype=np.int64)
            raise ValueError(f"offsets buffer of {raw.nbytes} bytes fits neither int32 nor int64 offsets "
                             f"for {n} rows ({4 * (n + 1)} or {8 * (n + 1)} bytes expected)")
    arr = _int_array(offsets, "offsets")
    if arr.dtype == np.uint64 and arr.size and int(arr.max()) > 2**63 - 1:
        raise ValueError("offsets exceed the int64 range")
    return arr.astype(np.int64, copy=False)


def coerce_many(key_groups, data, offsets) -> Tuple[np.ndarray, memoryview, np.ndarray]:
    """Validate `append_many` input (Arrow binary layout) and return (int32 kgs, byte view, int64 offsets).

    Nothing is added by the caller unless every row is valid; the ValueError names the first bad row.
    """
    kgs = _int_array(key_groups, "key_groups")
    n = kgs.shape[0]
    view = byte_view(data, "data")
    offs = _offsets_array(offsets, n)
    if n == 0 and offs.shape[0] == 0:
        offs = np.zeros(1, dtype=np.int64)
    if offs.shape[0] != n + 1:
        raise ValueError(f"offsets must have len(key_groups) + 1 = {n + 1} entries, got {offs.shape[0]}")
    if n == 0:
        if not 0 <= int(offs[0]) <= view.nbytes:
            raise ValueError(f"offsets[0] = {int(offs[0])} is outside data (0..{view.nbytes})")
        return np.zeros(0, dtype=np.int32), view, offs
    lengths = np.diff(offs)
    ok = (int(kgs.min()) >= META_KEY_GROUP and int(kgs.max()) <= MAX_KEY_GROUP
          and int(offs[0]) >= 0 and int(offs[-1]) <= view.nbytes
          and int(lengths.min()) >= 0 and int(lengths.max()) <= INT32_MAX)
    if not ok:
        _raise_first_bad_row(kgs, offs, lengths, view.nbytes)
    return kgs.astype(np.int32, copy=False), view, offs


def _raise_first_bad_row(kgs: np.ndarray, offs: np.ndarray, lengths: np.ndarray, nbytes: int) -> None:
    wide = kgs.astype(np.int64) if kgs.dtype != np.uint64 else np.minimum(kgs, 2**62).astype(np.int64)
    bad = ((wide < META_KEY_GROUP) | (wide > MAX_KEY_GROUP) | (lengths < 0) | (lengths > INT32_MAX)
           | (offs[:-1] < 0) | (offs[:-1] > nbytes) | (offs[1:] < 0) | (offs[1:] > nbytes))
    i = int(np.flatnonzero(bad)[0])
    kg, start, end = int(kgs[i]), int(offs[i]), int(offs[i + 1])
    if kg < META_KEY_GROUP or kg > MAX_KEY_GROUP:
        why = f"key group {kg} is not -1 (metadata) or 0..{MAX_KEY_GROUP}"
    elif start < 0 or start > nbytes or end < 0 or end > nbytes:
        why = f"offsets {start}..{end} are outside data (0..{nbytes})"
    elif end < start:
        why = f"offsets decrease ({start} then {end})"
    else:
        why = f"length {end - start} exceeds the int32 maximum"
    raise ValueError(f"append_many: row {i}: {why}; nothing was added")


CHUNK = 1 << 20  # bytes per piece of SealedBody.write_to


def spare_bytes() -> int:
    """Idle memory kept for the next change sets: none here (the Cython module keeps sealed bodies'
    arrays and arenas for reuse; Python's allocator does that for the twin)."""
    return 0


def release_spares() -> None:
    """Free the idle memory kept for the next change sets: nothing to free in the twin."""


class SealedBody(bytes):
    """Twin of the Cython `SealedBody`: a sealed body with `write_to(write, chunk_size)` (pieces in
    order, each at most `chunk_size` bytes) and `tobytes()`; here it is the body bytes themselves."""

    __slots__ = ()

    def write_to(self, write, chunk_size: int = CHUNK) -> int:
        """Call `write(view)` with consecutive pieces of the body; returns the bytes written."""
        if chunk_size <= 0:
            raise ValueError(f"chunk_size must be positive, got {chunk_size}")
        view = memoryview(self)
        for pos in range(0, len(self), chunk_size):
            write(view[pos:pos + chunk_size])
        return len(self)

    def write_into(self, out, pos: int = 0) -> int:
        """Write the whole body into the writable buffer `out` at `pos`; returns its length."""
        mv = writable_view(out)
        pos = pos.__index__()
        if pos < 0 or pos + len(self) > mv.nbytes:
            raise ValueError(f"write_into: {len(self)} bytes do not fit at position {pos} of a "
                             f"{mv.nbytes}-byte buffer")
        mv[pos:pos + len(self)] = self
        return len(self)

    def tobytes(self) -> bytes:
        return bytes(self)

    def __repr__(self) -> str:
        return f"SealedBody(encoded={len(self)})"


MAX_FDS = 4


def write_bodies(fds, bodies) -> int:
    """Write `bodies` (sealed bodies or bytes-like objects) back to back to each file descriptor in
    `fds`, at its position; returns the bytes written to each fd (twin of the Cython routine, which
    does it with the GIL released once)."""
    targets = []
    for fd in fds:
        if len(targets) == MAX_FDS:
            raise ValueError(f"write_bodies: at most {MAX_FDS} file descriptors")
        try:
            fd = operator.index(fd)
        except TypeError:
            raise TypeError(f"write_bodies: file descriptors must be ints, got {type(fd).__name__}") from None
        if fd < 0:
            raise ValueError(f"write_bodies: invalid file descriptor {fd}")
        targets.append(fd)
    views = []
    for i, b in enumerate(bodies):
        try:
            view = memoryview(b)
        except TypeError:
            raise TypeError(f"write_bodies: body {i} is not a sealed body or a contiguous bytes-like "
                            f"object, got {type(b).__name__}") from None
        if not view.c_contiguous:
            raise TypeError(f"write_bodies: body {i} is not a sealed body or a contiguous bytes-like "
                            f"object, got {type(b).__name__}")
        views.append(view.cast("B") if view.format != "B" or view.ndim != 1 else view)
    if not targets:
        return 0
    pos = 0
    for view in views:
        for fd in targets:
            rest = view
            while rest:
                try:
                    rest = rest[os.write(fd, rest):]
                except InterruptedError:
                    continue
                except OSError as exc:
                    raise OSError(exc.errno, f"write_bodies: write failed at byte {pos} of the bodies: "
                                             f"{os.strerror(exc.errno)}") from None
        pos += view.nbytes
    return pos


def write_bodies_at(paths, offset, bodies, create=False, size=-1) -> int:
    """Open each of `paths` (existing files: write-only, never created or truncated; or, with
    `create`, made exclusively and removed again if a write fails), write `bodies` from byte `offset`
    as `write_bodies` does and close it; OSError naming a path that cannot be opened or made (twin
    of the Cython routine, which does all of it in one GIL release and also reserves `size` bytes
    first: the files end the same)."""
    paths = list(paths)
    if len(paths) > MAX_FDS:
        raise ValueError(f"write_bodies_at: at most {MAX_FDS} paths")
    if operator.index(offset) < 0:
        raise ValueError(f"write_bodies_at: negative offset {offset}")
    operator.index(size)  # checked as the compiled routine checks it
    if not paths or (not bodies and not create):
        return 0
    fds = []
    ok = False
    try:
        for p in paths:
            try:
                if create:
                    fd = os.open(p, os.O_WRONLY | os.O_CREAT | os.O_EXCL | getattr(os, "O_CLOEXEC", 0), 0o666)
                else:
                    fd = os.open(p, os.O_WRONLY | getattr(os, "O_CLOEXEC", 0))
            except OSError as exc:
                raise OSError(exc.errno, f"write_bodies_at: cannot {'make' if create else 'open'} "
                                         f"{os.fsdecode(p)} at byte {offset}: {os.strerror(exc.errno)}",
                              os.fsdecode(p)) from None
            fds.append(fd)  # no reservation here: it only saves the compiled routine block work
            os.lseek(fd, offset, os.SEEK_SET)
        n = write_bodies(fds, bodies)
        ok = True
        return n
    finally:
        for fd, p in zip(fds, paths):
            os.close(fd)
            if create and not ok:
                os.unlink(p)


class ChangeBuffer:
    """Accumulates changes and seals them into one canonical change-set body (docs/format.md §4)."""

    __slots__ = ("_arena", "_kgs", "_offs", "_lens", "_counts", "_size")

    def __init__(self) -> None:
        self._arena = bytearray()
        self._kgs = array("i")
        self._offs = array("q")
        self._lens = array("q")
        self._counts: dict = {}
        self._size = 0

    def append(self, key_group: int, data) -> None:
        """Add one change; `key_group` -1 is metadata."""
        kg = check_key_group(key_group)
        view = byte_view(data)
        n = view.nbytes
        if n > INT32_MAX:
            raise ValueError(f"change data of {n} bytes exceeds the int32 length field")
        self._offs.append(len(self._arena))
        self._lens.append(n)
        self._kgs.append(kg)
        self._arena += view
        self._counts[kg] = self._counts.get(kg, 0) + 1
        self._size += n

    def append_many(self, key_groups, data, offsets) -> None:
        """Add n changes given in Arrow's binary layout; all-or-nothing."""
        kgs, view, offs = coerce_many(key_groups, data, offsets)
        n = kgs.shape[0]
        if n == 0:
            return
        first, last = int(offs[0]), int(offs[-1])
        base = len(self._arena)
        self._arena += view[first:last]
        self._kgs.frombytes(kgs.tobytes())
        self._offs.frombytes((offs[:-1] + (base - first)).tobytes())
        self._lens.frombytes(np.diff(offs).tobytes())
        for kg, count in zip(*np.unique(kgs, return_counts=True)):
            self._counts[int(kg)] = self._counts.get(int(kg), 0) + int(count)
        self._size += last - first

    def __len__(self) -> int:
        return len(self._kgs)

    @property
    def size(self) -> int:
        """Payload bytes held (docs/format.md §2 size)."""
        return self._size

    @property
    def encoded_size(self) -> int:
        """Length of the body `seal()` would return: 4 + 8·G + 4·C + size."""
        return 4 + 8 * len(self._counts) + 4 * len(self._kgs) + self._size

    def key_groups(self) -> List[int]:
        """Distinct key groups held, in canonical (group) order."""
        return sorted(self._counts)

    def _encode_into(self, out, pos: int) -> int:
        kgs = np.frombuffer(self._kgs, dtype=np.intc) if len(self._kgs) else np.zeros(0, np.intc)
        order = np.argsort(kgs, kind="stable").tolist()  # a stable sort keeps append order in a group
        arena, offs, lens, counts, kg_list = self._arena, self._offs, self._lens, self._counts, self._kgs
        _BE_I32.pack_into(out, pos, len(counts))
        p = pos + 4
        prev = None
        for i in order:
            kg = kg_list[i]
            if kg != prev:
                _BE_2I32.pack_into(out, p, counts[kg], kg)
                p += 8
                prev = kg
            n = lens[i]
            _BE_I32.pack_into(out, p, n)
            p += 4
            start = offs[i]
            out[p:p + n] = arena[start:start + n]
            p += n
        return p - pos

    def seal(self) -> bytes:
        """The canonical change-set body; the buffer is empty afterwards."""
        out = bytearray(self.encoded_size)
        self._encode_into(out, 0)
        self.clear()
        return bytes(out)

    def seal_body(self) -> "SealedBody":
        """The canonical body as a `SealedBody` (here simply the sealed bytes); the buffer is empty afterwards."""
        return SealedBody(self.seal())

    def seal_into(self, out, pos: int = 0) -> int:
        """Write the body into the writable buffer `out` at `pos`; returns its length and empties the buffer."""
        mv = writable_view(out)
        pos = pos.__index__()
        need = self.encoded_size
        if pos < 0 or pos + need > mv.nbytes:
            raise ValueError(f"seal_into: {need} bytes do not fit at position {pos} of a {mv.nbytes}-byte buffer")
        length = self._encode_into(mv, pos)
        self.clear()
        return length

    def clear(self) -> None:
        """Drop every change held."""
        self._arena = bytearray()
        self._kgs = array("i")
        self._offs = array("q")
        self._lens = array("q")
        self._counts = {}
        self._size = 0

    def __repr__(self) -> str:
        return f"ChangeBuffer(changes={len(self)}, size={self._size}, python)"


# -- the writer's append path ----------------------------------------------------------------------

def writer_key_group(key_group) -> int:
    """A writer's key group as an int (TypeError for non-integers; the range is checked by the caller)."""
    if isinstance(key_group, bool) or not hasattr(key_group, "__index__"):
        raise TypeError(f"key_group must be an int, got {type(key_group).__name__}")
    return key_group.__index__()


def concurrent_append_error(writer, inside: int, caller: int) -> RuntimeError:
    """The error of an append while another thread is inside an append of the same writer."""
    return RuntimeError(
        f"changelog writer {writer.log_id}: append from thread {caller} while thread {inside} is inside an "
        f"append (a pre-emptive persist) of the same writer; a writer is not thread-safe, use it from one thread")


class WriterCore:
    """Twin of the Cython `WriterCore`: the append path of `FsStateChangelogWriter` (its base class).

    Same checks and errors as the Cython class. This one takes the writer's `_lock` per append, which
    makes each append atomic as the GIL makes the Cython one.
    """

    def __new__(cls, *args, **kwargs):
        self = super().__new__(cls)
        self._buffer = ChangeBuffer()
        self._closed = False
        self._kg_start = 0
        self._kg_end = -1
        self._threshold = 0
        self._flusher = 0
        return self

    def _enter(self) -> None:
        if self._flusher and self._flusher != threading.get_ident():
            raise concurrent_append_error(self, self._flusher, threading.get_ident())
        if self._closed:
            from dstl.errors import WriterClosedError

            raise WriterClosedError(f"changelog writer {self.log_id} is closed")

    def _after(self) -> None:
        if self._buffer.size < self._threshold:
            return
        prev, self._flusher = self._flusher, threading.get_ident()
        try:
            self._preemptive()
        finally:
            self._flusher = prev

    def append(self, key_group, data) -> None:
        """Add one data change; may upload pre-emptively (and then block on back-pressure)."""
        with self._lock:
            self._enter()
            if type(key_group) is not int:
                key_group = writer_key_group(key_group)
            if key_group < self._kg_start or key_group > self._kg_end:
                raise ValueError(f"key group {key_group!r} is outside the writer's range {self.key_group_range}")
            self._buffer.append(key_group, data)
        self._after()

    def append_meta(self, data) -> None:
        """Add one metadata change (key group -1; read back by every subtask on restore)."""
        with self._lock:
            self._enter()
            self._buffer.append(META_KEY_GROUP, data)
        self._after()

    def _take_active(self):
        """Seal the active change set: `(body, payload size, number of changes)`, or None when empty."""
        buf = self._buffer
        n = len(buf)
        if n == 0:
            return None
        size = buf.size
        return buf.seal_body(), size, n
