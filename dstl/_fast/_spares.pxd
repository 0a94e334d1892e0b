# The memory that sealed bodies hand back for the next change sets: record arrays and arenas (C
# pointers, taken by ChangeBuffer and given back by SealedBody) and the bytearrays that bodies are
# built or streamed through (SealedBody.write_to, write_bodies).
from libc.stdint cimport int32_t, int64_t

cdef void donate_records(int32_t* kgs, int64_t* offs, int32_t* lens, int64_t cap) noexcept
cdef void donate_arena(unsigned char* arena, int64_t cap) noexcept
cdef int64_t take_records(int32_t** kgs, int64_t** offs, int32_t** lens) noexcept
cdef int64_t take_arena(unsigned char** arena) noexcept
cdef bytearray take_whole(int64_t need)
cdef void give_whole(bytearray whole)
cdef bytearray take_chunk(int64_t size)
cdef void give_chunk(int64_t size, bytearray chunk)
