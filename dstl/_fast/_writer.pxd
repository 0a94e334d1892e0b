# The writer core, declared for the keyed-state kernel (dstl/_fast/_keyed.pyx), which copies an
# encoded change from its own buffer straight into the writer's arena (`WriterCore._append_raw`),
# with no bytes object and no Python call.
from libc.stdint cimport int64_t

from dstl._fast._buffer cimport ChangeBuffer


cdef class WriterCore:
    cdef readonly ChangeBuffer _buffer
    cdef public bint _closed
    cdef public long _kg_start, _kg_end
    cdef public int64_t _threshold
    cdef unsigned long _flusher   # the thread inside a pre-emptive persist of an append; 0 = none

    cdef int _enter(self) except -1
    cdef int _after(self) except -1
    cdef int _append_raw(self, long kg, const unsigned char* src, Py_ssize_t length) except -1
