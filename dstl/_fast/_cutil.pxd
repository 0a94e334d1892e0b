# C helpers shared by the buffer modules (_spares, _sealed, _buffer, _filewrite, _writer): inline
# functions, compiled into each module that cimports them, so a call costs what it did inside one
# module. A .pxd alone: no Python module, nothing to twin.
from libc.stdint cimport int32_t, int64_t, uint32_t

cdef extern from "sys/mman.h" nogil:
    int madvise(void* addr, size_t length, int advice)
    int MADV_HUGEPAGE

cdef extern from *:
    """
    #ifndef MADV_HUGEPAGE
    #define MADV_HUGEPAGE 14
    #endif
    #define DSTL_PREFETCH(p) __builtin_prefetch((const void*)(p), 0, 0)
    #define DSTL_PREFETCH_W(p) __builtin_prefetch((const void*)(p), 1, 3)
    """
    void DSTL_PREFETCH(const void* p) noexcept nogil
    void DSTL_PREFETCH_W(const void* p) noexcept nogil

cdef extern from "Python.h":
    ctypedef struct PyByteArrayObject:
        Py_ssize_t ob_exports

cdef enum:
    INT32_MAX = 2147483647
    KEEP_ARENA = 8 << 20    # an idle buffer or the spare pool keeps at most this much arena per set


cdef inline void huge_pages(void* start, int64_t length) noexcept nogil:
    """Ask for transparent huge pages on the 2 MiB-aligned inside of a large fresh region: first-touch
    page faults dominate writing 100 MB into new memory, and a huge page takes 1/512 of them."""
    cdef size_t huge = 2 << 20
    cdef size_t a = (<size_t>start + huge - 1) & ~(huge - 1)
    cdef size_t b = (<size_t>start + <size_t>length) & ~(huge - 1)
    if length >= 8 * <int64_t>huge and b > a:
        madvise(<void*>a, b - a, MADV_HUGEPAGE)  # advisory: failure just means small pages


cdef inline void put_be32(unsigned char* p, int32_t value) noexcept nogil:
    cdef uint32_t v = <uint32_t>value
    p[0] = <unsigned char>(v >> 24)
    p[1] = <unsigned char>(v >> 16)
    p[2] = <unsigned char>(v >> 8)
    p[3] = <unsigned char>v


cdef inline int64_t get_be32(const unsigned char* p) noexcept nogil:
    """A chunk's length field (written by put_be32, never negative)."""
    return (<int64_t>p[0] << 24) | (p[1] << 16) | (p[2] << 8) | p[3]
