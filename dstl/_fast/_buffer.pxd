# The change buffer and the writer's append core, declared for the other modules' C-level appends: the
# keyed-state kernel (dstl/_fast/_keyed.pyx) copies an encoded change from its own buffer straight into
# the writer's arena (`WriterCore._append_raw`), with no bytes object and no Python call.
from libc.stdint cimport int32_t, int64_t


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
    cdef void _count(self, int slot, int64_t k) noexcept nogil
    cdef int _check_idle(self) except -1
    cdef int _add(self, int32_t kg, object data) except -1
    cdef int _add_raw(self, int32_t kg, const unsigned char* src, Py_ssize_t length) except -1
    cdef int _write(self, unsigned char* dst) except -1


cdef class WriterCore:
    cdef readonly ChangeBuffer _buffer
    cdef public bint _closed
    cdef public long _kg_start, _kg_end
    cdef public int64_t _threshold
    cdef unsigned long _flusher   # the thread inside a pre-emptive persist of an append; 0 = none

    cdef int _enter(self) except -1
    cdef int _after(self) except -1
    cdef int _append_raw(self, long kg, const unsigned char* src, Py_ssize_t length) except -1
