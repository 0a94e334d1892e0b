# cython: language_level=3, boundscheck=False, wraparound=False, cdivision=True, initializedcheck=False
"""Cython change-set decoder (docs/format.md §4, §8). Twin: dstl/_fast/_decode_py.py (same results, same errors).

`scan` walks one change set in C, bounds-checking every field before reading it. Output goes into
arrays sized by a first counting pass, or (for objects) into buffers that grow geometrically with
the changes actually parsed, so no count read from the input is ever turned into an allocation.
"""
cimport cython
from cpython.buffer cimport PyBUF_SIMPLE, PyBuffer_Release, PyObject_GetBuffer
from cpython.bytes cimport PyBytes_FromStringAndSize
from cpython.list cimport PyList_New, PyList_SET_ITEM
from cpython.ref cimport Py_DECREF, Py_INCREF
from libc.stdint cimport int32_t, int64_t, uint32_t
from libc.stdlib cimport free, malloc, realloc
from libc.string cimport memcpy

import numpy as np

from dstl._fast._decode_py import ChangeSetInfo, check_offset, logical_view, range_bounds
from dstl.errors import CorruptChangelogError
from dstl._fast._change cimport StateChange, new_change

cdef enum Err:
    OK = 0
    TRUNC_G = 1
    NEG_G = 2
    BIG_G = 3
    TRUNC_GROUP = 4
    NEG_N = 5
    BAD_KG = 6
    BIG_N = 7
    TRUNC_LEN = 8
    NEG_LEN = 9
    BIG_LEN = 10
    NO_MEMORY = 11


cdef struct Out:
    int32_t* kg
    int64_t* off
    int64_t* len
    int64_t cap


cdef int grow(Out* o) noexcept nogil:
    cdef int64_t cap = o.cap * 2 if o.cap else 4096
    cdef void* p
    p = realloc(o.kg, cap * sizeof(int32_t))
    if p == NULL:
        return -1
    o.kg = <int32_t*>p
    p = realloc(o.off, cap * sizeof(int64_t))
    if p == NULL:
        return -1
    o.off = <int64_t*>p
    p = realloc(o.len, cap * sizeof(int64_t))
    if p == NULL:
        return -1
    o.len = <int64_t*>p
    o.cap = cap
    return 0


cdef struct Scan:
    int64_t end          # offset just after the change set
    int64_t groups
    int64_t changes
    int64_t size
    int64_t kept         # changes inside the key-group filter (meta always kept)
    int err
    int64_t err_pos
    int64_t err_val
    int64_t err_rem


cdef inline int32_t rd32(const unsigned char* p) noexcept nogil:
    return <int32_t>((<uint32_t>p[0] << 24) | (<uint32_t>p[1] << 16) | (<uint32_t>p[2] << 8) | <uint32_t>p[3])


cdef inline int fail(Scan* r, int code, int64_t pos, int64_t val, int64_t rem) noexcept nogil:
    r.err = code
    r.err_pos = pos
    r.err_val = val
    r.err_rem = rem
    return code


cdef int scan(const unsigned char* buf, int64_t end, int64_t pos, int lo, int hi, Scan* r,
              Out* out, int32_t* ogroups) noexcept nogil:
    """Walk the change set at `pos`; appends kept changes to `out` (when not NULL)."""
    cdef int64_t groups, g, count, j, p, n, k = 0
    cdef int32_t kg
    cdef bint keep
    r.err = OK
    r.changes = 0
    r.size = 0
    if end - pos < 4:
        return fail(r, TRUNC_G, pos, 0, end - pos)
    groups = rd32(buf + pos)
    if groups < 0:
        return fail(r, NEG_G, pos, groups, 0)
    if groups > (end - pos - 4) // 8:
        return fail(r, BIG_G, pos, groups, end - pos - 4)
    r.groups = groups
    p = pos + 4
    for g in range(groups):
        if end - p < 8:
            return fail(r, TRUNC_GROUP, p, 0, end - p)
        count = rd32(buf + p)
        kg = rd32(buf + p + 4)
        if count < 0:
            return fail(r, NEG_N, p, count, 0)
        if kg < -1 or kg > 32767:
            return fail(r, BAD_KG, p + 4, kg, 0)
        if count > (end - p - 8) // 4:
            return fail(r, BIG_N, p, count, end - p - 8)
        if ogroups != NULL:
            ogroups[g] = kg
        keep = kg == -1 or (lo <= kg and kg <= hi)
        p += 8
        for j in range(count):
            if end - p < 4:
                return fail(r, TRUNC_LEN, p, 0, end - p)
            n = rd32(buf + p)
            if n < 0:
                return fail(r, NEG_LEN, p, n, 0)
            if n > end - p - 4:
                return fail(r, BIG_LEN, p, n, end - p - 4)
            if keep:
                if out != NULL:
                    if k == out.cap and grow(out) != 0:
                        return fail(r, NO_MEMORY, p, 0, 0)
                    out.kg[k] = kg
                    out.off[k] = p + 4
                    out.len[k] = n
                k += 1
            p += 4 + n
            r.size += n
        r.changes += count
    r.end = p
    r.kept = k
    return OK


cdef raise_error(Scan* r):
    cdef int64_t v = r.err_val, rem = r.err_rem
    cdef int code = r.err
    if code == TRUNC_G:
        reason = f"truncated: group count needs 4 bytes, {rem} remain"
    elif code == NEG_G:
        reason = f"negative group count {v}"
    elif code == BIG_G:
        reason = f"group count {v} needs at least {8 * v} bytes, {rem} remain"
    elif code == TRUNC_GROUP:
        reason = f"truncated: group header needs 8 bytes, {rem} remain"
    elif code == NEG_N:
        reason = f"negative change count {v}"
    elif code == BAD_KG:
        reason = f"invalid key group {v}"
    elif code == BIG_N:
        reason = f"change count {v} needs at least {4 * v} bytes, {rem} remain"
    elif code == TRUNC_LEN:
        reason = f"truncated: change length needs 4 bytes, {rem} remain"
    elif code == NEG_LEN:
        reason = f"negative change length {v}"
    elif code == NO_MEMORY:
        raise MemoryError("out of memory while decoding a change set")
    else:
        reason = f"change length {v} runs past the end ({rem} bytes remain)"
    raise CorruptChangelogError(reason, r.err_pos)


cdef class _Bytes:
    """A held PyBUF_SIMPLE export of the logical stream (released when this object goes)."""
    cdef Py_buffer view
    cdef bint held
    cdef const unsigned char* buf
    cdef int64_t length

    def __cinit__(self, obj):
        self.held = False
        try:
            PyObject_GetBuffer(obj, &self.view, PyBUF_SIMPLE)
        except (TypeError, BufferError, ValueError):
            logical_view(obj)  # raises the twin's TypeError
            raise TypeError(f"the logical stream must be a contiguous bytes-like object, got {type(obj).__name__}")
        self.held = True
        self.buf = <const unsigned char*>self.view.buf
        self.length = self.view.len

    def __dealloc__(self):
        if self.held:
            PyBuffer_Release(&self.view)


cdef tuple _bounds(key_group_range):
    lo, hi = range_bounds(key_group_range)
    # clamp so the C ints cannot overflow; an empty range keeps metadata only
    return max(min(lo, 32768), -2), max(min(hi, 32768), -2)


def decode_change_set_arrays(logical, offset=0, key_group_range=None):
    """(key_groups int32, offsets int64, lengths int64, end_offset); offsets index into `logical`."""
    cdef _Bytes b = _Bytes(logical)
    cdef int64_t pos = check_offset(offset, b.length)
    cdef int lo, hi
    lo, hi = _bounds(key_group_range)
    cdef Scan r
    cdef Out out
    # two passes (count, then fill the numpy arrays in place) beat one pass into growing buffers:
    # the counting pass only reads, and the result is written exactly once
    with nogil:
        scan(b.buf, b.length, pos, lo, hi, &r, NULL, NULL)
    if r.err:
        raise_error(&r)
    kgs = np.empty(r.kept, dtype=np.int32)
    offs = np.empty(r.kept, dtype=np.int64)
    lens = np.empty(r.kept, dtype=np.int64)
    cdef int32_t[::1] k = kgs
    cdef int64_t[::1] o = offs
    cdef int64_t[::1] n = lens
    if r.kept:
        out.kg = &k[0]
        out.off = &o[0]
        out.len = &n[0]
        out.cap = r.kept  # exact: the second pass never grows (or frees) these numpy buffers
        with nogil:
            scan(b.buf, b.length, pos, lo, hi, &r, &out, NULL)
    return kgs, offs, lens, r.end


def decode_change_set(logical, offset=0, key_group_range=None):
    """The changes of the change set at `offset` (stream order) and the offset just after it."""
    cdef ChangeIterator it = iter_change_set(logical, offset, key_group_range)
    cdef int64_t i, kept = it.count
    cdef object change
    result = PyList_New(kept)
    # StateChange objects are not tracked by the cyclic GC: building many of them triggers no collection
    for i in range(kept):
        change = it._next()
        Py_INCREF(change)
        PyList_SET_ITEM(result, i, change)
    it.close()
    return result, it.end


@cython.final
cdef class ChangeIterator:
    """The changes of one change set, built one at a time as they are asked for (`iter_change_set`).

    The change set is scanned (and every field checked) when the iterator is made, so errors come
    first; each `next` then reads the next record straight from the held buffer (already checked:
    no array of offsets is built) and makes one `StateChange`. Holds an export of the logical
    stream until it is exhausted or closed.
    """
    cdef _Bytes b
    cdef const unsigned char* buf
    cdef int64_t p          # the next record's length field, or the next group's header when left == 0
    cdef int64_t left       # records left in the current (kept) group
    cdef int32_t kg
    cdef int lo, hi
    cdef int64_t i
    cdef readonly int64_t count
    cdef readonly int64_t end

    cdef inline StateChange _next(self):
        """The next kept change; only called while i < count (so a kept record lies ahead)."""
        cdef const unsigned char* buf = self.buf
        cdef int64_t p = self.p, c, j
        cdef int32_t kg, n
        while self.left == 0:
            c = rd32(buf + p)
            kg = rd32(buf + p + 4)
            p += 8
            if kg == -1 or (self.lo <= kg and kg <= self.hi):
                self.left = c
                self.kg = kg
            else:
                for j in range(c):  # a group outside the range: skip its records
                    p += 4 + rd32(buf + p)
        self.p = p
        n = rd32(buf + p)
        data = PyBytes_FromStringAndSize(<const char*>(buf + p + 4), n)
        self.p = p + 4 + n
        self.left -= 1
        self.i += 1
        return new_change(self.kg, data)

    def __iter__(self):
        return self

    def __next__(self):
        if self.i < self.count:
            return self._next()
        self.close()
        raise StopIteration

    def __len__(self):
        """Changes not yet returned."""
        return self.count - self.i

    def close(self):
        """Release the logical stream; the iterator is exhausted afterwards."""
        self.count = self.i = 0
        self.buf = NULL
        self.b = None


def iter_change_set(logical, offset=0, key_group_range=None):
    """An iterator of the changes of the change set at `offset` (stream order; `.end` is the offset
    just after it). Malformed input raises here, before the first change."""
    cdef ChangeIterator it = ChangeIterator.__new__(ChangeIterator)
    cdef _Bytes b = _Bytes(logical)
    cdef int64_t pos = check_offset(offset, b.length)
    cdef int lo, hi
    lo, hi = _bounds(key_group_range)
    cdef Scan r
    with nogil:
        scan(b.buf, b.length, pos, lo, hi, &r, NULL, NULL)
    if r.err:
        raise_error(&r)
    it.b = b
    it.buf = b.buf
    it.p = pos + 4
    it.left = 0
    it.lo = lo
    it.hi = hi
    it.count = r.kept
    it.end = r.end
    return it


@cython.final
cdef class ChangeChain:
    """`itertools.chain.from_iterable` over the `ChangeIterator`s that `entries` yields (a handle's
    change sets, `chain_changes`): each change comes straight from the current change set, without a
    second iterator call per change. Each exhausted change set is closed before the next is asked for.
    """
    cdef object entries     # the iterator of ChangeIterators; None once exhausted
    cdef ChangeIterator cur

    def __iter__(self):
        return self

    def __next__(self):
        cdef ChangeIterator cur = self.cur
        if cur is not None and cur.i < cur.count:
            return cur._next()
        return self._advance()

    cdef _advance(self):
        cdef ChangeIterator cur
        while self.entries is not None:
            if self.cur is not None:
                self.cur.close()
                self.cur = None
            try:
                item = next(self.entries)
            except StopIteration:
                self.entries = None
                break
            if type(item) is not ChangeIterator:
                self.entries = None
                raise TypeError(f"chain_changes: expected a ChangeIterator, got {type(item).__name__}")
            cur = self.cur = <ChangeIterator>item
            if cur.i < cur.count:
                return cur._next()
        raise StopIteration


def chain_changes(entries):
    """The changes of every `ChangeIterator` that `entries` yields, in order (one C iterator)."""
    cdef ChangeChain chain = ChangeChain.__new__(ChangeChain)
    chain.entries = iter(entries)
    return chain


def walk(logical):
    """Every change set of a whole logical stream; the last must end exactly at its end (docs/format.md §5.8)."""
    cdef _Bytes b = _Bytes(logical)
    cdef int64_t pos = 0
    cdef Scan r
    cdef int32_t* groups
    cdef int64_t g
    infos = []
    while pos < b.length:
        with nogil:
            scan(b.buf, b.length, pos, 0, -1, &r, NULL, NULL)
        if r.err:
            raise_error(&r)
        groups = <int32_t*>malloc((r.groups + 1) * sizeof(int32_t))
        if groups == NULL:
            raise MemoryError()
        try:
            with nogil:
                scan(b.buf, b.length, pos, 0, -1, &r, NULL, groups)
            order = tuple([groups[g] for g in range(r.groups)])
        finally:
            free(groups)
        infos.append(ChangeSetInfo(pos, r.end - pos, r.groups, r.changes, r.size, order))
        pos = r.end
    return infos

