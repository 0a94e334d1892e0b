# The sealed body, declared for the modules that make it (_buffer: ChangeBuffer.seal_body hands it
# its arena, records or chunks) and write it (_filewrite: write_bodies lays it out without the GIL).
from libc.stdint cimport int32_t, int64_t


cdef struct Cursor:
    int64_t phase           # 0 = count of groups, 1 = group header, 2 = records, 3 = done
    int64_t g               # current group
    int64_t r               # current position in order
    int64_t stop            # end of the current group in order
    int64_t done            # bytes of the current item already emitted


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


cdef class SealedBody:
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
    cdef list sources       # immutable sources that records point into (append_many by reference)
    cdef object _bytes

    cdef int _scatter(self, unsigned char* dst) except -1
    cdef int _gather_into(self, unsigned char* dst) except -1
    cdef int _order(self) except -1
    cdef int _order_chunks(self) except -1
    cdef int64_t _write_scattered(self, write, int64_t size) except -1


cdef int64_t fill_body(const BodyRef* b, unsigned char* out, int64_t room, Cursor* c) noexcept nogil


cdef inline void cursor_start(Cursor* c) noexcept nogil:
    c.phase = 0
    c.g = c.r = c.stop = c.done = 0


cdef inline BodyRef body_ref(SealedBody body) noexcept:
    cdef BodyRef r
    r.total, r.n, r.num_groups = body.total, body.n, body.num_groups
    r.kgs, r.offs, r.lens, r.groups, r.order = body.kgs, body.offs, body.lens, body.groups, body.order
    r.arena, r.spans, r.gspans = body.arena, body.spans, body.gspans
    return r
