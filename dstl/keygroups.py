"""Key groups: which key belongs where, exactly as Flink's `KeyGroupRangeAssignment` (docs/rescaling.md §1-§3).

Scalar functions take one int/str/bytes key; `assign_key_groups` takes a whole column (numpy integer
array, pandas Series, pyarrow (Chunked)Array of integers, strings or binaries, or a list of keys) and
hashes it without a Python loop per row when the Cython extension is built. The hashing kernels come
from `dstl._fast._hash` or its pure-Python twin `dstl._fast._hash_py`, chosen by `dstl._impl.IMPLEMENTATION`.
"""
from __future__ import annotations

import re
from typing import Any, List

import numpy as np

from dstl._impl import kernel
from dstl.types import KeyGroupRange

_kernels = kernel("_hash")

__all__ = [
    "DEFAULT_LOWER_BOUND_MAX_PARALLELISM", "UPPER_BOUND_MAX_PARALLELISM",
    "java_hash_code", "murmur_hash", "assign_to_key_group", "assign_key_groups",
    "compute_key_group_range_for_operator_index", "compute_operator_index_for_key_group",
    "operator_indices_for_key_groups", "assign_key_to_parallel_operator",
    "compute_default_max_parallelism", "key_group_ranges",
]

DEFAULT_LOWER_BOUND_MAX_PARALLELISM = 1 << 7
UPPER_BOUND_MAX_PARALLELISM = 1 << 15
_INT64_MAX = (1 << 63) - 1

java_hash_code = _kernels.java_hash_code
murmur_hash = _kernels.murmur_hash
assign_to_key_group = _kernels.assign_to_key_group


def _int_arg(name: str, value) -> int:
    if isinstance(value, (bool, np.bool_)) or not isinstance(value, (int, np.integer)):
        raise TypeError(f"{name} must be an int, got {type(value).__name__}")
    return int(value)


def _check_parallelisms(max_parallelism, parallelism) -> tuple:
    max_parallelism = _int_arg("max_parallelism", max_parallelism)
    parallelism = _int_arg("parallelism", parallelism)
    if not 1 <= max_parallelism <= UPPER_BOUND_MAX_PARALLELISM:
        raise ValueError(f"max_parallelism must be in 1..{UPPER_BOUND_MAX_PARALLELISM}, got {max_parallelism}")
    if not 1 <= parallelism <= max_parallelism:
        raise ValueError(f"parallelism must be in 1..max_parallelism ({max_parallelism}), got {parallelism}")
    return max_parallelism, parallelism


def compute_key_group_range_for_operator_index(max_parallelism: int, parallelism: int,
                                               operator_index: int) -> KeyGroupRange:
    """The contiguous key groups owned by subtask `operator_index` of `parallelism`."""
    max_parallelism, parallelism = _check_parallelisms(max_parallelism, parallelism)
    operator_index = _int_arg("operator_index", operator_index)
    if not 0 <= operator_index < parallelism:
        raise ValueError(f"operator_index must be in 0..{parallelism - 1}, got {operator_index}")
    start = (operator_index * max_parallelism + parallelism - 1) // parallelism
    end = ((operator_index + 1) * max_parallelism - 1) // parallelism
    return KeyGroupRange(start, end)


def key_group_ranges(max_parallelism: int, parallelism: int) -> List[KeyGroupRange]:
    """The key-group range of every subtask, in subtask order."""
    return [compute_key_group_range_for_operator_index(max_parallelism, parallelism, i)
            for i in range(_check_parallelisms(max_parallelism, parallelism)[1])]


def compute_operator_index_for_key_group(max_parallelism: int, parallelism: int, key_group: int) -> int:
    """The subtask of `parallelism` that owns `key_group`."""
    max_parallelism, parallelism = _check_parallelisms(max_parallelism, parallelism)
    key_group = _int_arg("key_group", key_group)
    if not 0 <= key_group < max_parallelism:
        raise ValueError(f"key_group must be in 0..{max_parallelism - 1}, got {key_group}")
    return key_group * parallelism // max_parallelism


def operator_indices_for_key_groups(key_groups, max_parallelism: int, parallelism: int) -> np.ndarray:
    """Vectorised `compute_operator_index_for_key_group` (int32 array; ValueError names a bad row)."""
    max_parallelism, parallelism = _check_parallelisms(max_parallelism, parallelism)
    kg = np.asarray(key_groups)
    if kg.ndim != 1:
        raise ValueError(f"key_groups must be 1-d, got shape {kg.shape}")
    if kg.dtype.kind not in "iu":
        raise TypeError(f"key_groups must be an integer array, got dtype {kg.dtype}")
    return _kernels.operator_indices(kg, max_parallelism, parallelism)


def assign_key_to_parallel_operator(key: Any, max_parallelism: int, parallelism: int) -> int:
    """The subtask of `parallelism` that owns `key`."""
    max_parallelism, parallelism = _check_parallelisms(max_parallelism, parallelism)
    return compute_operator_index_for_key_group(
        max_parallelism, parallelism, assign_to_key_group(key, max_parallelism))


def compute_default_max_parallelism(parallelism: int) -> int:
    """Flink's default: min(max(next power of two of 1.5·p, 128), 32768)."""
    parallelism = _int_arg("parallelism", parallelism)
    if not 1 <= parallelism <= UPPER_BOUND_MAX_PARALLELISM:
        raise ValueError(f"parallelism must be in 1..{UPPER_BOUND_MAX_PARALLELISM}, got {parallelism}")
    x = parallelism + parallelism // 2
    power = 1 << (x - 1).bit_length()
    return min(max(power, DEFAULT_LOWER_BOUND_MAX_PARALLELISM), UPPER_BOUND_MAX_PARALLELISM)


# ------------------------------------------------------------------ columns


def assign_key_groups(keys, max_parallelism: int) -> np.ndarray:
    """Key group of every key in a column, as an int32 array; same result as `assign_to_key_group` per row.

    Accepts numpy integer/object/str arrays, pandas Series/Index (numpy or nullable integers, object,
    string, categorical, Arrow-backed), pyarrow Array/ChunkedArray (integers, string, large_string,
    binary, large_binary, their views and dictionaries) and plain lists. Nulls raise ValueError, bool
    and float columns TypeError, integers outside int64 ValueError; each error names the first bad row.
    """
    max_parallelism = _int_arg("max_parallelism", max_parallelism)
    if not 1 <= max_parallelism <= UPPER_BOUND_MAX_PARALLELISM:
        raise ValueError(f"max_parallelism must be in 1..{UPPER_BOUND_MAX_PARALLELISM}, got {max_parallelism}")
    if isinstance(keys, np.ndarray):
        return _numpy_key_groups(keys, max_parallelism)
    module = type(keys).__module__ or ""
    if module.startswith("pyarrow"):
        return _arrow_key_groups(keys, max_parallelism)
    if module.startswith("pandas"):
        return _pandas_key_groups(keys, max_parallelism)
    if isinstance(keys, (str, bytes, bytearray)) or not hasattr(keys, "__len__"):
        raise TypeError(f"keys must be a column (array, Series, list), got {type(keys).__name__}")
    return _kernels.object_key_groups(list(keys), max_parallelism)


def _int64_or_error(values: np.ndarray) -> np.ndarray:
    if values.dtype == np.uint64 and values.size:
        over = np.flatnonzero(values > np.uint64(_INT64_MAX))
        if over.size:
            i = int(over[0])
            raise ValueError(f"row {i}: int key {int(values[i])} is outside the int64 range")
    return np.ascontiguousarray(values, dtype=np.int64)


def _numpy_key_groups(values: np.ndarray, max_parallelism: int) -> np.ndarray:
    if values.ndim != 1:
        raise ValueError(f"keys must be a 1-d array, got shape {values.shape}")
    kind = values.dtype.kind
    if kind in "iu":
        return _kernels.int64_key_groups(_int64_or_error(values), max_parallelism)
    if kind in "OUS":  # fixed-width numpy strings/bytes become the Python objects numpy itself returns
        return _kernels.object_key_groups(values.tolist(), max_parallelism)
    if kind == "b":
        raise TypeError("bool keys are not supported: Java's Boolean.hashCode differs from int(bool)")
    raise TypeError(f"unsupported key dtype {values.dtype}: keys must be int, str or bytes")


def _first_null(arr) -> int:
    import pyarrow.compute as pc

    return int(np.flatnonzero(pc.is_null(arr).to_numpy(zero_copy_only=False))[0])


def _arrow_key_groups(arr, max_parallelism: int, row_base: int = 0) -> np.ndarray:
    import pyarrow as pa

    if isinstance(arr, pa.ChunkedArray):
        parts, base = [], row_base
        for chunk in arr.chunks:
            parts.append(_arrow_key_groups(chunk, max_parallelism, base))
            base += len(chunk)
        return np.concatenate(parts) if parts else np.zeros(0, dtype=np.int32)
    if not isinstance(arr, pa.Array):
        raise TypeError(f"unsupported pyarrow object {type(arr).__name__}")
    t = arr.type
    if arr.null_count:
        raise ValueError(f"row {row_base + _first_null(arr)}: key is null; keys must not be null")
    try:
        if pa.types.is_dictionary(t):
            groups = _arrow_key_groups(arr.dictionary, max_parallelism)
            return groups[arr.indices.to_numpy(zero_copy_only=False)]
        if pa.types.is_string_view(t) or pa.types.is_binary_view(t):
            arr = arr.cast(pa.large_string() if pa.types.is_string_view(t) else pa.large_binary())
            t = arr.type
        if pa.types.is_string(t) or pa.types.is_large_string(t):
            offsets, data = _arrow_layout(arr, np.int64 if pa.types.is_large_string(t) else np.int32)
            return _kernels.utf8_key_groups(offsets, data, max_parallelism)
        if pa.types.is_binary(t) or pa.types.is_large_binary(t):
            offsets, data = _arrow_layout(arr, np.int64 if pa.types.is_large_binary(t) else np.int32)
            return _kernels.binary_key_groups(offsets, data, max_parallelism)
        if pa.types.is_integer(t):
            return _kernels.int64_key_groups(_int64_or_error(arr.to_numpy(zero_copy_only=False)),
                                             max_parallelism)
    except ValueError as exc:
        if row_base:
            _renumber(exc, row_base)
        raise
    if pa.types.is_boolean(t):
        raise TypeError("bool keys are not supported: Java's Boolean.hashCode differs from int(bool)")
    raise TypeError(f"unsupported Arrow key type {t}: keys must be integers, string or binary")


def _renumber(exc: ValueError, row_base: int) -> None:
    """Rows of later chunks are counted from the start of the ChunkedArray."""
    m = re.match(r"row (\d+)(.*)", str(exc), re.S)
    if m:
        raise ValueError(f"row {row_base + int(m.group(1))}{m.group(2)}") from None


def _arrow_layout(arr, offset_dtype):
    """Offsets (n+1, absolute into data) and data buffer of a string/binary array, zero copy."""
    bufs = arr.buffers()
    offsets = np.frombuffer(bufs[1], dtype=offset_dtype)[arr.offset: arr.offset + len(arr) + 1] \
        if bufs[1] is not None else np.zeros(1, dtype=offset_dtype)
    data = bufs[2] if bufs[2] is not None else b""
    return offsets, data


def _pandas_key_groups(series, max_parallelism: int) -> np.ndarray:
    import pandas as pd

    if isinstance(series, pd.DataFrame):
        raise TypeError("keys must be one column (a Series), not a DataFrame")
    if not isinstance(series, (pd.Series, pd.Index)):
        raise TypeError(f"unsupported pandas object {type(series).__name__}")
    dtype = series.dtype
    if isinstance(dtype, pd.CategoricalDtype):
        codes = np.asarray(series.cat.codes if isinstance(series, pd.Series) else series.codes)
        missing = np.flatnonzero(codes < 0)
        if missing.size:
            raise ValueError(f"row {int(missing[0])}: key is null; keys must not be null")
        groups = assign_key_groups(series.cat.categories if isinstance(series, pd.Series)
                                   else series.categories, max_parallelism)
        return groups[codes]
    if isinstance(dtype, np.dtype):
        return _numpy_key_groups(series.to_numpy(), max_parallelism)
    # extension dtypes: nullable ints, string (python or pyarrow storage), ArrowDtype
    isna = np.asarray(series.isna())
    if isna.any():
        raise ValueError(f"row {int(np.flatnonzero(isna)[0])}: key is null; keys must not be null")
    if hasattr(series.array, "__arrow_array__") and getattr(dtype, "storage", "pyarrow") != "python":
        import pyarrow as pa

        return _arrow_key_groups(pa.array(series.array), max_parallelism)
    kind = getattr(dtype, "kind", "O")
    if kind in "iu":
        return _numpy_key_groups(series.to_numpy(dtype=dtype.numpy_dtype), max_parallelism)
    if kind == "b":
        raise TypeError("bool keys are not supported: Java's Boolean.hashCode differs from int(bool)")
    if kind == "f":
        raise TypeError(f"unsupported key dtype {dtype}: keys must be int, str or bytes")
    return _kernels.object_key_groups(series.to_numpy(dtype=object).tolist(), max_parallelism)
