cdef class StateChange:
    cdef readonly int key_group
    cdef readonly bytes data


cdef StateChange new_change(int key_group, bytes data)
