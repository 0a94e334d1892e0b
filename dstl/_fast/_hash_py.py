"""Pure-Python twin of dstl/_fast/_hash.pyx: Java-compatible hash codes and Flink's key-group hash.

docs/rescaling.md §2-§3. The vectorised kernels work on numpy arrays (and Arrow's offsets + data buffers
for string/binary columns) and must return exactly what the Cython module returns, errors included.
Inputs are normalised by dstl.keygroups; the kernels only see the shapes documented per function.
"""
from __future__ import annotations

import numpy as np

INT32_MIN = -(1 << 31)
INT32_MAX = (1 << 31) - 1
INT64_MIN = -(1 << 63)
INT64_MAX = (1 << 63) - 1
MAX_PARALLELISM_UPPER_BOUND = 1 << 15
_M32 = 0xFFFFFFFF


def _signed32(x: int) -> int:
    x &= _M32
    return x - (1 << 32) if x & 0x80000000 else x


def _check_max_parallelism(max_parallelism) -> int:
    if isinstance(max_parallelism, bool) or not isinstance(max_parallelism, (int, np.integer)):
        raise TypeError(f"max_parallelism must be an int, got {type(max_parallelism).__name__}")
    max_parallelism = int(max_parallelism)
    if not 1 <= max_parallelism <= MAX_PARALLELISM_UPPER_BOUND:
        raise ValueError(f"max_parallelism must be in 1..{MAX_PARALLELISM_UPPER_BOUND}, got {max_parallelism}")
    return max_parallelism


def _int_hash(value: int) -> int:
    if INT32_MIN <= value <= INT32_MAX:
        return value  # Integer.hashCode
    if INT64_MIN <= value <= INT64_MAX:
        u = value & 0xFFFFFFFFFFFFFFFF
        return _signed32(u ^ (u >> 32))  # Long.hashCode
    raise ValueError(f"int key {value} is outside the int64 range; dstl hashes ints as Java Integer/Long")


def _str_hash(value: str) -> int:
    h = 0
    # surrogatepass: a lone surrogate is one UTF-16 code unit, as in a Java String
    for unit in memoryview(value.encode("utf-16-le", "surrogatepass")).cast("H"):
        h = (31 * h + unit) & _M32
    return _signed32(h)


def _bytes_hash(value) -> int:
    h = 1
    for b in value:
        h = (31 * h + (b - 256 if b >= 128 else b)) & _M32
    return _signed32(h)


def java_hash_code(key) -> int:
    """Java's hashCode for an int/str/bytes key as a signed int32 (docs/rescaling.md §2)."""
    if isinstance(key, str):
        return _str_hash(key)
    if isinstance(key, (bytes, bytearray)):
        return _bytes_hash(key)
    if isinstance(key, bool) or isinstance(key, np.bool_):
        raise TypeError("bool keys are not supported: Java's Boolean.hashCode differs from int(bool)")
    if isinstance(key, (int, np.integer)):
        return _int_hash(int(key))
    if key is None:
        raise TypeError("key must not be None")
    raise TypeError(f"unsupported key type {type(key).__name__}: keys must be int, str or bytes")


def murmur_hash(code: int) -> int:
    """Flink's MathUtils.murmurHash(int): non-negative int32."""
    if isinstance(code, bool) or not isinstance(code, (int, np.integer)):
        raise TypeError(f"hash code must be an int, got {type(code).__name__}")
    code = int(code)
    if not INT32_MIN <= code <= INT32_MAX:
        raise ValueError(f"hash code must be an int32, got {code}")
    c = code & _M32
    c = (c * 0xCC9E2D51) & _M32
    c = ((c << 15) | (c >> 17)) & _M32
    c = (c * 0x1B873593) & _M32
    c = ((c << 13) | (c >> 19)) & _M32
    c = (c * 5 + 0xE6546B64) & _M32
    c ^= 4
    c ^= c >> 16
    c = (c * 0x85EBCA6B) & _M32
    c ^= c >> 13
    c = (c * 0xC2B2AE35) & _M32
    c ^= c >> 16
    s = _signed32(c)
    if s >= 0:
        return s
    return -s if s != INT32_MIN else 0


def assign_to_key_group(key, max_parallelism: int) -> int:
    """murmur(java_hash_code(key)) % max_parallelism."""
    max_parallelism = _check_max_parallelism(max_parallelism)
    return murmur_hash(java_hash_code(key)) % max_parallelism


# ---------------------------------------------------------------- vectorised kernels


def _murmur_u32(c: np.ndarray) -> np.ndarray:
    """Element-wise murmur over uint32 codes (wrap-around arithmetic), returns int32 >= 0."""
    c = c.astype(np.uint32, copy=True)
    c *= np.uint32(0xCC9E2D51)
    c = (c << np.uint32(15)) | (c >> np.uint32(17))
    c *= np.uint32(0x1B873593)
    c = (c << np.uint32(13)) | (c >> np.uint32(19))
    c *= np.uint32(5)
    c += np.uint32(0xE6546B64)
    c ^= np.uint32(4)
    c ^= c >> np.uint32(16)
    c *= np.uint32(0x85EBCA6B)
    c ^= c >> np.uint32(13)
    c *= np.uint32(0xC2B2AE35)
    c ^= c >> np.uint32(16)
    s = c.view(np.int32)
    # |s|, with Integer.MIN_VALUE -> 0 (its negation overflows back to itself)
    out = np.where(s >= 0, s, np.where(s == np.int32(INT32_MIN), np.int32(0), -s))
    return out.astype(np.int32, copy=False)


def _to_key_groups(codes_u32: np.ndarray, max_parallelism: int) -> np.ndarray:
    return (_murmur_u32(codes_u32) % np.int32(max_parallelism)).astype(np.int32, copy=False)


def int64_hash_codes(values: np.ndarray) -> np.ndarray:
    """Java hash codes (int32) of an int64 array: Integer rule inside int32, Long rule outside."""
    v = np.ascontiguousarray(values, dtype=np.int64)
    u = v.view(np.uint64)
    in32 = (v >= INT32_MIN) & (v <= INT32_MAX)
    codes = np.where(in32, u, u ^ (u >> np.uint64(32))) & np.uint64(_M32)
    return codes.astype(np.uint32).view(np.int32)


def int64_key_groups(values: np.ndarray, max_parallelism: int) -> np.ndarray:
    """Key groups of a 1-d int64 array."""
    max_parallelism = _check_max_parallelism(max_parallelism)
    return _to_key_groups(int64_hash_codes(values).view(np.uint32), max_parallelism)


def _poly_hash(units: np.ndarray, offsets: np.ndarray, seed_ones: bool) -> np.ndarray:
    """h = 31*h + u over each row's slice of `units` (int64 values, taken mod 2^32).

    Uses h = seed*31^n + sum(u_i * 31^(n-1-i)) (mod 2^32): every unit is weighted as if its row ended
    at the end of the whole buffer, rows are differences of one running sum, and the excess factor
    31^(total-end) is removed with its inverse (31 is odd, so it is invertible mod 2^32).
    """
    o = offsets.astype(np.int64)
    n_rows = o.shape[0] - 1
    total = int(o[-1] - o[0])
    lengths = o[1:] - o[:-1]
    pw = _powers(total + 1)
    h = np.zeros(n_rows, dtype=np.uint64)
    if total:
        w = pw[::-1][1:]  # weight of unit j = 31^(total-1-j)
        terms = (units[o[0]:o[-1]].astype(np.uint64) & np.uint64(_M32)) * w & np.uint64(_M32)
        run = np.concatenate((np.zeros(1, np.uint64), np.cumsum(terms, dtype=np.uint64)))
        rel = o - o[0]
        seg = run[rel[1:]] - run[rel[:-1]]  # wraps mod 2^64: still exact mod 2^32
        inv = _inverse_powers(total - rel[1:])
        h = (seg & np.uint64(_M32)) * inv & np.uint64(_M32)
    if seed_ones:
        h = (h + _powers(int(lengths.max()) + 1 if n_rows else 1)[lengths]) & np.uint64(_M32)
    return h.astype(np.uint32)


_INV31 = pow(31, -1, 1 << 32)


def _powers(n: int, base: int = 31) -> np.ndarray:
    """[base^0, base^1, ..., base^(n-1)] mod 2^32 as uint64 (built by doubling)."""
    out = np.empty(max(n, 1), dtype=np.uint64)
    out[0] = 1
    k = 1
    while k < n:
        m = min(k, n - k)
        out[k:k + m] = out[:m] * np.uint64(pow(base, k, 1 << 32)) & np.uint64(_M32)
        k += m
    return out[:max(n, 1)]


def _inverse_powers(exps: np.ndarray) -> np.ndarray:
    """31^(-e) mod 2^32 for every e in `exps`."""
    table = _powers(int(exps.max()) + 1 if exps.size else 1, _INV31)
    return table[exps]


def _check_offsets(offsets: np.ndarray, data_len: int) -> np.ndarray:
    offsets = np.asarray(offsets)
    if offsets.ndim != 1 or offsets.shape[0] < 1:
        raise ValueError("offsets must be a 1-d array of n+1 entries")
    o = offsets.astype(np.int64)
    if o[0] < 0 or o[-1] > data_len:
        raise ValueError(f"offsets [{o[0]}, {o[-1]}] reach outside the data buffer of {data_len} bytes")
    bad = np.flatnonzero(o[1:] < o[:-1])
    if bad.size:
        raise ValueError(f"offsets are not monotone at row {int(bad[0])}")
    return o


_CHUNK_BYTES = 1 << 23  # bounds the twin's temporaries (several uint64 arrays per byte)


def _row_chunks(o: np.ndarray):
    """Split rows into runs of about _CHUNK_BYTES bytes (at least one row each)."""
    n_rows = o.shape[0] - 1
    r = 0
    while r < n_rows:
        stop = int(np.searchsorted(o, o[r] + _CHUNK_BYTES, side="right")) - 1
        stop = min(max(stop, r + 1), n_rows)
        yield r, stop
        r = stop


def _as_u8(data) -> np.ndarray:
    if isinstance(data, np.ndarray):
        return np.ascontiguousarray(data).reshape(-1).view(np.uint8)
    return np.frombuffer(data, dtype=np.uint8) if data is not None else np.zeros(0, np.uint8)


def binary_key_groups(offsets: np.ndarray, data, max_parallelism: int) -> np.ndarray:
    """Key groups of an Arrow binary layout (row i = data[offsets[i]:offsets[i+1]]), bytes rule."""
    max_parallelism = _check_max_parallelism(max_parallelism)
    d = _as_u8(data)
    o = _check_offsets(offsets, d.shape[0])
    out = np.empty(o.shape[0] - 1, dtype=np.int32)
    for r0, r1 in _row_chunks(o):
        oc = o[r0:r1 + 1]
        units = d[oc[0]:oc[-1]].view(np.int8).astype(np.int64)
        codes = _poly_hash(units, oc - oc[0], seed_ones=True)
        out[r0:r1] = _to_key_groups(codes, max_parallelism)
    return out


def _first_bad_utf8_row(d: np.ndarray, o: np.ndarray) -> int:
    """The first row that is not valid UTF-8 on its own, or -1."""
    starts = o[:-1][o[:-1] < o[1:]]
    splits_char = bool(starts.size) and bool(((d[starts] & 0xC0) == 0x80).any())
    try:
        d.tobytes().decode("utf-8")
        if not splits_char:  # valid as a whole and cut only between characters: every row is valid
            return -1
    except UnicodeDecodeError:
        pass
    for r in range(o.shape[0] - 1):  # error path only: find the row as the Cython kernel would
        try:
            d[o[r]:o[r + 1]].tobytes().decode("utf-8")
        except UnicodeDecodeError:
            return r
    return -1


def utf8_key_groups(offsets: np.ndarray, data, max_parallelism: int) -> np.ndarray:
    """Key groups of an Arrow string layout (UTF-8 rows), hashed as Java Strings (UTF-16 units)."""
    max_parallelism = _check_max_parallelism(max_parallelism)
    d = _as_u8(data)
    o = _check_offsets(offsets, d.shape[0])
    out = np.empty(o.shape[0] - 1, dtype=np.int32)
    for r0, r1 in _row_chunks(o):
        oc = o[r0:r1 + 1]
        dc = d[oc[0]:oc[-1]]
        rel = oc - oc[0]
        bad = _first_bad_utf8_row(dc, rel)
        if bad >= 0:
            raise ValueError(f"row {r0 + bad} is not valid UTF-8")
        units = np.frombuffer(dc.tobytes().decode("utf-8").encode("utf-16-le"), dtype="<u2").astype(np.int64)
        # UTF-16 length of a byte range = lead bytes + 4-byte leads (each becomes a surrogate pair)
        per_byte = ((dc & 0xC0) != 0x80).astype(np.int64) + (dc >= 0xF0)
        cum = np.concatenate((np.zeros(1, np.int64), np.cumsum(per_byte)))
        out[r0:r1] = _to_key_groups(_poly_hash(units, cum[rel], seed_ones=False), max_parallelism)
    return out


_OBJECT_CHUNK = 1 << 18


def object_key_groups(values, max_parallelism: int) -> np.ndarray:
    """Key groups of a sequence of Python keys, each under the scalar rules; errors name the row."""
    max_parallelism = _check_max_parallelism(max_parallelism)
    n = len(values)
    kinds = set(map(type, values))
    if n > _OBJECT_CHUNK and (kinds == {str} or kinds <= {bytes, bytearray}):
        # bound the temporaries of the numpy path below
        return np.concatenate([object_key_groups(values[i:i + _OBJECT_CHUNK], max_parallelism)
                               for i in range(0, n, _OBJECT_CHUNK)])
    if kinds == {str} or kinds <= {bytes, bytearray} and kinds:
        # one encode per row, then the numpy polynomial over all rows at once
        if kinds == {str}:
            parts = [v.encode("utf-16-le", "surrogatepass") for v in values]
            units = np.frombuffer(b"".join(parts), dtype="<u2").astype(np.int64)
            lengths = np.fromiter((len(p) >> 1 for p in parts), dtype=np.int64, count=n)
        else:
            units = np.frombuffer(b"".join(values), dtype=np.int8).astype(np.int64)
            lengths = np.fromiter(map(len, values), dtype=np.int64, count=n)
        offsets = np.concatenate((np.zeros(1, np.int64), np.cumsum(lengths)))
        codes = _poly_hash(units, offsets, seed_ones=kinds != {str})
        return _to_key_groups(codes, max_parallelism)
    codes = np.empty(n, dtype=np.int64)
    for i in range(n):
        try:
            codes[i] = java_hash_code(values[i])
        except (TypeError, ValueError) as exc:
            raise type(exc)(f"row {i}: {exc}") from None
    return _to_key_groups((codes & _M32).astype(np.uint32), max_parallelism)


def operator_indices(key_groups: np.ndarray, max_parallelism: int, parallelism: int) -> np.ndarray:
    """kg * parallelism // max_parallelism for every key group (docs/rescaling.md §3)."""
    kg = np.asarray(key_groups)
    if kg.dtype.kind not in "iu":
        raise TypeError(f"key groups must be an integer array, got dtype {kg.dtype}")
    if kg.dtype == np.uint64 and kg.size and kg.max() > np.uint64(INT64_MAX):
        i = int(np.flatnonzero(kg > np.uint64(INT64_MAX))[0])
        raise ValueError(f"key group {int(kg[i])} at row {i} is outside 0..{max_parallelism - 1}")
    kg = kg.astype(np.int64, copy=False)
    bad = np.flatnonzero((kg < 0) | (kg >= max_parallelism))
    if bad.size:
        i = int(bad[0])
        raise ValueError(f"key group {int(kg[i])} at row {i} is outside 0..{max_parallelism - 1}")
    return (kg * parallelism // max_parallelism).astype(np.int32)
