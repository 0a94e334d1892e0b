"""Vectorised msgpack for whole columns: many change payloads without a Python loop per row.

`pack_column(values)` turns a column (numpy array, pandas Series, pyarrow array, list) into the msgpack
encoding of each of its elements, byte-identical to `msgpack.packb(element, use_bin_type=True)` for
ints, floats, bools, str and bytes. Object columns of anything else fall back to one `packb` per row.
`concat_rows(parts, n)` glues per-row pieces (constant bytes and packed columns) into the Arrow binary
layout the writer's `append_many` takes: one data buffer plus n+1 offsets.

Two internal shapes: `_Matrix` (every row fits a small fixed width: ints, floats, length headers) and
`_Binary` (variable length: the bytes of strings, fallback rows). Adjacent matrices are merged and
cut out with one boolean mask, which keeps row order because numpy masks row-major.
"""
from __future__ import annotations

from operator import itemgetter
from typing import Any, Callable, List, Optional, Sequence, Tuple

import numpy as np

from dstl._fast._statecols_py import (_U8, Packed, _arrow_layout, _Binary, _pack_arrow_strings, _pack_bools,
                                     _pack_floats, _pack_ints, concat_rows)
from dstl._impl import IMPLEMENTATION, kernel
from dstl.state.serializers import packb

_kernel = kernel("_statecols")
KERNEL = IMPLEMENTATION

__all__ = ["Column", "as_column", "pack_column", "concat_rows", "pack_bin_rows", "encode_rows",
           "dict_update_rows", "KERNEL"]

def _packed_rows(objs: list, convert: Optional[Callable[[Any], Any]]) -> List[bytes]:
    """packb of every element (after `convert`); an error names the first row that fails."""
    try:
        if convert is None:
            return [packb(x) for x in objs]
        return [packb(convert(x)) for x in objs]
    except Exception:
        for i, x in enumerate(objs):
            try:
                packb(x if convert is None else convert(x))
            except Exception as exc:
                raise type(exc)(f"row {i}: cannot serialize {x!r:.80}: {exc}") from exc
        raise


def pack_bin_rows(rows: Sequence[bytes]) -> _Binary:
    """Already encoded rows (bytes) as one binary column."""
    lens = np.fromiter((len(r) for r in rows), dtype=np.int64, count=len(rows))
    offsets = np.zeros(len(rows) + 1, dtype=np.int64)
    np.cumsum(lens, out=offsets[1:])
    data = np.frombuffer(b"".join(rows), dtype=_U8)
    return _Binary(data, offsets)


class Column:
    """One input column, normalised: knows its length, its Python values and its msgpack encoding."""

    __slots__ = ("n", "kind", "np", "arrow", "objects", "_source")

    def __init__(self, n: int, kind: str, np_values=None, arrow=None, objects=None, source=None):
        self.n = n
        self.kind = kind        # "int", "float", "bool", "str", "bin" or "object"
        self.np = np_values
        self.arrow = arrow
        self.objects = objects
        self._source = source   # what assign_key_groups gets

    @property
    def for_hash(self):
        return self._source

    def tolist(self) -> list:
        if self.objects is None:
            if self.np is not None:
                self.objects = self.np.tolist()
            else:
                self.objects = self.arrow.to_pylist()
        return self.objects

    def take(self, index: np.ndarray) -> list:
        """Python values at `index` (for the in-memory table)."""
        if self.np is not None:
            return self.np[index].tolist()
        vals = self.tolist()
        idx = index.tolist()
        if len(idx) < 2:
            return [vals[i] for i in idx]
        return list(itemgetter(*idx)(vals))  # one C-level loop

    def specs(self, convert: Optional[Callable[[Any], Any]] = None) -> List[tuple]:
        """The column as `encode_rows` specs (see dstl/_fast/_statecols.pyx)."""
        if convert is None:
            if self.kind == "int":
                if self.np.dtype.kind == "u":
                    return [("u", np.ascontiguousarray(self.np, dtype=np.uint64))]
                return [("i", np.ascontiguousarray(self.np, dtype=np.int64))]
            if self.kind == "float":
                return [("f", np.ascontiguousarray(self.np, dtype=np.float64))]
            if self.kind == "bool":
                return [("b", np.ascontiguousarray(self.np, dtype=_U8))]
            if self.kind in ("str", "bin"):
                data, offsets = _arrow_layout(self.arrow)
                return [("s" if self.kind == "str" else "y", data, np.ascontiguousarray(offsets))]
            rows = pack_bin_rows(_packed_rows(self.tolist(), None))
        else:
            rows = pack_bin_rows(_packed_rows(self.tolist(), convert))
        return [("r", rows.data, rows.offsets)]

    def pack(self, convert: Optional[Callable[[Any], Any]] = None) -> List[Packed]:
        """msgpack pieces of every row. `convert` (e.g. a non-native serializer's dumps, whose
        bytes are then packed as `bin`) forces the per-row path."""
        if convert is None:
            if self.kind == "int":
                return [_pack_ints(self.np)]
            if self.kind == "float":
                return [_pack_floats(self.np)]
            if self.kind == "bool":
                return [_pack_bools(self.np)]
            if self.kind in ("str", "bin"):
                return _pack_arrow_strings(self.arrow, self.kind == "str")
            return [pack_bin_rows([packb(x) for x in self.tolist()])]
        return [pack_bin_rows([packb(convert(x)) for x in self.tolist()])]


def _arrow_column(arr, source) -> Optional[Column]:
    import pyarrow as pa

    if isinstance(arr, pa.ChunkedArray):
        arr = arr.combine_chunks() if arr.num_chunks != 1 else arr.chunk(0)
    t = arr.type
    if arr.null_count:
        return None
    if pa.types.is_string_view(t):
        arr, t = arr.cast(pa.large_string()), pa.large_string()
    if pa.types.is_binary_view(t):
        arr, t = arr.cast(pa.large_binary()), pa.large_binary()
    if pa.types.is_dictionary(t):
        arr = arr.dictionary_decode()
        t = arr.type
    if pa.types.is_string(t) or pa.types.is_large_string(t):
        return Column(len(arr), "str", arrow=arr, source=source)
    if pa.types.is_binary(t) or pa.types.is_large_binary(t):
        return Column(len(arr), "bin", arrow=arr, source=source)
    if pa.types.is_integer(t) or pa.types.is_floating(t) or pa.types.is_boolean(t):
        return _numpy_column(arr.to_numpy(zero_copy_only=False), source)
    return None


def _numpy_column(v: np.ndarray, source) -> Optional[Column]:
    if v.ndim != 1:
        raise ValueError(f"a column must be 1-d, got shape {v.shape}")
    k = v.dtype.kind
    if k in "iu":
        return Column(len(v), "int", np_values=v, source=source)
    if k == "f":
        return Column(len(v), "float", np_values=v, source=source)
    if k == "b":
        return Column(len(v), "bool", np_values=v, source=source)
    return None


def as_column(values) -> Column:
    """Normalise a column-like input. Unknown element types stay Python objects (packed per row)."""
    if isinstance(values, Column):
        return values
    module = type(values).__module__ or ""
    if isinstance(values, np.ndarray):
        col = _numpy_column(values, values)
        if col is not None:
            return col
        if values.dtype.kind in "US":
            import pyarrow as pa

            return _arrow_column(pa.array(values.tolist()), values) or Column(
                len(values), "object", objects=values.tolist(), source=values)
        return _objects(values.tolist(), values)
    if module.startswith("pyarrow"):
        col = _arrow_column(values, values)
        return col if col is not None else _objects(values.to_pylist(), values)
    if module.startswith("pandas"):
        import pandas as pd

        if isinstance(values, pd.DataFrame):
            raise TypeError("expected one column (a Series), got a DataFrame")
        dtype = values.dtype
        if isinstance(dtype, np.dtype) and dtype.kind in "iufb":
            return _numpy_column(values.to_numpy(), values)
        if isinstance(dtype, np.dtype) and dtype.kind == "O":
            return _objects(values.tolist(), values)
        if not values.isna().any():
            try:
                import pyarrow as pa

                col = _arrow_column(pa.array(values.array), values)
                if col is not None:
                    return col
            except Exception:  # pragma: no cover - unusual extension arrays
                pass
        return _objects([None if x is pd.NA else x for x in values.tolist()], values)
    if isinstance(values, (str, bytes, bytearray)) or not hasattr(values, "__len__"):
        raise TypeError(f"expected a column (array, Series, list), got {type(values).__name__}")
    return _objects(list(values), values)


def _objects(objs: list, source) -> Column:
    """A Python list: typed fast paths when every element has the same plain type."""
    if objs:
        types = set(map(type, objs))
        t0 = type(objs[0]) if len(types) == 1 else None
        if t0 in (str, bytes):
            import pyarrow as pa

            arr = pa.array(objs, type=pa.large_string() if t0 is str else pa.large_binary())
            return Column(len(objs), "str" if t0 is str else "bin", arrow=arr, objects=objs, source=source)
        if t0 is int:
            try:
                arr = np.array(objs, dtype=np.int64)
            except OverflowError:
                arr = None
            if arr is not None:
                return Column(len(objs), "int", np_values=arr, objects=objs, source=source)
        if t0 is float:
            return Column(len(objs), "float", np_values=np.array(objs, dtype=np.float64), objects=objs,
                          source=source)
    return Column(len(objs), "object", objects=objs, source=source)


def pack_column(values) -> Tuple[np.ndarray, np.ndarray]:
    """msgpack of every element of a column: `(data, offsets)` in the Arrow binary layout."""
    col = as_column(values)
    return concat_rows(col.pack(), col.n)


def encode_rows(prefix: bytes, specs: Sequence[tuple], n: int) -> Tuple[np.ndarray, np.ndarray]:
    """n payloads `prefix + msgpack(spec_1[i]) + ...` as (data, int64 offsets[n+1])."""
    return _kernel.encode_rows(bytes(prefix), list(specs), n)


def dict_update_rows(tables: list, kg_start: int, kgs: np.ndarray, keys: Any, values: Any) -> None:
    """`tables[kgs[i] - kg_start][keys[i]] = values[i]` for every row, later rows winning."""
    return _kernel.dict_update_rows(tables, kg_start, np.ascontiguousarray(kgs, dtype=np.int32), keys, values)
