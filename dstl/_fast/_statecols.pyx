# cython: language_level=3, boundscheck=False, wraparound=False, cdivision=True
"""Row-wise msgpack encoding of state change payloads from columns (twin: dstl/state/columns.py).

`encode_rows(prefix, specs, n)` builds n payloads `prefix + msgpack(col_1[i]) + ... + msgpack(col_k[i])`
in the Arrow binary layout (one data buffer + n+1 int64 offsets), byte-identical to
`msgpack.packb(x, use_bin_type=True)` per element, in two passes without Python objects per row.

A spec is one of (built by dstl.state.columns):
  ("i", int64[n]) ints   ("u", uint64[n]) unsigned ints   ("f", float64[n]) floats   ("b", uint8[n]) bools
  ("s", uint8 data, int64 offsets[n+1]) str (UTF-8 bytes)   ("y", data, offsets) bytes (msgpack bin)
  ("r", data, offsets) rows that are already msgpack
"""
from libc.stdint cimport int32_t, int64_t, uint8_t, uint64_t
from libc.string cimport memcpy

import numpy as np

cimport numpy as cnp

cnp.import_array()


cdef inline Py_ssize_t _uint_size(uint64_t v) noexcept nogil:
    if v < 128:
        return 1
    if v < 256:
        return 2
    if v < 65536:
        return 3
    if v < 4294967296ULL:
        return 5
    return 9


cdef inline Py_ssize_t _int_size(int64_t v) noexcept nogil:
    if v >= 0:
        return _uint_size(<uint64_t>v)
    if v >= -32:
        return 1
    if v >= -128:
        return 2
    if v >= -32768:
        return 3
    if v >= -2147483648LL:
        return 5
    return 9


cdef inline void _be(uint8_t* p, uint64_t v, int width) noexcept nogil:
    cdef int k
    for k in range(width):
        p[k] = <uint8_t>(v >> (8 * (width - 1 - k)))


cdef inline Py_ssize_t _write_uint(uint8_t* p, uint64_t v) noexcept nogil:
    if v < 128:
        p[0] = <uint8_t>v
        return 1
    if v < 256:
        p[0] = 0xCC
        p[1] = <uint8_t>v
        return 2
    if v < 65536:
        p[0] = 0xCD
        _be(p + 1, v, 2)
        return 3
    if v < 4294967296ULL:
        p[0] = 0xCE
        _be(p + 1, v, 4)
        return 5
    p[0] = 0xCF
    _be(p + 1, v, 8)
    return 9


cdef inline Py_ssize_t _write_int(uint8_t* p, int64_t v) noexcept nogil:
    cdef uint64_t u = <uint64_t>v
    if v >= 0:
        return _write_uint(p, u)
    if v >= -32:
        p[0] = <uint8_t>(u & 0xFF)
        return 1
    if v >= -128:
        p[0] = 0xD0
        p[1] = <uint8_t>(u & 0xFF)
        return 2
    if v >= -32768:
        p[0] = 0xD1
        _be(p + 1, u, 2)
        return 3
    if v >= -2147483648LL:
        p[0] = 0xD2
        _be(p + 1, u, 4)
        return 5
    p[0] = 0xD3
    _be(p + 1, u, 8)
    return 9


cdef inline Py_ssize_t _len_header_size(int64_t length, bint is_str) noexcept nogil:
    if is_str and length < 32:
        return 1
    if length < 256:
        return 2
    if length < 65536:
        return 3
    return 5


cdef inline Py_ssize_t _write_len_header(uint8_t* p, int64_t length, bint is_str) noexcept nogil:
    if is_str and length < 32:
        p[0] = <uint8_t>(0xA0 | length)
        return 1
    if length < 256:
        p[0] = 0xD9 if is_str else 0xC4
        p[1] = <uint8_t>length
        return 2
    if length < 65536:
        p[0] = 0xDA if is_str else 0xC5
        _be(p + 1, <uint64_t>length, 2)
        return 3
    p[0] = 0xDB if is_str else 0xC6
    _be(p + 1, <uint64_t>length, 4)
    return 5


def encode_rows(bytes prefix, list specs, Py_ssize_t n):
    """`(data uint8[], offsets int64[n+1])`: row i = prefix + the msgpack of every spec's row i."""
    cdef Py_ssize_t plen = len(prefix)
    cdef const uint8_t* pre = <const uint8_t*>(<char*>prefix)
    cdef cnp.ndarray[int64_t, ndim=1] offsets = np.empty(n + 1, dtype=np.int64)
    cdef int64_t[::1] off = offsets
    cdef int64_t[::1] pos
    cdef Py_ssize_t i, total
    cdef const int64_t[::1] iv
    cdef const uint64_t[::1] uv
    cdef const double[::1] fv
    cdef const uint8_t[::1] bv
    cdef const uint8_t[::1] data
    cdef const int64_t[::1] so
    cdef uint8_t* out
    cdef uint64_t bits
    cdef int64_t length
    cdef bint is_str
    cdef str kind
    # pass 1: row lengths
    for i in range(n):
        off[i + 1] = plen
    for spec in specs:
        kind = spec[0]
        if kind in ("i", "u", "f", "b") and len(spec[1]) != n:
            raise ValueError("column length does not match the row count")
        if kind == "i":
            iv = spec[1]
            for i in range(n):
                off[i + 1] += _int_size(iv[i])
        elif kind == "u":
            uv = spec[1]
            for i in range(n):
                off[i + 1] += _uint_size(uv[i])
        elif kind == "f":
            for i in range(n):
                off[i + 1] += 9
        elif kind == "b":
            for i in range(n):
                off[i + 1] += 1
        elif kind in ("s", "y", "r"):
            so = spec[2]
            if so.shape[0] != n + 1:
                raise ValueError("offsets must have n+1 entries")
            if n and (so[0] < 0 or so[n] > len(spec[1])):
                raise ValueError("offsets point outside the data buffer")
            is_str = kind == "s"
            for i in range(n):
                length = so[i + 1] - so[i]
                if length < 0:
                    raise ValueError("offsets must be monotone")
                if kind != "r":
                    if length >= 4294967296LL:
                        raise ValueError("a str/bytes value longer than 4 GiB cannot be msgpack-encoded")
                    off[i + 1] += _len_header_size(length, is_str)
                off[i + 1] += length
        else:
            raise ValueError(f"unknown column spec {kind!r}")
    off[0] = 0
    for i in range(n):
        off[i + 1] += off[i]
    total = off[n]
    result = np.empty(total, dtype=np.uint8)
    cdef uint8_t[::1] res = result
    out = &res[0] if total > 0 else NULL
    pos = np.empty(n, dtype=np.int64)
    # pass 2: write, one column at a time
    for i in range(n):
        if plen:
            memcpy(out + off[i], pre, plen)
        pos[i] = off[i] + plen
    for spec in specs:
        kind = spec[0]
        if kind == "i":
            iv = spec[1]
            for i in range(n):
                pos[i] += _write_int(out + pos[i], iv[i])
        elif kind == "u":
            uv = spec[1]
            for i in range(n):
                pos[i] += _write_uint(out + pos[i], uv[i])
        elif kind == "f":
            fv = spec[1]
            for i in range(n):
                out[pos[i]] = 0xCB
                memcpy(&bits, &fv[i], 8)
                _be(out + pos[i] + 1, bits, 8)
                pos[i] += 9
        elif kind == "b":
            bv = spec[1]
            for i in range(n):
                out[pos[i]] = 0xC3 if bv[i] else 0xC2
                pos[i] += 1
        else:
            data = spec[1]
            so = spec[2]
            is_str = kind == "s"
            for i in range(n):
                length = so[i + 1] - so[i]
                if kind != "r":
                    pos[i] += _write_len_header(out + pos[i], length, is_str)
                if length:
                    memcpy(out + pos[i], &data[so[i]], length)
                    pos[i] += length
    return result, offsets


cdef extern from "Python.h":
    int PyDict_SetItem(object d, object k, object v) except -1


def dict_update_rows(list tables, Py_ssize_t kg_start, kgs, keys, values):
    """`tables[kgs[i] - kg_start][keys[i]] = values[i]` for every row, in row order (twin:
    dstl.state.columns.dict_update_rows_py). `keys`/`values`: int64 or float64 arrays, or lists."""
    cdef const int32_t[::1] kg = kgs
    cdef Py_ssize_t n = kg.shape[0], i, slot, ntab = len(tables)
    cdef const int64_t[::1] ik
    cdef const int64_t[::1] iv
    cdef const double[::1] fv
    cdef list lk = None, lv = None
    cdef int kmode = 0, vmode = 0   # 0 list, 1 int64, 2 float64
    if isinstance(keys, np.ndarray) and keys.dtype == np.int64:
        ik = keys
        kmode = 1
    else:
        lk = keys if isinstance(keys, list) else list(keys)
    if isinstance(values, np.ndarray) and values.dtype == np.int64:
        iv = values
        vmode = 1
    elif isinstance(values, np.ndarray) and values.dtype == np.float64:
        fv = values
        vmode = 2
    else:
        lv = values if isinstance(values, list) else list(values)
    if (kmode == 0 and len(lk) != n) or (kmode == 1 and ik.shape[0] != n) \
            or (vmode == 0 and len(lv) != n) or (vmode == 1 and iv.shape[0] != n) \
            or (vmode == 2 and fv.shape[0] != n):
        raise ValueError("key groups, keys and values differ in length")
    for i in range(n):
        slot = kg[i] - kg_start
        if slot < 0 or slot >= ntab or tables[slot] is None:
            raise ValueError(f"row {i}: key group {kg[i]} has no table")
    for i in range(n):
        d = tables[kg[i] - kg_start]
        k = ik[i] if kmode == 1 else lk[i]
        if vmode == 1:
            v = iv[i]
        elif vmode == 2:
            v = fv[i]
        else:
            v = lv[i]
        PyDict_SetItem(d, k, v)
