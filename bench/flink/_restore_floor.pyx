# cython: language_level=3, boundscheck=False, wraparound=False
"""The floor of restoring as objects, for bench/flink/restore_ab.py (compiled by it, never shipped):
a C iterator over the same payloads that returns one object it keeps (the loop and the call alone),
a new `bytes` per change, or a new `bytes` and a new `StateChange` per change (`new_change`, as the
decoder makes them), with no parsing or checking at all."""
from cpython.buffer cimport PyBUF_SIMPLE, PyBuffer_Release, PyObject_GetBuffer
from cpython.bytes cimport PyBytes_FromStringAndSize
from libc.stdint cimport int64_t

from dstl._fast._change cimport new_change


cdef class Floor:
    cdef Py_buffer view
    cdef bint held
    cdef object obj
    cdef int64_t i, n, size
    cdef int mode

    def __cinit__(self, data, int64_t n, int64_t size, int mode):
        PyObject_GetBuffer(data, &self.view, PyBUF_SIMPLE)
        self.held = True
        if n * size > self.view.len:
            raise ValueError("data too short")
        self.n, self.size, self.mode = n, size, mode
        self.obj = new_change(0, b"")

    def __dealloc__(self):
        if self.held:
            PyBuffer_Release(&self.view)

    def __iter__(self):
        return self

    def __next__(self):
        cdef int64_t i = self.i
        cdef const char* p
        if i >= self.n:
            raise StopIteration
        self.i = i + 1
        if self.mode == 0:
            return self.obj
        p = (<const char*>self.view.buf) + i * self.size
        if self.mode == 1:
            return PyBytes_FromStringAndSize(p, self.size)
        return new_change(<int>(i & 127), PyBytes_FromStringAndSize(p, self.size))
