# cython: language_level=3, boundscheck=False, wraparound=False, cdivision=True, initializedcheck=False
"""Cython writer core: the per-record append path of the changelog writer (`FsStateChangelogWriter`
is its subclass), with a C entry for the keyed-state kernel (`_append_raw`, declared in _writer.pxd).

Twin: dstl/_fast/_writer_py.py (same checks, same errors, a byte-identical buffer).
"""
cimport cython
from cpython.bytes cimport PyBytes_AS_STRING, PyBytes_CheckExact, PyBytes_GET_SIZE
from cpython.long cimport PyLong_AsLongAndOverflow, PyLong_CheckExact
from cpython.pythread cimport PyThread_get_thread_ident
from libc.stdint cimport int32_t, int64_t

from dstl._fast._buffer cimport ChangeBuffer, store_change
from dstl._fast._cutil cimport INT32_MAX

from dstl._fast._buffer_common import concurrent_append_error, writer_key_group
from dstl.errors import WriterClosedError


cdef inline bint _append_fast(ChangeBuffer buf, int32_t kg, const unsigned char* src, Py_ssize_t length) noexcept:
    """The common case of a writer's append, inline (room in its group's chunk and, when records are
    kept, in their arrays; the arena run going on; the buffer not busy): the stores of
    ChangeBuffer._add_raw without its call and checks. False, with nothing done, otherwise."""
    if buf.busy or (buf.records and buf.n >= buf.cap) or length > INT32_MAX or not buf.nruns \
            or buf.run_ptr[buf.nruns - 1] != NULL or buf.gpos[kg + 1] + 4 + length > buf.gend[kg + 1]:
        return False
    store_change(buf, kg, src, length)
    return True


cdef class WriterCore:
    """The append path of `FsStateChangelogWriter` (its base class): `append` and `append_meta` check
    the writer's state and key-group range and copy the change into the active buffer, all in C.

    No lock is taken: a writer is used from one thread (like Flink's, which is @NotThreadSafe), and
    under the GIL each append runs to completion before another thread can touch the buffer. The one
    part that runs Python code, the pre-emptive persist at the threshold (`_preemptive`, defined by
    the writer), records its thread; an append from another thread meanwhile raises RuntimeError.
    Twin: `WriterCore` in dstl/_fast/_writer_py.py (same checks, same errors, byte-identical buffer).
    """
    # fields and C methods: declared in _writer.pxd (`_append_raw` is the keyed-state kernel's entry)

    def __cinit__(self, *args, **kwargs):
        self._buffer = ChangeBuffer()
        self._kg_start = 0
        self._kg_end = -1

    cdef int _enter(self) except -1:
        if self._flusher != 0 and self._flusher != PyThread_get_thread_ident():
            raise concurrent_append_error(self, self._flusher, PyThread_get_thread_ident())
        if self._closed:
            raise WriterClosedError(f"changelog writer {self.log_id} is closed")
        return 0

    cdef int _after(self) except -1:
        """Pre-emptive persist once the active set reaches the threshold (Python, outside any lock)."""
        cdef unsigned long prev = self._flusher
        if self._buffer.payload < self._threshold:
            return 0
        self._flusher = PyThread_get_thread_ident()
        try:
            self._preemptive()
        finally:
            self._flusher = prev
        return 0

    @cython.binding(False)  # a plain method descriptor: `writer.append` is then called like a C function
    def append(self, key_group, data):
        """Add one data change; may upload pre-emptively (and then block on back-pressure)."""
        cdef long kg
        cdef int overflow = 0
        cdef ChangeBuffer buf = self._buffer
        if self._flusher != 0 or self._closed:
            self._enter()  # raises, unless this thread is the one inside the pre-emptive persist
        if not PyLong_CheckExact(key_group):
            key_group = writer_key_group(key_group)  # TypeError for non-integers
        kg = PyLong_AsLongAndOverflow(key_group, &overflow)
        if overflow or kg < self._kg_start or kg > self._kg_end:
            raise ValueError(f"key group {key_group!r} is outside the writer's range {self.key_group_range}")
        if PyBytes_CheckExact(data) and _append_fast(buf, <int32_t>kg, <const unsigned char*>PyBytes_AS_STRING(data),
                                                     PyBytes_GET_SIZE(data)):
            if buf.payload >= self._threshold:
                self._after()
            return
        buf._add(<int32_t>kg, data)
        self._after()

    cdef int _append_raw(self, long kg, const unsigned char* src, Py_ssize_t length) except -1:
        """`append(kg, src[:length])` for C callers (the keyed-state kernel): the same checks, errors and
        buffer contents, without a bytes object or a Python call."""
        cdef ChangeBuffer buf = self._buffer
        if self._flusher != 0 or self._closed:
            self._enter()
        if kg < self._kg_start or kg > self._kg_end:
            raise ValueError(f"key group {kg!r} is outside the writer's range {self.key_group_range}")
        if _append_fast(buf, <int32_t>kg, src, length):
            if buf.payload >= self._threshold:
                self._after()
            return 0
        buf._add_raw(<int32_t>kg, src, length)
        self._after()
        return 0

    @cython.binding(False)
    def append_meta(self, data):
        """Add one metadata change (key group -1; read back by every subtask on restore)."""
        self._enter()
        self._buffer._add(-1, data)
        self._after()

    def _take_active(self):
        """Seal the active change set: `(body, payload size, number of changes)`, or None when empty."""
        cdef ChangeBuffer buf = self._buffer
        cdef int64_t n = buf.n, size = buf.payload
        if n == 0:
            return None
        return buf.seal_body(), size, n
