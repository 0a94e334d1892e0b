# cython: language_level=3, boundscheck=False, wraparound=False, cdivision=True, initializedcheck=False
"""Memory kept for reuse between change sets (the C functions are declared in _spares.pxd).

Sealed bodies take over the buffer's record arrays and arena; when a body is dropped (its upload is
done) they come back here, so the next change sets reuse memory that is already mapped instead of
growing fresh arrays page fault by page fault. A per-record loop runs ahead of its uploads by up to
the in-flight limit (100 MiB by default, 20 change sets), and the uploads return them in a burst:
the pool keeps what was in flight at the peak (docs/benchmarks.md). The bytearrays that bodies are
built in (whole, up to 16 MiB) or streamed through (chunks) are kept the same way, touched already,
so their reuse takes no page faults. Only touched with the GIL held; a closing storage empties the
record and arena pool (`release_spares`).

Twin: dstl/_fast/_spares_py.py (keeps nothing: Python's allocator does that for the twins).
"""
from libc.stdint cimport int32_t, int64_t
from libc.stdlib cimport free

from dstl._fast._cutil cimport KEEP_ARENA, PyByteArrayObject

cdef enum:
    SPARE_RECORDS = 32      # record arrays / arenas of sealed bodies kept for the next change sets
    SPARE_ARENAS = 32
    SPARE_RECORDS_MAX = 1 << 18  # records (16 B each) in one kept set of arrays
    SPARE_RECORD_BYTES = 32 << 20   # idle record arrays kept, at most
    SPARE_ARENA_BYTES = 160 << 20   # idle arenas kept, at most: 20 of the default threshold's 8 MiB
    SPARE_WHOLES = 4        # whole-body buffers kept for reuse ...
    SPARE_WHOLE_BYTES = 48 << 20  # ... holding at most this much idle memory
    CHUNK_SIZES = 8         # piece sizes with kept chunk buffers ...
    CHUNKS_PER_SIZE = 4     # ... and buffers kept of each

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

cdef list _spare_wholes = []  # reusable buffers for whole bodies
cdef dict _spare_chunks = {}  # size -> reusable chunk buffers


cdef void donate_records(int32_t* kgs, int64_t* offs, int32_t* lens, int64_t cap) noexcept:
    """Keep a body's record arrays for the next change set (or free them when the pool is full)."""
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
    """Keep a body's arena for the next change set (or free it when the pool is full)."""
    global nspare_arenas, spare_arena_bytes
    if arena != NULL and nspare_arenas < SPARE_ARENAS and cap <= KEEP_ARENA \
            and spare_arena_bytes + cap <= SPARE_ARENA_BYTES:
        spare_arena_bytes += cap
        spare_arena[nspare_arenas] = arena
        spare_arena_cap[nspare_arenas] = cap
        nspare_arenas += 1
    else:
        free(arena)


cdef int64_t take_records(int32_t** kgs, int64_t** offs, int32_t** lens) noexcept:
    """A kept set of record arrays into the three pointers: its capacity, or 0 (pointers untouched)."""
    global nspare_records, spare_records_bytes
    if not nspare_records:
        return 0
    nspare_records -= 1
    spare_records_bytes -= 16 * spare_cap[nspare_records]
    kgs[0] = spare_kgs[nspare_records]
    offs[0] = spare_offs[nspare_records]
    lens[0] = spare_lens[nspare_records]
    return spare_cap[nspare_records]


cdef int64_t take_arena(unsigned char** arena) noexcept:
    """A kept arena into `arena`: its capacity, or 0 (pointer untouched)."""
    global nspare_arenas, spare_arena_bytes
    if not nspare_arenas:
        return 0
    nspare_arenas -= 1
    spare_arena_bytes -= spare_arena_cap[nspare_arenas]
    arena[0] = spare_arena[nspare_arenas]
    return spare_arena_cap[nspare_arenas]


cdef bytearray take_whole(int64_t need):
    """A buffer of at least `need` bytes for a whole body."""
    cdef Py_ssize_t i
    for i in range(len(_spare_wholes)):
        if len(<bytearray>_spare_wholes[i]) >= need:
            return _spare_wholes.pop(i)
    # rounded up so that bodies of similar size share buffers
    return bytearray(((need + (1 << 20) - 1) >> 20) << 20)


cdef void give_whole(bytearray whole):
    """Keep a whole-body buffer for reuse, unless a view of it is still out."""
    if (<PyByteArrayObject*>whole).ob_exports:  # a write callback kept a view: never reuse it
        return
    # as many as upload threads typically write at once, within a bound on idle memory
    if len(_spare_wholes) < SPARE_WHOLES and sum(map(len, _spare_wholes)) + len(whole) <= SPARE_WHOLE_BYTES:
        _spare_wholes.append(whole)
    elif _spare_wholes:  # prefer keeping larger ones
        _spare_wholes.sort(key=len)
        if len(<bytearray>_spare_wholes[0]) < len(whole) and \
                sum(map(len, _spare_wholes)) - len(<bytearray>_spare_wholes[0]) + len(whole) <= SPARE_WHOLE_BYTES:
            _spare_wholes[0] = whole


cdef bytearray take_chunk(int64_t size):
    """A buffer of `size` bytes to stream a body through."""
    spares = _spare_chunks.get(size)
    return spares.pop() if spares else bytearray(size)


cdef void give_chunk(int64_t size, bytearray chunk):
    """Keep a streaming buffer of `size` bytes for reuse, unless a view of it is still out."""
    if (<PyByteArrayObject*>chunk).ob_exports:
        return
    spares = _spare_chunks.get(size)
    if spares is None:
        if len(_spare_chunks) < CHUNK_SIZES:
            _spare_chunks[size] = [chunk]
    elif len(<list>spares) < CHUNKS_PER_SIZE:
        (<list>spares).append(chunk)


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
