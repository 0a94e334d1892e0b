# cython: language_level=3, boundscheck=False, wraparound=False, cdivision=True
"""Java-compatible hash codes and Flink's key-group hash, vectorised (twin: dstl/_fast/_hash_py.py).

docs/rescaling.md §2-§3. The column kernels run without the GIL and without Python objects per row:
integers straight from an int64 array, strings from Arrow's offsets + UTF-8 data buffers (decoded to
UTF-16 code units on the fly), binaries from the same layout. Inputs are normalised by dstl.keygroups.
"""
from libc.stdint cimport int8_t, int32_t, int64_t, uint8_t, uint16_t, uint32_t, uint64_t

import numpy as np

cimport numpy as cnp

cnp.import_array()

cdef extern from "Python.h":
    int PyUnicode_KIND(object o)
    void* PyUnicode_DATA(object o)
    Py_ssize_t PyUnicode_GET_LENGTH(object o)
    char* PyBytes_AS_STRING(object o)
    Py_ssize_t PyBytes_GET_SIZE(object o)
    char* PyByteArray_AS_STRING(object o)
    Py_ssize_t PyByteArray_GET_SIZE(object o)
    long long PyLong_AsLongLongAndOverflow(object o, int* overflow) except? -1
    bint PyLong_CheckExact(object o)

cdef enum:
    MAX_PARALLELISM_UPPER_BOUND = 32768

ctypedef fused offset_t:
    int32_t
    int64_t


cdef int _check_max_parallelism(object max_parallelism) except -1:
    if isinstance(max_parallelism, (bool, np.bool_)) or not isinstance(max_parallelism, (int, np.integer)):
        raise TypeError(f"max_parallelism must be an int, got {type(max_parallelism).__name__}")
    value = int(max_parallelism)
    if not 1 <= value <= MAX_PARALLELISM_UPPER_BOUND:
        raise ValueError(f"max_parallelism must be in 1..{MAX_PARALLELISM_UPPER_BOUND}, got {value}")
    return value


cdef inline int32_t _kg(uint32_t code, int32_t max_parallelism, bint pow2) noexcept nogil:
    cdef int32_t m = _murmur(code)
    # murmur is never negative, so the mask equals % for a power of two (and skips a division)
    return (m & (max_parallelism - 1)) if pow2 else (m % max_parallelism)


# _long_hash (an int64 key's hashCode): in _hash.pxd, inline for the keyed-state kernel too


cdef inline uint32_t _str_hash(str s):
    cdef int kind = PyUnicode_KIND(s)
    cdef void* data = PyUnicode_DATA(s)
    cdef Py_ssize_t i, n = PyUnicode_GET_LENGTH(s)
    cdef uint32_t h = 0, cp
    if kind == 1:
        for i in range(n):
            h = 31u * h + (<uint8_t*>data)[i]
    elif kind == 2:  # lone surrogates are stored as themselves: one code unit, as in Java
        for i in range(n):
            h = 31u * h + (<uint16_t*>data)[i]
    else:
        for i in range(n):
            cp = (<uint32_t*>data)[i]
            if cp >= 0x10000u:
                cp -= 0x10000u
                h = 31u * h + (0xD800u + (cp >> 10))
                h = 31u * h + (0xDC00u + (cp & 0x3FFu))
            else:
                h = 31u * h + cp
    return h


cdef inline uint32_t _bytes_hash(const char* p, Py_ssize_t n) noexcept nogil:
    cdef uint32_t h = 1
    cdef Py_ssize_t i
    for i in range(n):
        h = 31u * h + <uint32_t><int32_t>(<int8_t>p[i])
    return h


cdef uint32_t _java_hash(object key) except? 0xFFFFFFFF:
    cdef int overflow = 0
    cdef long long v
    if PyLong_CheckExact(key):  # the common key first: no isinstance chain, no int() call
        v = PyLong_AsLongLongAndOverflow(key, &overflow)
        if not overflow:
            return _long_hash(v)
    if isinstance(key, str):
        return _str_hash(<str>key)
    if isinstance(key, bytes):
        return _bytes_hash(PyBytes_AS_STRING(key), PyBytes_GET_SIZE(key))
    if isinstance(key, bytearray):
        return _bytes_hash(PyByteArray_AS_STRING(key), PyByteArray_GET_SIZE(key))
    if isinstance(key, (bool, np.bool_)):
        raise TypeError("bool keys are not supported: Java's Boolean.hashCode differs from int(bool)")
    if isinstance(key, (int, np.integer)):
        key = int(key)
        v = PyLong_AsLongLongAndOverflow(key, &overflow)
        if overflow:
            raise ValueError(
                f"int key {key} is outside the int64 range; dstl hashes ints as Java Integer/Long")
        return _long_hash(v)
    if key is None:
        raise TypeError("key must not be None")
    raise TypeError(f"unsupported key type {type(key).__name__}: keys must be int, str or bytes")


def java_hash_code(key) -> int:
    """Java's hashCode for an int/str/bytes key as a signed int32 (docs/rescaling.md §2)."""
    return <int32_t>_java_hash(key)


def murmur_hash(code) -> int:
    """Flink's MathUtils.murmurHash(int): non-negative int32."""
    if isinstance(code, (bool, np.bool_)) or not isinstance(code, (int, np.integer)):
        raise TypeError(f"hash code must be an int, got {type(code).__name__}")
    code = int(code)
    if not -2147483648 <= code <= 2147483647:
        raise ValueError(f"hash code must be an int32, got {code}")
    return _murmur(<uint32_t><int32_t>code)


def assign_to_key_group(key, max_parallelism) -> int:
    """murmur(java_hash_code(key)) % max_parallelism."""
    cdef int32_t mp = _check_max_parallelism(max_parallelism)
    return _murmur(_java_hash(key)) % mp


# ---------------------------------------------------------------- vectorised kernels


def int64_key_groups(const int64_t[::1] values, max_parallelism):
    """Key groups of a 1-d int64 array (Integer rule inside int32, Long rule outside)."""
    cdef int32_t mp = _check_max_parallelism(max_parallelism)
    cdef bint pow2 = (mp & (mp - 1)) == 0
    cdef Py_ssize_t i, n = values.shape[0]
    out = np.empty(n, dtype=np.int32)
    cdef int32_t[::1] o = out
    cdef int32_t mask = mp - 1
    with nogil:
        if pow2:  # separate loops keep the branch out of the hot loop
            for i in range(n):
                o[i] = _murmur(_long_hash(values[i])) & mask
        else:
            for i in range(n):
                o[i] = _murmur(_long_hash(values[i])) % mp
    return out


cdef int _check_offsets(const offset_t[::1] o, Py_ssize_t data_len) except -1:
    cdef Py_ssize_t n = o.shape[0], i
    if n < 1:
        raise ValueError("offsets must be a 1-d array of n+1 entries")
    if o[0] < 0 or o[n - 1] > data_len:
        raise ValueError(f"offsets [{o[0]}, {o[n - 1]}] reach outside the data buffer of {data_len} bytes")
    for i in range(n - 1):
        if o[i + 1] < o[i]:
            raise ValueError(f"offsets are not monotone at row {i}")
    return 0


cdef Py_ssize_t _binary_impl(const offset_t[::1] o, const uint8_t[::1] d, int32_t[::1] out,
                             int32_t mp) noexcept nogil:
    cdef bint pow2 = (mp & (mp - 1)) == 0
    cdef Py_ssize_t r, n = o.shape[0] - 1
    cdef const char* base = <const char*>&d[0] if d.shape[0] else <const char*>0
    for r in range(n):
        out[r] = _kg(_bytes_hash(base + o[r], o[r + 1] - o[r]), mp, pow2)
    return -1


cdef Py_ssize_t _utf8_impl(const offset_t[::1] o, const uint8_t[::1] d, int32_t[::1] out,
                           int32_t mp) noexcept nogil:
    """Returns the first row that is not valid UTF-8 (same strictness as Python's codec), or -1."""
    cdef bint pow2 = (mp & (mp - 1)) == 0
    cdef Py_ssize_t r, n = o.shape[0] - 1, p, end
    cdef uint32_t h, cp, b0, b1, b2, b3
    for r in range(n):
        p = o[r]
        end = o[r + 1]
        h = 0
        while p < end:
            b0 = d[p]
            if b0 < 0x80u:
                h = 31u * h + b0
                p += 1
            elif b0 < 0xC2u:
                return r  # continuation byte or overlong 2-byte lead
            elif b0 < 0xE0u:
                if p + 1 >= end:
                    return r
                b1 = d[p + 1]
                if (b1 & 0xC0u) != 0x80u:
                    return r
                h = 31u * h + (((b0 & 0x1Fu) << 6) | (b1 & 0x3Fu))
                p += 2
            elif b0 < 0xF0u:
                if p + 2 >= end:
                    return r
                b1 = d[p + 1]
                b2 = d[p + 2]
                if (b1 & 0xC0u) != 0x80u or (b2 & 0xC0u) != 0x80u:
                    return r
                if (b0 == 0xE0u and b1 < 0xA0u) or (b0 == 0xEDu and b1 >= 0xA0u):
                    return r  # overlong, or an encoded surrogate
                h = 31u * h + (((b0 & 0x0Fu) << 12) | ((b1 & 0x3Fu) << 6) | (b2 & 0x3Fu))
                p += 3
            elif b0 < 0xF5u:
                if p + 3 >= end:
                    return r
                b1 = d[p + 1]
                b2 = d[p + 2]
                b3 = d[p + 3]
                if (b1 & 0xC0u) != 0x80u or (b2 & 0xC0u) != 0x80u or (b3 & 0xC0u) != 0x80u:
                    return r
                if (b0 == 0xF0u and b1 < 0x90u) or (b0 == 0xF4u and b1 >= 0x90u):
                    return r  # overlong, or above U+10FFFF
                cp = (((b0 & 0x07u) << 18) | ((b1 & 0x3Fu) << 12) | ((b2 & 0x3Fu) << 6) | (b3 & 0x3Fu))
                cp -= 0x10000u  # a surrogate pair in UTF-16
                h = 31u * h + (0xD800u + (cp >> 10))
                h = 31u * h + (0xDC00u + (cp & 0x3FFu))
                p += 4
            else:
                return r
        out[r] = _kg(h, mp, pow2)
    return -1


def _as_u8(data):
    if data is None:
        return np.zeros(0, dtype=np.uint8)
    if isinstance(data, np.ndarray):
        return np.ascontiguousarray(data).reshape(-1).view(np.uint8)
    return np.frombuffer(data, dtype=np.uint8)


def _layout_kernel(offsets, data, max_parallelism, bint utf8):
    cdef int32_t mp = _check_max_parallelism(max_parallelism)
    o = np.asarray(offsets)
    if o.ndim != 1 or o.shape[0] < 1:
        raise ValueError("offsets must be a 1-d array of n+1 entries")
    if o.dtype != np.int32:
        o = np.ascontiguousarray(o, dtype=np.int64)
    else:
        o = np.ascontiguousarray(o)
    cdef const uint8_t[::1] d = _as_u8(data)
    out = np.empty(o.shape[0] - 1, dtype=np.int32)
    cdef int32_t[::1] res = out
    cdef Py_ssize_t bad
    cdef const int32_t[::1] o32
    cdef const int64_t[::1] o64
    if o.dtype == np.int32:
        o32 = o
        _check_offsets(o32, d.shape[0])
        with nogil:
            if utf8:
                bad = _utf8_impl(o32, d, res, mp)
            else:
                bad = _binary_impl(o32, d, res, mp)
    else:
        o64 = o
        _check_offsets(o64, d.shape[0])
        with nogil:
            if utf8:
                bad = _utf8_impl(o64, d, res, mp)
            else:
                bad = _binary_impl(o64, d, res, mp)
    if bad >= 0:
        raise ValueError(f"row {bad} is not valid UTF-8")
    return out


def binary_key_groups(offsets, data, max_parallelism):
    """Key groups of an Arrow binary layout (row i = data[offsets[i]:offsets[i+1]]), bytes rule."""
    return _layout_kernel(offsets, data, max_parallelism, False)


def utf8_key_groups(offsets, data, max_parallelism):
    """Key groups of an Arrow string layout (UTF-8 rows), hashed as Java Strings (UTF-16 units)."""
    return _layout_kernel(offsets, data, max_parallelism, True)


def object_key_groups(list values, max_parallelism):
    """Key groups of a list of Python keys, each under the scalar rules; errors name the row."""
    cdef int32_t mp = _check_max_parallelism(max_parallelism)
    cdef bint pow2 = (mp & (mp - 1)) == 0
    cdef Py_ssize_t i, n = len(values)
    out = np.empty(n, dtype=np.int32)
    cdef int32_t[::1] o = out
    cdef uint32_t code
    for i in range(n):
        try:
            code = _java_hash(values[i])
        except (TypeError, ValueError) as exc:
            raise type(exc)(f"row {i}: {exc}") from None
        o[i] = _kg(code, mp, pow2)
    return out


def operator_indices(key_groups, int32_t max_parallelism, int32_t parallelism):
    """kg * parallelism // max_parallelism for every key group (docs/rescaling.md §3)."""
    kg = np.asarray(key_groups)
    if kg.dtype.kind not in "iu":
        raise TypeError(f"key groups must be an integer array, got dtype {kg.dtype}")
    if kg.dtype == np.uint64 and kg.size and kg.max() > np.uint64((1 << 63) - 1):
        first = int(np.flatnonzero(kg > np.uint64((1 << 63) - 1))[0])
        raise ValueError(f"key group {int(kg[first])} at row {first} is outside 0..{max_parallelism - 1}")
    cdef const int64_t[::1] k = np.ascontiguousarray(kg, dtype=np.int64)
    cdef Py_ssize_t i, n = k.shape[0], bad = -1
    out = np.empty(n, dtype=np.int32)
    cdef int32_t[::1] o = out
    with nogil:
        for i in range(n):
            if k[i] < 0 or k[i] >= max_parallelism:
                bad = i
                break
            o[i] = <int32_t>(k[i] * parallelism // max_parallelism)
    if bad >= 0:
        raise ValueError(f"key group {k[bad]} at row {bad} is outside 0..{max_parallelism - 1}")
    return out
