# cython: language_level=3, boundscheck=False, wraparound=False, cdivision=True, initializedcheck=False
"""Cython change buffer: appends go into one malloc arena plus int arrays (key group, offset,
length); `seal` is a counting sort by key group followed by one scatter copy into the body.
Per-record appends copy each change as [length][payload] into its key group's chunk of the arena,
so a file write can take a sealed body's groups as they are (`write_bodies`: writev).

`append_many` on an immutable source (bytes, pyarrow.Buffer, or a memoryview of either) keeps a
reference instead of copying: the payload is then copied exactly once, by `seal`. Records are
organised in runs; a run's payload lives in the arena or in one such source.

Twin: dstl/_fast/_buffer_py.py (byte-identical output, same errors; `coerce_many` is shared).
"""
cimport cython
from cpython.buffer cimport PyBUF_SIMPLE, PyBUF_WRITABLE, PyBuffer_Release, PyObject_GetBuffer
from cpython.bytes cimport PyBytes_AS_STRING, PyBytes_CheckExact, PyBytes_FromStringAndSize, PyBytes_GET_SIZE
from cpython.long cimport PyLong_AsLongAndOverflow, PyLong_CheckExact
from cpython.pythread cimport PyThread_get_thread_ident
from libc.stdint cimport int32_t, int64_t, intptr_t, uint32_t
from libc.stdlib cimport calloc, free, malloc, realloc
from libc.string cimport memcpy, memset

import operator
import os

import numpy as np

from dstl._fast._buffer_py import byte_view, check_key_group, coerce_many, writable_view

cdef enum:
    NSLOTS = 32769          # key groups -1..32767, slot = kg + 1
    KEEP_ARENA = 8 << 20    # clear() keeps at most this much arena for reuse
    CHUNK_MAX = 16 << 10    # a group's largest chunk: a writev of 16 KiB pieces copies as fast as one write()
    SPAN_MIN = 512          # bytes per iovec, on average, below which a body is laid out instead

cdef int64_t INT32_MAX = 2147483647

cdef extern from "Python.h":
    ctypedef struct PyByteArrayObject:
        Py_ssize_t ob_exports

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


cdef enum:
    SPARE_RECORDS = 32      # record arrays / arenas of sealed bodies kept for the next change sets
    SPARE_ARENAS = 32
    SPARE_RECORDS_MAX = 1 << 18  # records (16 B each) in one kept set of arrays
    SPARE_RECORD_BYTES = 32 << 20   # idle record arrays kept, at most
    SPARE_ARENA_BYTES = 160 << 20   # idle arenas kept, at most: 20 of the default threshold's 8 MiB

# Sealed bodies take over the buffer's record arrays and arena; when a body is dropped (its upload
# is done) they come back here, so the next change sets reuse memory that is already mapped instead
# of growing fresh arrays page fault by page fault. A per-record loop runs ahead of its uploads by
# up to the in-flight limit (100 MiB by default, 20 change sets), and the uploads return them in a
# burst: the pool keeps what was in flight at the peak (docs/benchmarks.md). Only touched with the
# GIL held; a closing storage empties it (`release_spares`).
cdef int32_t* spare_kgs[SPARE_RECORDS]
cdef int64_t* spare_offs[SPARE_RECORDS]
cdef int32_t* spare_lens[SPARE_RECORDS]
cdef int64_t spare_cap[SPARE_RECORDS]
cdef int nspare_records = 0
cdef int64_t spare_records_bytes = 0
cdef unsigned char* spare_arena[SPARE_ARENAS]
cdef int64_t spare_arena_cap[SPARE_ARENAS]
cdef int nspare_arenas = 0
cdef int64_t spare_arena_bytes = 0


cdef void donate_records(int32_t* kgs, int64_t* offs, int32_t* lens, int64_t cap) noexcept:
    global nspare_records, spare_records_bytes
    if kgs != NULL and offs != NULL and lens != NULL and nspare_records < SPARE_RECORDS \
            and cap <= SPARE_RECORDS_MAX and spare_records_bytes + 16 * cap <= SPARE_RECORD_BYTES:
        spare_records_bytes += 16 * cap
        spare_kgs[nspare_records] = kgs
        spare_offs[nspare_records] = offs
        spare_lens[nspare_records] = lens
        spare_cap[nspare_records] = cap
        nspare_records += 1
    else:
        free(kgs)
        free(offs)
        free(lens)


cdef void donate_arena(unsigned char* arena, int64_t cap) noexcept:
    global nspare_arenas, spare_arena_bytes
    if arena != NULL and nspare_arenas < SPARE_ARENAS and cap <= KEEP_ARENA \
            and spare_arena_bytes + cap <= SPARE_ARENA_BYTES:
        spare_arena_bytes += cap
        spare_arena[nspare_arenas] = arena
        spare_arena_cap[nspare_arenas] = cap
        nspare_arenas += 1
    else:
        free(arena)


def spare_bytes():
    """Idle memory kept for the next change sets' records and arenas (0 in the twin, which keeps none)."""
    return spare_records_bytes + spare_arena_bytes


def release_spares():
    """Free the idle memory kept for the next change sets (a closing storage calls this)."""
    global nspare_records, nspare_arenas, spare_records_bytes, spare_arena_bytes
    while nspare_records:
        nspare_records -= 1
        free(spare_kgs[nspare_records])
        free(spare_offs[nspare_records])
        free(spare_lens[nspare_records])
    while nspare_arenas:
        nspare_arenas -= 1
        free(spare_arena[nspare_arenas])
    spare_records_bytes = spare_arena_bytes = 0


def _immutable(data):
    """Whether `data` can be referenced instead of copied (nobody can change it afterwards)."""
    if type(data) is bytes:
        return True
    if type(data) is memoryview:
        return data.readonly and type(data.obj) is bytes
    cls = type(data)
    return cls.__name__ == "Buffer" and cls.__module__ == "pyarrow.lib"  # Arrow memory is immutable


cdef object _I32 = np.dtype(np.int32)
cdef object _I64 = np.dtype(np.int64)


cdef inline bint _plain_arrays(key_groups, offsets):
    """int32 key groups and int64 offsets, one-dimensional and contiguous (what Arrow and numpy callers
    pass): usable as they are."""
    return (type(key_groups) is np.ndarray and type(offsets) is np.ndarray
            and key_groups.dtype is _I32 and offsets.dtype is _I64
            and key_groups.ndim == 1 and offsets.ndim == 1
            and key_groups.flags.c_contiguous and offsets.flags.c_contiguous
            and offsets.shape[0] == key_groups.shape[0] + 1 and key_groups.shape[0] > 0)


cdef bint _valid_rows(const int32_t[::1] k, const int64_t[::1] o, data_view):
    """Every row valid (coerce_many's checks): key groups in -1..32767, offsets inside the data, not
    decreasing, lengths within int32. False sends the call to coerce_many, which names the bad row."""
    cdef int64_t m = k.shape[0], i, length
    cdef int64_t nbytes = len(data_view)
    cdef bint ok = True
    with nogil:
        if o[0] < 0 or o[m] > nbytes:
            ok = False
        else:
            for i in range(m):
                length = o[i + 1] - o[i]
                if k[i] < -1 or k[i] > 32767 or length < 0 or length > INT32_MAX:
                    ok = False
                    break
    return ok


cdef inline int add_raw(ChangeBuffer self, int32_t kg, const unsigned char* src, Py_ssize_t length) except -1:
    """ChangeBuffer._add_raw, as a function that the class's own `_add` calls inline."""
    if self.busy:
        self._check_idle()
    if length > INT32_MAX:
        raise ValueError(f"change data of {length} bytes exceeds the int32 length field")
    if self.counts == NULL or (self.records and self.n >= self.cap):
        self._reserve(1, 0)
    if self.nruns == 0 or self.run_ptr[self.nruns - 1] != NULL:
        self._new_run(NULL)
    if self.gpos[kg + 1] + 4 + length > self.gend[kg + 1]:
        self._new_chunk(kg + 1, length)
    store_change(self, kg, src, length)
    return 0


cdef inline void store_change(ChangeBuffer buf, int32_t kg, const unsigned char* src, Py_ssize_t length) noexcept:
    """The stores of one change whose room is made: [length][payload] at the end of its group's chunk,
    its count, and its record if records are kept."""
    cdef int64_t p = buf.gpos[kg + 1]
    cdef int64_t next_p = p + 4 + length
    put_be32(buf.arena + p, <int32_t>length)
    memcpy(buf.arena + p + 4, src, length)
    buf.gpos[kg + 1] = next_p
    if buf.records:
        buf.kgs[buf.n] = kg
        buf.offs[buf.n] = p + 4
        buf.lens[buf.n] = <int32_t>length
    buf.n += 1
    buf.payload += length
    buf._count(kg + 1, 1)
    # the group's next change goes right after this one, many appends from now: fetch its lines for
    # writing meanwhile (the groups' chunks are written as interleaved streams, more than the hardware
    # prefetcher follows; without this an append took twice as long)
    if next_p + 128 <= buf.gend[kg + 1]:
        DSTL_PREFETCH_W(buf.arena + next_p + 64)
        DSTL_PREFETCH_W(buf.arena + next_p + 128)


cdef inline int64_t chunk_end(ChangeBuffer buf, int64_t k) noexcept:
    """Where chunk k's changes end: a group's open chunk (end -1) ends where its next change would
    go. Left open until a later chunk of the group is carved, so sealing changes nothing in the
    buffer (a failed seal leaves it as it was)."""
    cdef int64_t end = buf.chunks[3 * k + 2]
    return end if end >= 0 else buf.gpos[buf.chunks[3 * k]]


cdef class ChangeBuffer:
    """Accumulates changes and seals them into one canonical change-set body (docs/format.md §4)."""

    # fields and C methods: declared in _buffer.pxd (the keyed-state kernel cimports this class)

    def __cinit__(self):
        self.arena = NULL
        self.kgs = NULL
        self.offs = NULL
        self.lens = NULL
        self.counts = NULL
        self.arena_len = self.arena_cap = self.n = self.cap = 0
        self.num_groups = 0
        self.payload = 0
        self.min_slot = NSLOTS
        self.max_slot = -1
        self.busy = False
        self.run_first = NULL
        self.run_ptr = NULL
        self.nruns = self.runs_cap = 0
        self.sources = []
        self.gpos = self.gend = self.gcur = NULL
        self.chunks = NULL
        self.nchunks = self.chunks_cap = 0
        self.ungrouped = 0
        self.records = False

    def __dealloc__(self):
        free(self.gpos)  # gend and gcur share its allocation
        free(self.chunks)
        free(self.run_first)
        free(<void*>self.run_ptr)
        free(self.arena)
        free(self.kgs)
        free(self.offs)
        free(self.lens)
        free(self.counts)

    cdef int _reserve(self, int64_t records, int64_t nbytes) except -1:
        cdef int64_t want, new_cap
        cdef void* p
        if self.counts == NULL:
            self.counts = <int64_t*>calloc(NSLOTS, sizeof(int64_t))
            self.gpos = <int64_t*>calloc(3 * NSLOTS, sizeof(int64_t))  # pages of unused slots stay untouched
            if self.counts == NULL or self.gpos == NULL:
                free(self.counts)
                free(self.gpos)
                self.counts = self.gpos = NULL
                raise MemoryError()
            self.gend = self.gpos + NSLOTS
            self.gcur = self.gpos + 2 * NSLOTS
        global nspare_records, nspare_arenas, spare_records_bytes, spare_arena_bytes
        if self.records and self.cap == 0 and self.kgs == NULL and nspare_records:
            nspare_records -= 1
            spare_records_bytes -= 16 * spare_cap[nspare_records]
            self.kgs = spare_kgs[nspare_records]
            self.offs = spare_offs[nspare_records]
            self.lens = spare_lens[nspare_records]
            self.cap = spare_cap[nspare_records]
        if self.arena_cap == 0 and self.arena == NULL and nbytes and nspare_arenas:
            nspare_arenas -= 1
            spare_arena_bytes -= spare_arena_cap[nspare_arenas]
            self.arena = spare_arena[nspare_arenas]
            self.arena_cap = spare_arena_cap[nspare_arenas]
        want = self.n + records
        if self.records and want > self.cap:
            new_cap = self.cap * 2 if self.cap else 1024
            if new_cap < want:
                new_cap = want
            p = realloc(self.kgs, new_cap * sizeof(int32_t))
            if p == NULL:
                raise MemoryError()
            self.kgs = <int32_t*>p
            p = realloc(self.lens, new_cap * sizeof(int32_t))
            if p == NULL:
                raise MemoryError()
            self.lens = <int32_t*>p
            p = realloc(self.offs, new_cap * sizeof(int64_t))
            if p == NULL:
                raise MemoryError()
            self.offs = <int64_t*>p
            self.cap = new_cap
        want = self.arena_len + nbytes
        if want > self.arena_cap:
            new_cap = self.arena_cap * 2 if self.arena_cap else 65536
            if new_cap < want:
                new_cap = want
            p = realloc(self.arena, new_cap)
            if p == NULL:
                raise MemoryError()
            self.arena = <unsigned char*>p
            self.arena_cap = new_cap
            huge_pages(self.arena, new_cap)
        return 0

    cdef int _new_run(self, const unsigned char* base) except -1:
        cdef int64_t new_cap
        cdef void* p
        if self.nruns and self.run_ptr[self.nruns - 1] == base and base == NULL:
            return 0  # the arena run goes on
        if self.nruns == self.runs_cap:
            new_cap = self.runs_cap * 2 if self.runs_cap else 8
            p = realloc(self.run_first, new_cap * sizeof(int64_t))
            if p == NULL:
                raise MemoryError()
            self.run_first = <int64_t*>p
            p = realloc(<void*>self.run_ptr, new_cap * sizeof(unsigned char*))
            if p == NULL:
                raise MemoryError()
            self.run_ptr = <const unsigned char**>p
            self.runs_cap = new_cap
        self.run_first[self.nruns] = self.n
        self.run_ptr[self.nruns] = base
        self.nruns += 1
        return 0

    cdef int _new_chunk(self, int slot, int64_t length) except -1:
        """Room for a change of `length` bytes in the group's chunk: the chunk grows in place when it is
        the last one carved, else a new one is carved, twice the size of the group's last (at most
        CHUNK_MAX) or just the change's: few iovecs per group, and no slack for a group of one change."""
        cdef int64_t need = 4 + length, size = 0, k
        cdef void* p
        if self.gend[slot]:
            size = 2 * (self.gend[slot] - self.chunks[3 * self.gcur[slot] + 1])
            if size > CHUNK_MAX:
                size = CHUNK_MAX
        if size < need:
            size = need
        if self.arena_len + size > self.arena_cap:
            self._reserve(0, size)
        if self.gend[slot] and self.gend[slot] == self.arena_len:
            self.gend[slot] += size
            self.arena_len += size
            return 0
        if self.nchunks == self.chunks_cap:
            k = self.chunks_cap * 2 if self.chunks_cap else 256
            p = realloc(self.chunks, 3 * k * sizeof(int64_t))
            if p == NULL:
                raise MemoryError()
            self.chunks = <int64_t*>p
            self.chunks_cap = k
        if self.gend[slot]:
            self.chunks[3 * self.gcur[slot] + 2] = self.gpos[slot]
        k = self.nchunks
        self.chunks[3 * k] = slot
        self.chunks[3 * k + 1] = self.arena_len
        self.chunks[3 * k + 2] = -1  # open: its end is the group's gpos
        self.nchunks += 1
        self.gcur[slot] = k
        self.gpos[slot] = self.arena_len
        self.gend[slot] = self.arena_len + size
        self.arena_len += size
        return 0

    cdef int _records(self) except -1:
        """Keep records from now on, reading those of the changes held from their chunks: each
        group's chunks, in the order they were carved, hold its changes in append order, which is
        all a layout needs (groups are laid out one after another)."""
        cdef int64_t k, i = 0, p, end, length
        cdef int32_t kg
        if self.records:
            return 0
        self.records = True  # _reserve sizes record arrays only then
        try:
            self._reserve(0, 0)  # arrays for the n changes held
        except BaseException:
            self.records = False  # the arrays hold nothing yet: a later call starts over
            raise
        for k in range(self.nchunks):
            kg = <int32_t>self.chunks[3 * k] - 1
            p = self.chunks[3 * k + 1]
            end = chunk_end(self, k)
            while p < end and i < self.n:
                length = get_be32(self.arena + p)
                self.kgs[i] = kg
                self.offs[i] = p + 4
                self.lens[i] = <int32_t>length
                p += 4 + length
                i += 1
        if i != self.n:  # a walk that disagrees with the count must not lay out a torn body
            self.records = False
            raise RuntimeError(f"ChangeBuffer: its chunks hold {i} changes, it holds {self.n}")
        return 0

    cdef inline void _count(self, int slot, int64_t k) noexcept nogil:
        if self.counts[slot] == 0:
            self.num_groups += 1
            if slot < self.min_slot:
                self.min_slot = slot
            if slot > self.max_slot:
                self.max_slot = slot
        self.counts[slot] += k

    cdef int _check_idle(self) except -1:
        if self.busy:
            raise RuntimeError("ChangeBuffer is in use by another thread (seal or append_many in progress)")
        return 0

    @cython.binding(False)  # called per record: a plain method descriptor, without a bound-method object
    def append(self, key_group, data):
        """Add one change; `key_group` -1 is metadata."""
        cdef long kg
        cdef int overflow = 0
        if PyLong_CheckExact(key_group):
            kg = PyLong_AsLongAndOverflow(key_group, &overflow)
            if overflow or kg < -1 or kg > 32767:
                check_key_group(key_group)  # raises the ValueError
        else:
            kg = check_key_group(key_group)
        self._add(<int32_t>kg, data)

    cdef int _add(self, int32_t kg, object data) except -1:
        """Copy one change (key group already checked) into the arena."""
        cdef Py_buffer view
        if self.busy:
            self._check_idle()
        if PyBytes_CheckExact(data):
            return add_raw(self, kg, <const unsigned char*>PyBytes_AS_STRING(data), PyBytes_GET_SIZE(data))
        if isinstance(data, str):
            byte_view(data)  # raises the twin's TypeError
        try:
            PyObject_GetBuffer(data, &view, PyBUF_SIMPLE)
        except (TypeError, BufferError, ValueError):
            byte_view(data)  # raises the twin's TypeError
            raise TypeError(f"change data must be a contiguous bytes-like object, got {type(data).__name__}")
        try:
            add_raw(self, kg, <const unsigned char*>view.buf, view.len)
        finally:
            PyBuffer_Release(&view)
        return 0

    cdef int _add_raw(self, int32_t kg, const unsigned char* src, Py_ssize_t length) except -1:
        """Copy `length` bytes at `src` as one change (key group already checked) into the arena."""
        return add_raw(self, kg, src, length)

    def append_many(self, key_groups, data, offsets):
        """Add n changes given in Arrow's binary layout (key groups, one data buffer, n+1 offsets); all-or-nothing."""
        cdef const int32_t[::1] k
        cdef const int64_t[::1] o
        if _plain_arrays(key_groups, offsets) and _valid_rows(key_groups, offsets, data_view := byte_view(data, "data")):
            k, o = key_groups, offsets  # the common case, checked in one C pass instead of numpy's several
        else:
            kg_arr, data_view, off_arr = coerce_many(key_groups, data, offsets)  # converts, or names the bad row
            k = np.ascontiguousarray(kg_arr, dtype=np.int32)
            o = np.ascontiguousarray(off_arr, dtype=np.int64)
        cdef int64_t m = k.shape[0]
        cdef int64_t i, first, nbytes, base, shift, n0
        cdef int32_t kv
        cdef Py_buffer view
        cdef bint by_reference = _immutable(data)
        if m == 0:
            return
        self._check_idle()
        self._records()
        first = o[0]
        nbytes = o[m] - first
        PyObject_GetBuffer(data_view, &view, PyBUF_SIMPLE)
        try:
            n0 = self.n
            if by_reference:
                # data_view holds the source's buffer export, so view.buf stays valid while it is listed
                self._reserve(m, 0)
                self._new_run(<const unsigned char*>view.buf)
                self.sources.append(data_view)
                shift = 0
                nbytes = 0
            else:
                self._reserve(m, nbytes)
                self._new_run(NULL)
                shift = self.arena_len - first
            base = self.arena_len
            self.busy = True  # the GIL is released below: other threads must not touch the arrays
            with nogil:
                if nbytes:
                    memcpy(self.arena + base, (<const unsigned char*>view.buf) + first, nbytes)
                for i in range(m):
                    kv = k[i]
                    self.kgs[n0 + i] = kv
                    self.offs[n0 + i] = o[i] + shift
                    self.lens[n0 + i] = <int32_t>(o[i + 1] - o[i])
                    self._count(kv + 1, 1)
            self.n += m
            self.ungrouped += m
            self.arena_len += nbytes
            self.payload += o[m] - first
        finally:
            self.busy = False
            PyBuffer_Release(&view)

    def __len__(self):
        return self.n

    @property
    def size(self):
        """Payload bytes held (docs/format.md §2 size)."""
        return self.payload

    @property
    def encoded_size(self):
        """Length of the body `seal()` would return: 4 + 8·G + 4·C + size."""
        return 4 + 8 * self.num_groups + 4 * self.n + self.payload

    def key_groups(self):
        """Distinct key groups held, in canonical (group) order."""
        cdef int slot
        if self.counts == NULL:
            return []
        return [slot - 1 for slot in range(self.min_slot, self.max_slot + 1) if self.counts[slot]]

    cdef int _write(self, unsigned char* dst) except -1:
        """Counting sort by key group: group starts from the counts, then one scatter pass."""
        cdef int64_t span, i, p, slot, c, r, stop
        cdef int64_t* cursor
        cdef const unsigned char* src
        cdef int lo = self.min_slot
        put_be32(dst, <int32_t>self.num_groups)
        if self.n == 0:
            return 0
        self._records()
        span = self.max_slot - lo + 1
        cursor = <int64_t*>malloc(span * sizeof(int64_t))
        if cursor == NULL:
            raise MemoryError()
        with nogil:
            memset(cursor, 0, span * sizeof(int64_t))
            for i in range(self.n):  # payload bytes per group
                cursor[self.kgs[i] + 1 - lo] += self.lens[i]
            p = 4
            for slot in range(span):
                c = self.counts[slot + lo]
                if c:
                    put_be32(dst + p, <int32_t>c)
                    put_be32(dst + p + 4, <int32_t>(slot + lo - 1))
                    c = p + 8 + 4 * c + cursor[slot]
                    cursor[slot] = p + 8
                    p = c
            for r in range(self.nruns):  # append order kept inside each group
                src = self.run_ptr[r] if self.run_ptr[r] != NULL else self.arena
                stop = self.run_first[r + 1] if r + 1 < self.nruns else self.n
                for i in range(self.run_first[r], stop):
                    slot = self.kgs[i] + 1 - lo
                    p = cursor[slot]
                    put_be32(dst + p, self.lens[i])
                    memcpy(dst + p + 4, src + self.offs[i], self.lens[i])
                    cursor[slot] = p + 4 + self.lens[i]
        free(cursor)
        return 0

    def seal(self):
        """The canonical change-set body; the buffer is empty afterwards."""
        self._check_idle()
        cdef int64_t total = 4 + 8 * self.num_groups + 4 * self.n + self.payload
        body = PyBytes_FromStringAndSize(NULL, total)
        huge_pages(PyBytes_AS_STRING(body), total)
        self.busy = True
        try:
            self._write(<unsigned char*>PyBytes_AS_STRING(body))
        finally:
            self.busy = False
        self.clear()
        return body

    def seal_body(self):
        """The canonical body as a `SealedBody`, without copying the payload: the body takes over the
        buffer's arena and its chunks or records (and its references to immutable sources) and writes
        the bytes only when it is streamed to a file (`write_to`). The buffer is empty afterwards."""
        self._check_idle()
        cdef SealedBody body = SealedBody.__new__(SealedBody)
        cdef int64_t r, i, stop
        cdef intptr_t base
        cdef int slot, g = 0
        body.total = 4 + 8 * self.num_groups + 4 * self.n + self.payload
        body.n = self.n
        body.num_groups = self.num_groups
        if self.n:
            body.groups = <int64_t*>malloc(2 * self.num_groups * sizeof(int64_t))
            if body.groups == NULL:
                raise MemoryError()
            for slot in range(self.min_slot, self.max_slot + 1):
                if self.counts[slot]:
                    body.groups[2 * g] = slot - 1
                    body.groups[2 * g + 1] = self.counts[slot]
                    g += 1
            if self.ungrouped == 0:
                chunks_to(self, body)
            if body.spans == NULL or self.records:
                self._records()
                # offsets become absolute addresses: the records then no longer need their runs
                for r in range(self.nruns):
                    base = <intptr_t>(self.run_ptr[r] if self.run_ptr[r] != NULL else self.arena)
                    stop = self.run_first[r + 1] if r + 1 < self.nruns else self.n
                    for i in range(self.run_first[r], stop):
                        self.offs[i] += base
                body.kgs, body.offs, body.lens, body.cap = self.kgs, self.offs, self.lens, self.cap
                self.kgs = NULL
                self.offs = NULL
                self.lens = NULL
                self.cap = 0
            body.arena, body.arena_cap = self.arena, self.arena_cap
            body.sources = self.sources
            self.arena = NULL
            self.arena_cap = 0
        self.clear()
        return body

    def seal_into(self, out, pos=0):
        """Write the body into the writable buffer `out` at `pos`; returns its length and empties the buffer."""
        cdef Py_buffer view
        cdef int64_t need, start
        self._check_idle()
        try:
            PyObject_GetBuffer(out, &view, PyBUF_WRITABLE)
        except (TypeError, BufferError, ValueError):
            writable_view(out)  # raises the twin's TypeError
            raise TypeError(f"out must be a writable contiguous buffer, got {type(out).__name__}")
        pos = pos.__index__()
        try:
            start = pos
            need = 4 + 8 * self.num_groups + 4 * self.n + self.payload
            if start < 0 or start + need > view.len:
                raise ValueError(
                    f"seal_into: {need} bytes do not fit at position {start} of a {view.len}-byte buffer")
            self.busy = True
            try:
                self._write((<unsigned char*>view.buf) + start)
            finally:
                self.busy = False
        finally:
            PyBuffer_Release(&view)
        self.clear()
        return need

    def clear(self):
        """Drop every change held."""
        self._check_idle()
        if self.counts != NULL and self.max_slot >= self.min_slot:
            memset(self.counts + self.min_slot, 0, (self.max_slot - self.min_slot + 1) * sizeof(int64_t))
            memset(self.gpos + self.min_slot, 0, (self.max_slot - self.min_slot + 1) * sizeof(int64_t))
            memset(self.gend + self.min_slot, 0, (self.max_slot - self.min_slot + 1) * sizeof(int64_t))
        self.min_slot = NSLOTS
        self.max_slot = -1
        self.num_groups = 0
        self.n = 0
        self.payload = 0
        self.arena_len = 0
        self.nruns = 0
        self.nchunks = 0
        self.ungrouped = 0
        self.records = False
        self.sources = []
        if self.arena_cap > KEEP_ARENA:  # do not pin a large arena in an idle buffer
            free(self.arena)
            self.arena = NULL
            self.arena_cap = 0
            free(self.kgs)
            free(self.offs)
            free(self.lens)
            self.kgs = NULL
            self.offs = NULL
            self.lens = NULL
            self.cap = 0

    def __repr__(self):
        return f"ChangeBuffer(changes={self.n}, size={self.payload}, cython)"


cdef enum:
    PREFETCH_AHEAD = 24     # records
    SPARE_WHOLES = 4        # whole-body buffers kept for reuse ...
    SPARE_BYTES = 48 << 20  # ... holding at most this much idle memory
    CHUNK = 1 << 20         # bytes per streamed piece: stays in L2/L3 between the fill and the write

cdef int64_t scatter_max = 16 << 20  # bodies up to this size are built whole in a reused buffer first


def _set_scatter_max(nbytes):
    """Tests: bodies up to `nbytes` use the whole-buffer path of write_to, larger ones the streamed
    gather; returns the previous limit."""
    global scatter_max
    old, scatter_max = scatter_max, nbytes
    return old


cdef _write_view(write, view):
    """Hand `view` to `write`, then release it; a callee that kept an export makes release fail: fine."""
    try:
        write(view)
    finally:
        try:
            view.release()
        except BufferError:
            pass


cdef list _spare_wholes = []  # reusable buffers for whole bodies up to scatter_max


cdef bytearray _take_whole(int64_t need):
    cdef Py_ssize_t i
    for i in range(len(_spare_wholes)):
        if len(<bytearray>_spare_wholes[i]) >= need:
            return _spare_wholes.pop(i)
    # rounded up so that bodies of similar size share buffers
    return bytearray(((need + (1 << 20) - 1) >> 20) << 20)


cdef void _give_whole(bytearray whole):
    if (<PyByteArrayObject*>whole).ob_exports:  # a write callback kept a view: never reuse it
        return
    # as many as upload threads typically write at once, within a bound on idle memory
    if len(_spare_wholes) < SPARE_WHOLES and sum(map(len, _spare_wholes)) + len(whole) <= SPARE_BYTES:
        _spare_wholes.append(whole)
    elif _spare_wholes:  # prefer keeping larger ones
        _spare_wholes.sort(key=len)
        if len(<bytearray>_spare_wholes[0]) < len(whole) and \
                sum(map(len, _spare_wholes)) - len(<bytearray>_spare_wholes[0]) + len(whole) <= SPARE_BYTES:
            _spare_wholes[0] = whole


cdef dict _spare_chunks = {}  # size -> reusable chunk buffers (touched already: no page faults on reuse)


cdef struct Cursor:
    int64_t phase           # 0 = count of groups, 1 = group header, 2 = records, 3 = done
    int64_t g               # current group
    int64_t r               # current position in order
    int64_t stop            # end of the current group in order
    int64_t done            # bytes of the current item already emitted


cdef inline void cursor_start(Cursor* c) noexcept nogil:
    c.phase = 0
    c.g = c.r = c.stop = c.done = 0


cdef inline int64_t copy_part(unsigned char* dst, int64_t room, const unsigned char* src, int64_t length,
                              int64_t* done) noexcept nogil:
    """Copy what fits of src[*done:length] to dst; returns the bytes copied."""
    cdef int64_t k = length - done[0]
    if k > room:
        k = room
    memcpy(dst, src + done[0], k)
    done[0] += k
    return k


cdef struct Rec:
    # one change in canonical order: where its payload is and how long it is (read sequentially by the
    # layout walk, instead of an index into two arrays read at random)
    const unsigned char* src
    int64_t length


cdef struct BodyRef:
    # the parts of a SealedBody that laying it out reads: plain C, so it can be used without the GIL
    int64_t total, n, num_groups
    const int32_t* kgs
    const int64_t* offs      # absolute payload addresses
    const int32_t* lens
    const int64_t* groups    # (key group, count) per group, canonical order
    const Rec* order         # NULL until SealedBody._order built it
    const unsigned char* arena
    const int64_t* spans     # the groups' chunks, or NULL (see SealedBody)
    const int64_t* gspans


cdef int scatter_body(const BodyRef* b, unsigned char* dst) noexcept nogil:
    """Write the whole body into dst in append order (each group gets a cursor): the payload is read
    sequentially, which is faster than the gather of `fill_body` when dst fits in the cache.
    0, or -1 when out of memory."""
    cdef int64_t* cursor
    cdef int64_t i, g, p, lo, span, c, length
    put_be32(dst, <int32_t>b.num_groups)
    if b.n == 0:
        return 0
    lo = b.groups[0]
    span = b.groups[2 * (b.num_groups - 1)] - lo + 1
    cursor = <int64_t*>malloc(span * sizeof(int64_t))
    if cursor == NULL:
        return -1
    memset(cursor, 0, span * sizeof(int64_t))
    for i in range(b.n):  # payload bytes per group
        cursor[b.kgs[i] - lo] += b.lens[i]
    p = 4
    for g in range(b.num_groups):
        c = b.groups[2 * g + 1]
        put_be32(dst + p, <int32_t>c)
        put_be32(dst + p + 4, <int32_t>b.groups[2 * g])
        c = p + 8 + 4 * c + cursor[b.groups[2 * g] - lo]
        cursor[b.groups[2 * g] - lo] = p + 8
        p = c
    for i in range(b.n):
        g = b.kgs[i] - lo
        p = cursor[g]
        length = b.lens[i]
        put_be32(dst + p, <int32_t>length)
        memcpy(dst + p + 4, <const unsigned char*>b.offs[i], length)
        cursor[g] = p + 4 + length
    free(cursor)
    return 0


cdef int64_t chunks_into(const BodyRef* b, unsigned char* dst) noexcept nogil:
    """Write the whole body from its groups' chunks (b.spans set): each group's header, then its
    chunks, which hold its changes as [length][payload] already. Returns the bytes written."""
    cdef int64_t p = 4, g, j, s = 0
    put_be32(dst, <int32_t>b.num_groups)
    for g in range(b.num_groups):
        put_be32(dst + p, <int32_t>b.groups[2 * g + 1])
        put_be32(dst + p + 4, <int32_t>b.groups[2 * g])
        p += 8
        for j in range(b.gspans[g]):
            memcpy(dst + p, b.arena + b.spans[2 * s], b.spans[2 * s + 1])
            p += b.spans[2 * s + 1]
            s += 1
    return p


cdef int64_t fill_body(const BodyRef* b, unsigned char* out, int64_t room, Cursor* c) noexcept nogil:
    """Write the next canonical bytes into out[:room]; returns how many (0 once done)."""
    cdef int64_t filled = 0, length, stop, ahead
    cdef int64_t n = b.n
    cdef unsigned char tmp[8]
    cdef const unsigned char* src
    while filled < room and c.phase != 3:
        if c.phase == 0:
            put_be32(tmp, <int32_t>b.num_groups)
            filled += copy_part(out + filled, room - filled, tmp, 4, &c.done)
            if c.done == 4:
                c.done = 0
                c.phase = 1 if b.num_groups else 3
        elif c.phase == 1:
            put_be32(tmp, <int32_t>b.groups[2 * c.g + 1])
            put_be32(tmp + 4, <int32_t>b.groups[2 * c.g])
            filled += copy_part(out + filled, room - filled, tmp, 8, &c.done)
            if c.done == 8:
                c.done = 0
                c.phase = 2
                c.stop = c.r + b.groups[2 * c.g + 1]
        else:
            stop = c.stop
            while c.r < stop and filled < room:
                length = b.order[c.r].length
                src = b.order[c.r].src
                if c.done == 0 and room - filled >= 4 + length:  # the common case: whole record
                    ahead = c.r + PREFETCH_AHEAD
                    if ahead < n:  # the gather reads far apart records: ask for them early
                        DSTL_PREFETCH(b.order[ahead].src)
                        DSTL_PREFETCH(b.order[ahead].src + 64)
                    put_be32(out + filled, <int32_t>length)
                    memcpy(out + filled + 4, src, length)
                    filled += 4 + length
                    c.r += 1
                    continue
                if c.done < 4:
                    put_be32(tmp, <int32_t>length)
                    filled += copy_part(out + filled, room - filled, tmp, 4, &c.done)
                    if c.done < 4:
                        break
                c.done -= 4
                filled += copy_part(out + filled, room - filled, src, length, &c.done)
                if c.done < length:
                    c.done += 4
                    break
                c.done = 0
                c.r += 1
            if c.r == stop and c.done == 0:
                c.g += 1
                c.phase = 1 if c.g < b.num_groups else 3
    return filled


cdef class SealedBody:
    """A sealed change-set body that is produced while it is written (`ChangeBuffer.seal_body`).

    `len(body)` is its encoded size; `write_to(write)` calls `write(view)` with consecutive pieces of
    the canonical bytes (each view is only valid during the call); `bytes(body)` / the buffer protocol
    give the whole body (built once, on first use). Safe to stream from several threads at once.
    """
    cdef readonly int64_t total
    cdef int64_t n, num_groups
    cdef int32_t* kgs
    cdef int64_t* offs      # absolute payload addresses
    cdef int32_t* lens
    cdef unsigned char* arena
    cdef int64_t cap, arena_cap  # allocated sizes of the record arrays and the arena
    cdef int64_t* groups    # (key group, count) per group, canonical order
    cdef Rec* order         # the records in canonical order (built on first write)
    cdef int64_t* spans     # (arena offset, length) of each chunk in canonical order, or NULL
    cdef int64_t* gspans    # spans per group
    cdef int64_t nspans
    cdef list sources
    cdef object _bytes

    def __cinit__(self):
        self.kgs = NULL
        self.offs = NULL
        self.lens = NULL
        self.arena = NULL
        self.groups = NULL
        self.order = NULL
        self.spans = self.gspans = NULL
        self.nspans = 0
        self.cap = self.arena_cap = 0
        self.total = 4
        self.n = self.num_groups = 0
        self.sources = []
        self._bytes = None

    def __dealloc__(self):
        donate_records(self.kgs, self.offs, self.lens, self.cap)
        donate_arena(self.arena, self.arena_cap)
        free(self.groups)
        free(self.order)
        free(self.spans)
        free(self.gspans)

    def __len__(self):
        return self.total

    @property
    def _chunked(self):
        """Tests: whether the body is written from its groups' chunks as they are (no layout copy)."""
        return self.spans != NULL

    cdef int _scatter(self, unsigned char* dst) except -1:
        """Write the whole body into dst (see scatter_body; a body with chunks copies them)."""
        cdef BodyRef ref = body_ref(self)
        cdef int rc = 0
        if self.spans != NULL:
            return self._gather_into(dst)
        with nogil:
            rc = scatter_body(&ref, dst)
        if rc:
            raise MemoryError()
        return 0

    cdef int _gather_into(self, unsigned char* dst) except -1:
        """Write the whole body into dst in canonical order (sequential stores): into memory that is
        not in the cache (a shared-memory segment, a new bytes object) this beats `_scatter`, whose
        stores go to one place per key group (docs/benchmarks.md)."""
        cdef Cursor c
        cdef BodyRef ref
        cdef int64_t got
        if self.spans != NULL:
            ref = body_ref(self)
            with nogil:
                got = chunks_into(&ref, dst)
        else:
            self._order()
            ref = body_ref(self)
            cursor_start(&c)
            with nogil:
                got = fill_body(&ref, dst, self.total, &c)
        if got != self.total:  # the walk and the encoded size disagree: never write a torn body
            raise RuntimeError(f"sealed body produced {got} bytes, its length is {self.total}")
        return 0

    cdef int _order(self) except -1:
        """Stable counting sort of the records by group (called with the GIL: built exactly once)."""
        cdef int64_t* start
        cdef int64_t i, g, lo, span, k
        cdef Rec* order
        if self.order != NULL or self.n == 0:
            return 0
        if self.kgs == NULL:
            return self._order_chunks()
        lo = self.groups[0]
        span = self.groups[2 * (self.num_groups - 1)] - lo + 1
        start = <int64_t*>malloc(span * sizeof(int64_t))
        order = <Rec*>malloc(self.n * sizeof(Rec))
        if start == NULL or order == NULL:
            free(start)
            free(order)
            raise MemoryError()
        with nogil:
            i = 0
            for g in range(self.num_groups):
                start[self.groups[2 * g] - lo] = i
                i += self.groups[2 * g + 1]
            for i in range(self.n):
                g = self.kgs[i] - lo
                k = start[g]
                order[k].src = <const unsigned char*>self.offs[i]
                order[k].length = self.lens[i]
                start[g] = k + 1
        free(start)
        self.order = order
        return 0

    cdef int _order_chunks(self) except -1:
        """The canonical order of a body that keeps no records: its chunks, in canonical order, hold
        the changes as [length][payload]."""
        cdef int64_t s, k = 0, p, end
        cdef Rec* order = <Rec*>malloc(self.n * sizeof(Rec))
        if order == NULL:
            raise MemoryError()
        with nogil:
            for s in range(self.nspans):
                p = self.spans[2 * s]
                end = p + self.spans[2 * s + 1]
                while p < end and k < self.n:
                    order[k].length = get_be32(self.arena + p)
                    order[k].src = self.arena + p + 4
                    p += 4 + order[k].length
                    k += 1
        if k != self.n:
            free(order)
            raise RuntimeError(f"sealed body: its chunks hold {k} changes, it has {self.n}")
        self.order = order
        return 0

    def write_to(self, write, chunk_size=CHUNK):
        """Call `write(view)` with the body's bytes in order, `chunk_size` bytes at a time (the last
        piece may be shorter); each view is valid only during its call. Returns the bytes written."""
        cdef Cursor c
        cdef BodyRef ref
        cdef int64_t size = chunk_size, got, written = 0
        cdef unsigned char* ptr
        cdef bytearray chunk
        if size <= 0:
            raise ValueError(f"chunk_size must be positive, got {chunk_size}")
        if self._bytes is not None:
            view = memoryview(self._bytes)
            for pos in range(0, self.total, size):
                write(view[pos:pos + size])
            return self.total
        if self.total <= scatter_max:
            return self._write_scattered(write, size)
        self._order()
        ref = body_ref(self)
        cursor_start(&c)
        spares = _spare_chunks.get(size)
        chunk = spares.pop() if spares else bytearray(size)
        ptr = <unsigned char*>(<char*>chunk)
        while True:
            with nogil:
                got = fill_body(&ref, ptr, size, &c)
            if got == 0:
                break
            _write_view(write, memoryview(chunk)[:got])
            if (<PyByteArrayObject*>chunk).ob_exports:  # the callee kept a view: never reuse the chunk
                chunk = bytearray(size)
                ptr = <unsigned char*>(<char*>chunk)
            written += got
        if spares is None:
            if len(_spare_chunks) < 8:
                _spare_chunks[size] = [chunk]
        elif len(spares) < 4:
            spares.append(chunk)
        return written

    cdef int64_t _write_scattered(self, write, int64_t size) except -1:
        """Build the body in one reused cache-sized buffer (sequential payload reads), then write it."""
        cdef bytearray whole = _take_whole(self.total)
        cdef int64_t pos
        self._scatter(<unsigned char*>(<char*>whole))
        full = memoryview(whole)
        try:
            for pos in range(0, self.total, size):
                _write_view(write, full[pos:min(pos + size, self.total)])
        finally:
            full.release()
        _give_whole(whole)
        return self.total

    def write_into(self, out, pos=0):
        """Write the whole body into the writable buffer `out` at `pos` in one pass (no intermediate
        buffer: into a mapped shared-memory segment, it is the body's only copy); returns its length."""
        cdef Py_buffer view
        cdef int64_t start
        try:
            PyObject_GetBuffer(out, &view, PyBUF_WRITABLE)
        except (TypeError, BufferError, ValueError):
            writable_view(out)  # raises the twin's TypeError
            raise TypeError(f"out must be a writable contiguous buffer, got {type(out).__name__}")
        try:
            start = pos.__index__()
            if start < 0 or start + self.total > view.len:
                raise ValueError(f"write_into: {self.total} bytes do not fit at position {start} of a "
                                 f"{view.len}-byte buffer")
            if self._bytes is not None:
                memcpy((<unsigned char*>view.buf) + start, PyBytes_AS_STRING(self._bytes), self.total)
            else:
                self._gather_into((<unsigned char*>view.buf) + start)
        finally:
            PyBuffer_Release(&view)
        return self.total

    def tobytes(self):
        """The whole body as bytes (built once and kept)."""
        cdef Cursor c
        cdef int64_t got
        cdef unsigned char* dst
        if self._bytes is None:
            out = PyBytes_FromStringAndSize(NULL, self.total)
            dst = <unsigned char*>PyBytes_AS_STRING(out)
            huge_pages(dst, self.total)
            self._gather_into(dst)
            self._bytes = out
        return self._bytes

    def __bytes__(self):
        return self.tobytes()

    def __getbuffer__(self, Py_buffer* buffer, int flags):
        # the export is the built bytes object's own (buffer.obj is that object, which the view keeps)
        PyObject_GetBuffer(self.tobytes(), buffer, flags)

    def __reduce__(self):
        # a pickled body is its bytes (the records point into this process's memory)
        return (bytes, (self.tobytes(),))

    def __eq__(self, other):
        try:
            return self.tobytes() == bytes(memoryview(other))
        except TypeError:
            return NotImplemented

    __hash__ = None

    def __repr__(self):
        return f"SealedBody(groups={self.num_groups}, changes={self.n}, encoded={self.total})"



cdef int chunks_to(ChangeBuffer self, SealedBody body) except -1:
    """Give `body` the buffer's chunks in canonical order (stable counting sort by slot), as
    (start, length) spans with a span count per group. Left out when they do not add up to the body,
    or are so small (many groups of a few changes) that a writev of them would cost more than a
    layout: the body is then laid out record by record, as one with append_many's changes is."""
    cdef int64_t lo = self.min_slot, span = self.max_slot - self.min_slot + 1, i, k, g = 0, total
    cdef int64_t* at
    cdef int64_t* spans
    cdef int64_t* gspans
    cdef int slot
    at = <int64_t*>calloc(span + 1, sizeof(int64_t))
    spans = <int64_t*>malloc((2 * self.nchunks + 1) * sizeof(int64_t))
    gspans = <int64_t*>calloc(self.num_groups + 1, sizeof(int64_t))
    if at == NULL or spans == NULL or gspans == NULL:
        free(at)
        free(spans)
        free(gspans)
        raise MemoryError()
    for i in range(self.nchunks):  # every chunk holds a change: each is carved right before one is stored
        at[self.chunks[3 * i] - lo + 1] += 1
    for i in range(span):
        at[i + 1] += at[i]
    total = 4 + 8 * self.num_groups
    for i in range(self.nchunks):
        k = at[self.chunks[3 * i] - lo]
        at[self.chunks[3 * i] - lo] = k + 1
        spans[2 * k] = self.chunks[3 * i + 1]
        spans[2 * k + 1] = chunk_end(self, i) - self.chunks[3 * i + 1]
        total += spans[2 * k + 1]
    for slot in range(self.min_slot, self.max_slot + 1):
        if self.counts[slot]:
            gspans[g] = at[slot - lo] - (at[slot - lo - 1] if slot > lo else 0)
            g += 1
    free(at)
    if total != body.total or g != self.num_groups or total < SPAN_MIN * (self.nchunks + g + 1):
        free(spans)
        free(gspans)
        return 0
    body.spans, body.gspans, body.nspans = spans, gspans, self.nchunks
    return 0


cdef inline BodyRef body_ref(SealedBody body) noexcept:
    cdef BodyRef r
    r.total, r.n, r.num_groups = body.total, body.n, body.num_groups
    r.kgs, r.offs, r.lens, r.groups, r.order = body.kgs, body.offs, body.lens, body.groups, body.order
    r.arena, r.spans, r.gspans = body.arena, body.spans, body.gspans
    return r


cdef extern from "unistd.h" nogil:
    ssize_t c_write "write" (int fd, const void* buf, size_t count)
    int64_t c_lseek "lseek" (int fd, int64_t offset, int whence)
    int c_close "close" (int fd)
    int c_unlink "unlink" (const char* path)
    int c_ftruncate "ftruncate" (int fd, int64_t length)

cdef extern from "fcntl.h" nogil:
    int c_open "open" (const char* path, int flags, int mode)
    int c_fallocate "fallocate" (int fd, int mode, int64_t offset, int64_t length)
    int O_WRONLY, O_CLOEXEC, O_CREAT, O_EXCL
    int SEEK_SET

cdef enum:
    PREALLOCATE_MIN = 1 << 20  # smaller files gain nothing from reserving their blocks first

cdef extern from "errno.h" nogil:
    int errno
    int EINTR


cdef int write_all(const int* fds, int nfds, const unsigned char* p, int64_t n) noexcept nogil:
    """write(2) p[:n] in full to every fd; 0, or the errno of the first failure."""
    cdef int k
    cdef int64_t done
    cdef ssize_t got
    for k in range(nfds):
        done = 0
        while done < n:
            got = c_write(fds[k], p + done, <size_t>(n - done))
            if got < 0:
                if errno == EINTR:
                    continue
                return errno
            done += got
    return 0


cdef extern from "sys/uio.h" nogil:
    struct iovec:
        void* iov_base
        size_t iov_len
    ssize_t c_writev "writev" (int fd, const iovec* iov, int iovcnt)


cdef enum:
    MAX_FDS = 4
    IOVS = 512  # iovecs per writev (Linux allows 1024)


cdef int writev_all(const int* fds, int nfds, const iovec* iov, int cnt, int64_t n) noexcept nogil:
    """writev(2) the `cnt` iovecs (`n` bytes) in full to every fd (a short write is finished with
    write(2)); 0, or the errno of the first failure."""
    cdef int k, j, err
    cdef ssize_t got
    cdef int64_t skip
    for k in range(nfds):
        got = c_writev(fds[k], iov, cnt)
        while got < 0 and errno == EINTR:
            got = c_writev(fds[k], iov, cnt)
        if got < 0:
            return errno
        if got == n:
            continue
        skip = got
        for j in range(cnt):
            if skip >= <int64_t>iov[j].iov_len:
                skip -= iov[j].iov_len
                continue
            err = write_all(&fds[k], 1, (<const unsigned char*>iov[j].iov_base) + skip, iov[j].iov_len - skip)
            if err:
                return err
            skip = 0
    return 0


cdef int write_chunked(const int* fds, int nfds, const BodyRef* b, unsigned char* hdr) noexcept nogil:
    """Write a body that has its groups' chunks (b.spans set) to every fd: its headers go into `hdr`
    (4 + 8 bytes a group) and the chunks are written where they are, IOVS iovecs a writev: the
    payload is copied once, into the page cache, as a plain write() copies it."""
    cdef iovec iov[IOVS]
    cdef int cnt = 1, err
    cdef int64_t n = 4, g, j, s = 0
    cdef unsigned char* h
    put_be32(hdr, <int32_t>b.num_groups)
    iov[0].iov_base, iov[0].iov_len = hdr, 4
    for g in range(b.num_groups):
        h = hdr + 4 + 8 * g
        put_be32(h, <int32_t>b.groups[2 * g + 1])
        put_be32(h + 4, <int32_t>b.groups[2 * g])
        if cnt == IOVS:
            err = writev_all(fds, nfds, iov, cnt, n)
            if err:
                return err
            cnt, n = 0, 0
        iov[cnt].iov_base, iov[cnt].iov_len = h, 8
        cnt += 1
        n += 8
        for j in range(b.gspans[g]):
            if cnt == IOVS:
                err = writev_all(fds, nfds, iov, cnt, n)
                if err:
                    return err
                cnt, n = 0, 0
            iov[cnt].iov_base, iov[cnt].iov_len = <void*>(b.arena + b.spans[2 * s]), b.spans[2 * s + 1]
            cnt += 1
            n += b.spans[2 * s + 1]
            s += 1
    return writev_all(fds, nfds, iov, cnt, n) if cnt else 0


cdef int64_t piece_size = 512 << 10  # write_bodies' piece: produced and written while in the L2 cache


def _set_piece_size(nbytes):
    """Benchmarks and tests: the piece size of write_bodies; returns the previous one."""
    global piece_size
    if nbytes <= 0:
        raise ValueError(f"piece size must be positive, got {nbytes}")
    old, piece_size = piece_size, nbytes
    return old


def write_bodies(fds, bodies):
    """Write `bodies` (sealed bodies or bytes-like objects) back to back to each file descriptor in
    `fds`, at its position, with the GIL released once for all of them: an upload thread needs the
    interpreter only before and after the file's bytes. A sealed body with its groups' chunks is
    written from them with writev; another is produced in canonical order one L2-sized piece at a
    time and each piece written while it is still in the cache, so that two upload threads scale on
    two cores (a whole-body layout first makes them contend for the shared cache and memory).
    Returns the bytes written to each fd; OSError (with the byte offset reached) if a write fails."""
    cdef int cfds[MAX_FDS]
    cdef int nfds = 0
    for fd in fds:
        if nfds == MAX_FDS:
            raise ValueError(f"write_bodies: at most {MAX_FDS} file descriptors")
        try:
            cfds[nfds] = operator.index(fd)
        except TypeError:
            raise TypeError(f"write_bodies: file descriptors must be ints, got {type(fd).__name__}") from None
        if cfds[nfds] < 0:
            raise ValueError(f"write_bodies: invalid file descriptor {cfds[nfds]}")
        nfds += 1
    return _bodies_out(cfds, nfds, bodies, None, 0)


def write_bodies_at(paths, offset, bodies, create=False, size=-1):
    """Open each of `paths`, write `bodies` into it from byte `offset` as `write_bodies` does, and
    close it, all in one GIL release. The files exist (write-only, never created or truncated), or
    with `create` are made exclusively (mode 0666 less the umask) with `size` bytes reserved first
    when that is 1 MiB or more (fallocate; best effort), and are removed again if a write fails.
    A thread that writes beside a busy appending thread waits up to the interpreter's switch interval
    (5 ms) for the GIL after every system call it makes without it; here there is one. Returns the
    bytes written to each file; OSError naming the path if one cannot be opened or made."""
    cdef int cfds[MAX_FDS]
    cdef list names = [os.fsencode(p) for p in paths]
    if len(names) > MAX_FDS:
        raise ValueError(f"write_bodies_at: at most {MAX_FDS} paths")
    if operator.index(offset) < 0:
        raise ValueError(f"write_bodies_at: negative offset {offset}")
    return _bodies_out(cfds, len(names), bodies, names, offset, operator.index(size) if create else -2)


cdef object _bodies_out(int* cfds, int nfds, bodies, list names, int64_t offset, int64_t reserve=-2):
    """write_bodies' work; with `names`, the nfds files are opened (and closed) inside the GIL release,
    and made when `reserve` > -2 (the bytes to reserve, or -1)."""
    cdef int err = 0, opened = 0, failed_at = -1
    cdef bint create = reserve > -2
    cdef const char* cnames[MAX_FDS]
    cdef Py_ssize_t nb = len(bodies), i, nviews = 0
    cdef int64_t pos = 0, got, size = piece_size
    cdef bint sealed = False
    cdef Py_buffer* views
    cdef BodyRef* refs
    cdef int* kinds          # 0 = raw buffer, 1 = sealed body, 2 = one with chunks, -1 = not looked at
    cdef int64_t max_groups = -1
    cdef unsigned char* hdr = NULL
    cdef unsigned char* chunk_ptr = NULL
    cdef Cursor c
    cdef bytearray chunk = None
    cdef list held = []      # keeps the bodies alive while the GIL is released
    cdef bint open_here = names is not None
    if open_here:
        for i in range(nfds):
            cnames[i] = <const char*>(<bytes>names[i])
    if nfds == 0 or (nb == 0 and not create):
        return 0
    views = <Py_buffer*>malloc((nb or 1) * sizeof(Py_buffer))
    refs = <BodyRef*>malloc((nb or 1) * sizeof(BodyRef))
    kinds = <int*>malloc((nb or 1) * sizeof(int))
    if views == NULL or refs == NULL or kinds == NULL:
        free(views)
        free(refs)
        free(kinds)
        raise MemoryError()
    try:
        for i in range(nb):
            kinds[i] = -1
            nviews = i + 1
            b = bodies[i]
            held.append(b)
            if type(b) is SealedBody and (<SealedBody>b)._bytes is None and (<SealedBody>b).spans != NULL:
                refs[i] = body_ref(<SealedBody>b)
                kinds[i] = 2
                if refs[i].num_groups > max_groups:
                    max_groups = refs[i].num_groups
                continue
            if type(b) is SealedBody and (<SealedBody>b)._bytes is None:
                (<SealedBody>b)._order()
                refs[i] = body_ref(<SealedBody>b)
                kinds[i] = 1
                sealed = True
                continue
            if type(b) is SealedBody:
                b = (<SealedBody>b)._bytes
            try:
                PyObject_GetBuffer(b, &views[i], PyBUF_SIMPLE)
            except (TypeError, BufferError, ValueError):
                raise TypeError(f"write_bodies: body {i} is not a sealed body or a contiguous "
                                f"bytes-like object, got {type(b).__name__}") from None
            kinds[i] = 0
        if max_groups >= 0:
            hdr = <unsigned char*>malloc(4 + 8 * max_groups)
            if hdr == NULL:
                raise MemoryError()
        if sealed:
            spares = _spare_chunks.get(size)
            chunk = spares.pop() if spares else bytearray(size)
            chunk_ptr = <unsigned char*>(<char*>chunk)
        with nogil:
            if open_here:
                for i in range(nfds):
                    if create:
                        cfds[i] = c_open(cnames[i], O_WRONLY | O_CLOEXEC | O_CREAT | O_EXCL, 0o666)
                        if cfds[i] >= 0 and reserve >= PREALLOCATE_MIN and c_fallocate(cfds[i], 0, 0, reserve) != 0:
                            c_ftruncate(cfds[i], 0)  # a partial reservation must not stay
                    else:
                        cfds[i] = c_open(cnames[i], O_WRONLY | O_CLOEXEC, 0)
                    if cfds[i] < 0 or c_lseek(cfds[i], offset, SEEK_SET) < 0:
                        err = errno
                        failed_at = <int>i
                        if cfds[i] >= 0:
                            opened += 1
                        break
                    opened += 1
            for i in range(nb):
                if err:
                    break
                if kinds[i] == 0:
                    err = write_all(cfds, nfds, <const unsigned char*>views[i].buf, views[i].len)
                    if err:
                        break
                    pos += views[i].len
                    continue
                if kinds[i] == 2:
                    err = write_chunked(cfds, nfds, &refs[i], hdr)
                    if err:
                        break
                    pos += refs[i].total
                    continue
                cursor_start(&c)
                while True:
                    got = fill_body(&refs[i], chunk_ptr, size, &c)
                    if got == 0:
                        break
                    err = write_all(cfds, nfds, chunk_ptr, got)
                    if err:
                        break
                    pos += got
                if err:
                    break
            for i in range(opened):
                c_close(cfds[i])
                if err and create:  # made here: a failed write leaves nothing behind
                    c_unlink(cnames[i])
    finally:
        for i in range(nviews):
            if kinds[i] == 0:
                PyBuffer_Release(&views[i])
        free(views)
        free(refs)
        free(kinds)
        free(hdr)
    if chunk is not None:
        spares = _spare_chunks.setdefault(size, [])
        if len(spares) < 4:
            spares.append(chunk)
    if err and failed_at >= 0:
        raise OSError(err, f"write_bodies_at: cannot {'make' if create else 'open'} "
                           f"{names[failed_at].decode(errors='replace')} at byte {offset}: {os.strerror(err)}",
                      os.fsdecode(names[failed_at]))
    if err:
        raise OSError(err, f"write_bodies: write failed at byte {pos} of the bodies: {os.strerror(err)}")
    return pos


from dstl._fast._buffer_py import concurrent_append_error, writer_key_group
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
    Twin: `WriterCore` in dstl/_buffer_py.py (same checks, same errors, byte-identical buffer).
    """
    # fields and C methods: declared in _buffer.pxd (`_append_raw` is the keyed-state kernel's entry)

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
