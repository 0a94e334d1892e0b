# The change buffer, declared for the other modules' C-level appends: the writer core
# (dstl/_fast/_writer.pyx) stores a change with the inline `store_change` below, and the keyed-state
# kernel reaches it through the writer core's `_append_raw`, with no bytes object and no Python call.
from libc.stdint cimport int32_t, int64_t
from libc.string cimport memcpy

from dstl._fast._cutil cimport DSTL_PREFETCH_W, put_be32

cdef enum:
    NSLOTS = 32769          # key groups -1..32767, slot = kg + 1


cdef class ChangeBuffer:
    cdef unsigned char* arena
    cdef int64_t arena_len, arena_cap
    cdef int32_t* kgs
    cdef int64_t* offs
    cdef int32_t* lens
    cdef int64_t n, cap
    cdef int64_t* counts        # per slot, allocated with the first change
    cdef int64_t num_groups
    cdef int min_slot, max_slot
    cdef int64_t payload
    cdef bint busy
    cdef int64_t* run_first     # first record index of each run
    cdef const unsigned char** run_ptr   # payload base of each run; NULL = the arena
    cdef int64_t nruns, runs_cap
    cdef list sources           # keeps zero-copy sources (and their buffer exports) alive
    # appends copy each change as [length][payload] into its group's current chunk of the arena, so
    # a sealed body's groups are runs of chunks that a file write takes as they are (docs/format.md)
    cdef int64_t* gpos          # per slot: where the group's next change goes (allocated with counts)
    cdef int64_t* gend          # per slot: the end of the group's current chunk; 0 = none
    cdef int64_t* gcur          # per slot: that chunk's index in `chunks`
    cdef int64_t* chunks        # (slot, start, end) per chunk, in the order they were carved
    cdef int64_t nchunks, chunks_cap
    cdef int64_t ungrouped      # changes held outside chunks (append_many's)
    # records (kgs/offs/lens) are kept only once something needs them: an append alone stores its
    # change in its chunk and nothing else, and the records are read from the chunks when append_many
    # joins, a seal lays the body out, or the chunks are left out (`_records`)
    cdef bint records

    cdef int _reserve(self, int64_t records, int64_t nbytes) except -1
    cdef int _new_run(self, const unsigned char* base) except -1
    cdef int _new_chunk(self, int slot, int64_t length) except -1
    cdef int _records(self) except -1
    cdef int _check_idle(self) except -1
    cdef int _add(self, int32_t kg, object data) except -1
    cdef int _add_raw(self, int32_t kg, const unsigned char* src, Py_ssize_t length) except -1
    cdef int _write(self, unsigned char* dst) except -1


cdef inline void count_slot(ChangeBuffer buf, int slot, int64_t k) noexcept nogil:
    """Count `k` changes of the group in `slot`, noting a group seen for the first time."""
    if buf.counts[slot] == 0:
        buf.num_groups += 1
        if slot < buf.min_slot:
            buf.min_slot = slot
        if slot > buf.max_slot:
            buf.max_slot = slot
    buf.counts[slot] += k


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
    count_slot(buf, kg + 1, 1)
    # the group's next change goes right after this one, many appends from now: fetch its lines for
    # writing meanwhile (the groups' chunks are written as interleaved streams, more than the hardware
    # prefetcher follows; without this an append took twice as long)
    if next_p + 128 <= buf.gend[kg + 1]:
        DSTL_PREFETCH_W(buf.arena + next_p + 64)
        DSTL_PREFETCH_W(buf.arena + next_p + 128)
