from libc.stdint cimport uint32_t

# Java's hashCode of an int/str/bytes key (the other modules' single-key paths use it directly)
cdef uint32_t _java_hash(object key) except? 0xFFFFFFFF
