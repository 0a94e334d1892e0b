"""Pure-Python (numpy) twin of `dstl._fast._statecols`: vectorised msgpack rows, byte-identical.

`encode_rows(prefix, specs, n)` builds n change payloads (`prefix + msgpack(column values)...`) in the
Arrow binary layout; `dict_update_rows` stores a batch into per-key-group dicts. The packing helpers
(`_Matrix` rows of fixed width, `_Binary` variable-length rows, `concat_rows`) are also used by
`dstl.state.columns` under both implementations.
"""
from __future__ import annotations

from operator import itemgetter
from typing import Any, List, Optional, Sequence, Tuple, Union

import numpy as np

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


def encode_rows(prefix: bytes, specs: Sequence[tuple], n: int) -> Tuple[np.ndarray, np.ndarray]:
    """n payloads `prefix + msgpack(spec_1[i]) + ...` as (data, int64 offsets[n+1])."""
    parts: List[Union[bytes, Packed]] = [prefix] if prefix else []
    for spec in specs:
        if spec[0] in ("i", "u", "f", "b") and len(spec[1]) != n:
            raise ValueError("column length does not match the row count")
        parts.extend(_spec_parts(spec))
    data, offsets = concat_rows(parts, n)
    return np.ascontiguousarray(data, dtype=_U8), offsets


def dict_update_rows(tables: list, kg_start: int, kgs: np.ndarray, keys: Any, values: Any) -> None:
    """`tables[kgs[i] - kg_start][keys[i]] = values[i]` in row order: one stable sort by key
    group, then one `dict.update` per group."""
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
