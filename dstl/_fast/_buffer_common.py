"""Argument checks and error messages shared by the buffer modules and their twins.

The change buffer (`_buffer`), the sealed body (`_sealed`) and the writer core (`_writer`), compiled
or twin, check their input with these functions, so both implementations accept the same input and
raise the same errors (the compiled ones call them only on the uncommon paths, to raise). As fastavro
shares `_read_common.py` between `_read.pyx` and `_read_py.py`.
"""
from __future__ import annotations

from typing import Tuple

import numpy as np

META_KEY_GROUP = -1
MAX_KEY_GROUP = 32767
INT32_MAX = 2**31 - 1


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
