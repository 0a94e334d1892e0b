# cython: language_level=3, boundscheck=False, wraparound=False, cdivision=True, initializedcheck=False
"""Cython change buffer: appends go into one malloc arena plus int arrays (key group, offset,
length); `seal` is a counting sort by key group followed by one scatter copy into the body.
Per-record appends copy each change as [length][payload] into its key group's chunk of the arena,
so a file write can take a sealed body's groups as they are (`write_bodies`: writev).
`seal_body` hands the arena with its chunks or records to a `SealedBody` (dstl/_fast/_sealed.pyx)
without copying; the arrays and arenas of dropped bodies come back through dstl/_fast/_spares.pyx.

`append_many` on an immutable source (bytes, pyarrow.Buffer, or a memoryview of either) keeps a
reference instead of copying: the payload is then copied exactly once, by `seal`. Records are
organised in runs; a run's payload lives in the arena or in one such source.

Twin: dstl/_fast/_buffer_py.py (byte-identical output, same errors; the argument checks are shared,
in dstl/_fast/_buffer_common.py).
"""
cimport cython
from cpython.buffer cimport PyBUF_SIMPLE, PyBUF_WRITABLE, PyBuffer_Release, PyObject_GetBuffer
from cpython.bytes cimport PyBytes_AS_STRING, PyBytes_CheckExact, PyBytes_FromStringAndSize, PyBytes_GET_SIZE
from cpython.long cimport PyLong_AsLongAndOverflow, PyLong_CheckExact
from libc.stdint cimport int32_t, int64_t, intptr_t
from libc.stdlib cimport calloc, free, malloc, realloc
from libc.string cimport memcpy, memset

from dstl._fast._cutil cimport INT32_MAX, KEEP_ARENA, get_be32, huge_pages, put_be32
from dstl._fast._sealed cimport SealedBody
from dstl._fast._spares cimport take_arena, take_records

import numpy as np

from dstl._fast._buffer_common import byte_view, check_key_group, coerce_many, writable_view

cdef enum:
    CHUNK_MAX = 16 << 10    # a group's largest chunk: a writev of 16 KiB pieces copies as fast as one write()
    SPAN_MIN = 512          # bytes per iovec, on average, below which a body is laid out instead


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


cdef inline int64_t chunk_end(ChangeBuffer buf, int64_t k) noexcept:
    """Where chunk k's changes end: a group's open chunk (end -1) ends where its next change would
    go. Left open until a later chunk of the group is carved, so sealing changes nothing in the
    buffer (a failed seal leaves it as it was)."""
    cdef int64_t end = buf.chunks[3 * k + 2]
    return end if end >= 0 else buf.gpos[buf.chunks[3 * k]]


cdef class ChangeBuffer:
    """Accumulates changes and seals them into one canonical change-set body (docs/format.md §4)."""

    # fields and C methods: declared in _buffer.pxd (the writer core cimports this class)

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
        if self.records and self.cap == 0 and self.kgs == NULL:
            self.cap = take_records(&self.kgs, &self.offs, &self.lens)
        if self.arena_cap == 0 and self.arena == NULL and nbytes:
            self.arena_cap = take_arena(&self.arena)
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
                    count_slot(self, kv + 1, 1)
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
