# cython: language_level=3, boundscheck=False, wraparound=False, cdivision=True, initializedcheck=False
"""Cython sealed body: a change-set body laid out only while it is written.

`ChangeBuffer.seal_body` (dstl/_fast/_buffer.pyx) hands a `SealedBody` its arena with either the
groups' chunks (each holds its changes as [length][payload] already: written as they are) or its
records (laid out in canonical order by a counting sort). The layouts here: `scatter_body` (append
order, one cursor per group: for a body built in the cache), `chunks_into` (the chunks one after
another) and `fill_body` (canonical order, piece by piece: for streaming and for memory that is not
in the cache). Record arrays and arenas go back to dstl/_fast/_spares.pyx when a body is dropped.

Twin: dstl/_fast/_sealed_py.py (the body's bytes themselves; byte-identical output, same errors).
"""
from cpython.buffer cimport PyBUF_WRITABLE, PyBuffer_Release, PyObject_GetBuffer
from cpython.bytes cimport PyBytes_AS_STRING, PyBytes_FromStringAndSize
from libc.stdint cimport int32_t, int64_t
from libc.stdlib cimport free, malloc
from libc.string cimport memcpy, memset

from dstl._fast._cutil cimport DSTL_PREFETCH, PyByteArrayObject, get_be32, huge_pages, put_be32
from dstl._fast._spares cimport donate_arena, donate_records, give_chunk, give_whole, take_chunk, take_whole

from dstl._fast._buffer_common import writable_view

cdef enum:
    PREFETCH_AHEAD = 24     # records
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


cdef inline int64_t copy_part(unsigned char* dst, int64_t room, const unsigned char* src, int64_t length,
                              int64_t* done) noexcept nogil:
    """Copy what fits of src[*done:length] to dst; returns the bytes copied."""
    cdef int64_t k = length - done[0]
    if k > room:
        k = room
    memcpy(dst, src + done[0], k)
    done[0] += k
    return k



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
    # fields and C methods: declared in _sealed.pxd (ChangeBuffer.seal_body fills them)

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
        chunk = take_chunk(size)
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
        give_chunk(size, chunk)
        return written

    cdef int64_t _write_scattered(self, write, int64_t size) except -1:
        """Build the body in one reused cache-sized buffer (sequential payload reads), then write it."""
        cdef bytearray whole = take_whole(self.total)
        cdef int64_t pos
        self._scatter(<unsigned char*>(<char*>whole))
        full = memoryview(whole)
        try:
            for pos in range(0, self.total, size):
                _write_view(write, full[pos:min(pos + size, self.total)])
        finally:
            full.release()
        give_whole(whole)
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


