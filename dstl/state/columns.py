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
from typing import Any, Callable, List, Optional, Sequence, Tuple, Union

import numpy as np

from dstl._impl import IMPLEMENTATION
from dstl.state.serializers import packb

if IMPLEMENTATION == "cython":
    try:
        from dstl._fast import _statecols as _kernel
    except ImportError:  # an older build without this module: the numpy twin below
        _kernel = None
else:
    _kernel = None
KERNEL = "cython" if _kernel is not None else "python"

__all__ = ["Column", "as_column", "pack_column", "concat_rows", "pack_bin_rows", "encode_rows",
           "encode_rows_py", "dict_update_rows", "dict_update_rows_py", "KERNEL"]

_U8 = np.uint8
_SHORT = 48  # str/bin values up to this many bytes are packed as a matrix


class _Matrix:
    __slots__ = ("mat", "lens")

    def __init__(self, mat: np.ndarray, lens: np.ndarray):
        self.mat = mat
        self.lens = lens


class _Binary:
    __slots__ = ("data", "offsets")

    def __init__(self, data: np.ndarray, offsets: np.ndarray):
        self.data = data
        self.offsets = offsets


Packed = Union[_Matrix, _Binary]


def _be_bytes(values: np.ndarray, dtype: str) -> np.ndarray:
    """Big-endian bytes of each value, one row of 8 per value."""
    return np.ascontiguousarray(values.astype(dtype)).view(_U8).reshape(len(values), 8)


# categories of msgpack-python's canonical int encoding, by lower bound (searchsorted on the value)
_INT_BOUNDS = np.array([-(1 << 31), -32768, -128, -32, 0, 128, 256, 65536, 1 << 32], dtype=np.int64)
#                          <-2^31 >=-2^31 >=-32768 >=-128 >=-32 >=0 >=128 >=256 >=65536 >=2^32
_INT_HEADER = np.array([0xD3, 0xD2, 0xD1, 0xD0, 0, 0, 0xCC, 0xCD, 0xCE, 0xCF], dtype=_U8)
_INT_WIDTH = np.array([8, 4, 2, 1, 0, 0, 1, 2, 4, 8], dtype=np.int64)


def _pack_ints(v: np.ndarray) -> _Matrix:
    """msgpack-python's canonical int encoding: smallest uint* for >= 0, smallest int* for < 0."""
    n = len(v)
    if v.dtype.kind == "u":
        u = v.astype(np.uint64)
        big = u > np.uint64((1 << 63) - 1)
        cat = np.searchsorted(_INT_BOUNDS, np.minimum(u, np.uint64((1 << 63) - 1)).astype(np.int64),
                              side="right")
        cat[big] = 9
    else:
        u = v.astype(np.int64, copy=False).view(np.uint64)
        cat = np.searchsorted(_INT_BOUNDS, v.astype(np.int64, copy=False), side="right")
    width = _INT_WIDTH[cat]
    header = _INT_HEADER[cat]
    fix = (cat == 4) | (cat == 5)  # fixints: the header byte is the value itself
    header[fix] = (u[fix] & np.uint64(0xFF)).astype(_U8)
    # body: the low `width` bytes of the value, big-endian and left-aligned (the rest is masked off)
    body = u << ((8 - width) * 8).astype(np.uint64)
    mat = np.empty((n, 9), dtype=_U8)
    mat[:, 0] = header
    mat[:, 1:] = _be_bytes(body, ">u8")
    return _Matrix(mat, width + 1)


def _pack_floats(v: np.ndarray) -> _Matrix:
    n = len(v)
    mat = np.empty((n, 9), dtype=_U8)
    mat[:, 0] = 0xCB  # msgpack-python packs Python floats as float64
    mat[:, 1:] = _be_bytes(v.astype(np.float64), ">f8")
    return _Matrix(mat, np.full(n, 9, dtype=np.int64))


def _pack_bools(v: np.ndarray) -> _Matrix:
    mat = (0xC2 + v.astype(_U8)).reshape(len(v), 1)
    return _Matrix(mat, np.ones(len(v), dtype=np.int64))


def _length_headers(lens: np.ndarray, small_code: Optional[int], codes: Tuple[int, int, int]) -> _Matrix:
    """str/bin length headers: fixstr (str only), then 8/16/32-bit big-endian lengths."""
    n = len(lens)
    mat = np.zeros((n, 5), dtype=_U8)
    hl = np.empty(n, dtype=np.int64)
    be = _be_bytes(lens.astype(np.int64), ">i8")
    rest = np.ones(n, dtype=bool)
    if small_code is not None:
        m = lens < 32
        mat[m, 0] = small_code | lens[m].astype(_U8)
        hl[m] = 1
        rest &= ~m
    for limit, code, w in ((256, codes[0], 1), (65536, codes[1], 2), (1 << 32, codes[2], 4)):
        m = rest & (lens < limit)
        mat[m, 0] = code
        mat[m, 1:1 + w] = be[m, 8 - w:]
        hl[m] = 1 + w
        rest &= ~m
    if rest.any():
        raise ValueError("a str/bytes value longer than 4 GiB cannot be msgpack-encoded")
    return _Matrix(mat, hl)


def _arrow_layout(arr) -> Tuple[np.ndarray, np.ndarray]:
    import pyarrow as pa

    large = pa.types.is_large_string(arr.type) or pa.types.is_large_binary(arr.type)
    bufs = arr.buffers()
    n = len(arr)
    if bufs[1] is None:
        offsets = np.zeros(n + 1, dtype=np.int64)
    else:
        offsets = np.frombuffer(bufs[1], dtype=np.int64 if large else np.int32)[arr.offset: arr.offset + n + 1]
    data = np.frombuffer(bufs[2], dtype=_U8) if bufs[2] is not None and len(bufs[2]) else np.zeros(0, _U8)
    return data, offsets.astype(np.int64)


def _pack_arrow_strings(arr, is_str: bool) -> List[Packed]:
    data, offsets = _arrow_layout(arr)
    return _pack_layout(data, offsets, is_str)


def _pack_layout(data: np.ndarray, offsets: np.ndarray, is_str: bool) -> List[Packed]:
    lens = np.diff(offsets)
    if is_str:
        header = _length_headers(lens, 0xA0, (0xD9, 0xDA, 0xDB))
    else:
        header = _length_headers(lens, None, (0xC4, 0xC5, 0xC6))
    if len(lens) and int(lens.max()) <= _SHORT:
        # short values: a fixed-width matrix, so the whole row is cut out with one mask later
        w = max(int(lens.max()), 1)
        if len(data) == 0:
            return [header, _Matrix(np.zeros((len(lens), w), dtype=_U8), lens)]
        idx = np.minimum(offsets[:-1, None] + np.arange(w), len(data) - 1)
        return [header, _Matrix(data[idx], lens)]
    return [header, _Binary(data, offsets)]


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


_MASK_TABLES: dict = {}


def _mask_table(width: int) -> np.ndarray:
    """Row L of the table = the first L of `width` bytes are valid."""
    t = _MASK_TABLES.get(width)
    if t is None:
        t = _MASK_TABLES[width] = np.arange(width) < np.arange(width + 1)[:, None]
    return t


def _to_binary(parts: List[Union[bytes, _Matrix]], n: int) -> _Binary:
    widths = [len(p) if isinstance(p, (bytes, bytearray)) else p.mat.shape[1] for p in parts]
    total_w = sum(widths)
    mat = np.empty((n, total_w), dtype=_U8)
    mask = np.empty((n, total_w), dtype=bool)
    total = np.zeros(n, dtype=np.int64)
    col = 0
    for p, w in zip(parts, widths):
        if isinstance(p, (bytes, bytearray)):
            mat[:, col:col + w] = np.frombuffer(bytes(p), dtype=_U8)
            mask[:, col:col + w] = True
            total += w
        else:
            mat[:, col:col + w] = p.mat
            mask[:, col:col + w] = _mask_table(w)[p.lens]
            total += p.lens
        col += w
    offsets = np.zeros(n + 1, dtype=np.int64)
    np.cumsum(total, out=offsets[1:])
    return _Binary(mat[mask], offsets)


def concat_rows(parts: Sequence[Union[bytes, Packed]], n: int) -> Tuple[np.ndarray, np.ndarray]:
    """Row i of the result = row i of every part, in order. Constant bytes repeat on every row."""
    # merge runs of fixed-width pieces first: one boolean mask per run
    runs: List[_Binary] = []
    pending: List[Union[bytes, _Matrix]] = []
    for p in parts:
        if isinstance(p, _Binary):
            if pending:
                runs.append(_to_binary(pending, n))
                pending = []
            runs.append(p)
        else:
            pending.append(p)
    if pending:
        runs.append(_to_binary(pending, n))
    if not runs:
        return np.zeros(0, dtype=_U8), np.zeros(n + 1, dtype=np.int64)
    if len(runs) == 1 and runs[0].offsets[0] == 0:
        return runs[0].data, runs[0].offsets
    all_lens = [np.diff(r.offsets) for r in runs]
    total = all_lens[0].copy()
    for ln in all_lens[1:]:
        total += ln
    out_offsets = np.zeros(n + 1, dtype=np.int64)
    np.cumsum(total, out=out_offsets[1:])
    out = np.empty(int(out_offsets[-1]), dtype=_U8)
    pos = out_offsets[:-1].copy()
    for r, ln in zip(runs, all_lens):
        lo, hi = int(r.offsets[0]), int(r.offsets[-1])
        if hi > lo:
            # destination of source byte s of row i: pos[i] + (s - offsets[i])
            dst = np.repeat(pos - r.offsets[:-1], ln) + np.arange(lo, hi, dtype=np.int64)
            out[dst] = r.data[lo:hi]
        pos += ln
    return out, out_offsets


def _spec_parts(spec: tuple) -> List[Packed]:
    kind = spec[0]
    if kind in ("i", "u"):
        return [_pack_ints(spec[1])]
    if kind == "f":
        return [_pack_floats(spec[1])]
    if kind == "b":
        return [_pack_bools(spec[1].astype(bool))]
    if kind not in ("s", "y", "r"):
        raise ValueError(f"unknown column spec {kind!r}")
    data, offsets = np.asarray(spec[1], dtype=_U8), np.asarray(spec[2], dtype=np.int64)
    if kind in ("s", "y"):
        return _pack_layout(data, offsets, kind == "s")
    if kind == "r":
        return [_Binary(data, offsets)]
    raise ValueError(f"unknown column spec {kind!r}")


def encode_rows_py(prefix: bytes, specs: Sequence[tuple], n: int) -> Tuple[np.ndarray, np.ndarray]:
    """Pure-Python (numpy) twin of `dstl._fast._statecols.encode_rows`: byte-identical output."""
    parts: List[Union[bytes, Packed]] = [prefix] if prefix else []
    for spec in specs:
        if spec[0] in ("i", "u", "f", "b") and len(spec[1]) != n:
            raise ValueError("column length does not match the row count")
        parts.extend(_spec_parts(spec))
    data, offsets = concat_rows(parts, n)
    return np.ascontiguousarray(data, dtype=_U8), offsets


def encode_rows(prefix: bytes, specs: Sequence[tuple], n: int) -> Tuple[np.ndarray, np.ndarray]:
    """n payloads `prefix + msgpack(spec_1[i]) + ...` as (data, int64 offsets[n+1])."""
    if _kernel is not None:
        return _kernel.encode_rows(bytes(prefix), list(specs), n)
    return encode_rows_py(prefix, specs, n)


def dict_update_rows_py(tables: list, kg_start: int, kgs: np.ndarray, keys: Any, values: Any) -> None:
    """Twin of `dstl._fast._statecols.dict_update_rows`: `tables[kgs[i] - kg_start][keys[i]] = values[i]`
    in row order. Pure Python: one stable sort by key group, then one `dict.update` per group."""
    n = len(kgs)
    keys_l = keys if isinstance(keys, list) else list(keys.tolist() if hasattr(keys, "tolist") else keys)
    vals_l = values if isinstance(values, list) else list(values.tolist() if hasattr(values, "tolist") else values)
    if len(keys_l) != n or len(vals_l) != n:
        raise ValueError("key groups, keys and values differ in length")
    slots = np.asarray(kgs, dtype=np.int64) - kg_start
    if n:
        bad = (slots < 0) | (slots >= len(tables))
        if not bad.any():
            bad = np.fromiter((tables[s] is None for s in np.unique(slots).tolist()), dtype=bool)
            if bad.any():
                first = int(np.unique(slots)[np.argmax(bad)])
                row = int(np.argmax(slots == first))
                raise ValueError(f"row {row}: key group {int(kgs[row])} has no table")
        else:
            row = int(np.argmax(bad))
            raise ValueError(f"row {row}: key group {int(kgs[row])} has no table")
    order = np.argsort(slots.astype(np.int16), kind="stable")  # int16: numpy radix-sorts it
    ss = slots[order]
    cuts = (np.flatnonzero(ss[1:] != ss[:-1]) + 1).tolist()
    ol = order.tolist()
    for s, e in zip([0] + cuts, cuts + [n]):
        idx = ol[s:e]
        tables[int(ss[s])].update((keys_l[i], vals_l[i]) for i in idx) if len(idx) < 2 else \
            tables[int(ss[s])].update(zip(itemgetter(*idx)(keys_l), itemgetter(*idx)(vals_l)))


def dict_update_rows(tables: list, kg_start: int, kgs: np.ndarray, keys: Any, values: Any) -> None:
    """`tables[kgs[i] - kg_start][keys[i]] = values[i]` for every row, later rows winning."""
    if _kernel is not None:
        return _kernel.dict_update_rows(tables, kg_start, np.ascontiguousarray(kgs, dtype=np.int32), keys, values)
    return dict_update_rows_py(tables, kg_start, kgs, keys, values)
