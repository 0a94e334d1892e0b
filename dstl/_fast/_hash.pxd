from libc.stdint cimport int32_t, int64_t, uint32_t, uint64_t

# Java's hashCode of an int/str/bytes key (the other modules' single-key paths use it directly)
cdef uint32_t _java_hash(object key) except? 0xFFFFFFFF


cdef inline uint32_t _long_hash(int64_t v) noexcept nogil:
    cdef uint64_t u = <uint64_t>v
    cdef uint32_t lo = <uint32_t>u
    # Integer.hashCode inside int32, else Long.hashCode (lo ^ hi)
    cdef uint32_t hi = <uint32_t>(u >> 32) if (v < -2147483648 or v > 2147483647) else 0u
    return lo ^ hi


cdef inline int32_t _murmur(uint32_t c) noexcept nogil:
    """Flink's MathUtils.murmurHash of a key's hashCode, as a non-negative int (docs/rescaling.md §3)."""
    c *= 0xCC9E2D51u
    c = (c << 15) | (c >> 17)
    c *= 0x1B873593u
    c = (c << 13) | (c >> 19)
    c = c * 5u + 0xE6546B64u
    c ^= 4u
    c ^= c >> 16
    c *= 0x85EBCA6Bu
    c ^= c >> 13
    c *= 0xC2B2AE35u
    c ^= c >> 16
    # |c| as int32, with Integer.MIN_VALUE -> 0; written without branches so loops vectorise
    cdef uint32_t neg = 0u - (c >> 31)
    cdef uint32_t a = (c ^ neg) - neg
    return <int32_t>(a & ~(0u - (a >> 31)))
