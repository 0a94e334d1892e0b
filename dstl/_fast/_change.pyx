# cython: language_level=3
"""Cython `StateChange`: one change of a changelog, a small immutable object with a C int key group
and the payload bytes. Decoders build it with `new_change` (no argument checks, no tuple or dict per
change); it takes no part in the cyclic GC (its fields cannot form cycles) and keeps a free list.

Twin: dstl/_fast/_change_py.py (same attributes, errors, repr, equality, hash and pickling; objects of
the two classes compare equal).
"""
cimport cython

from dstl._fast import _change_py
from dstl._fast._change_py import change_repr, check_change_data, check_change_key_group

cdef object _PyStateChange = _change_py.StateChange


@cython.no_gc
@cython.freelist(256)
cdef class StateChange:
    """One change: `(key_group, data)`; metadata changes use `META_KEY_GROUP` (-1)."""

    META_KEY_GROUP = -1

    def __init__(self, key_group, data):
        self.key_group = check_change_key_group(key_group)
        self.data = check_change_data(data)

    @classmethod
    def meta(cls, data):
        return cls(-1, data)

    def is_meta(self):
        return self.key_group == -1

    def __setattr__(self, name, value):
        raise AttributeError("StateChange is immutable")

    def __delattr__(self, name):
        raise AttributeError("StateChange is immutable")

    def __eq__(self, other):
        if type(other) is StateChange:
            return self.key_group == (<StateChange>other).key_group and self.data == (<StateChange>other).data
        if isinstance(other, (StateChange, _PyStateChange)):
            return self.key_group == other.key_group and self.data == other.data
        return NotImplemented

    def __ne__(self, other):
        eq = self.__eq__(other)
        return eq if eq is NotImplemented else not eq

    def __hash__(self):
        return hash((self.key_group, self.data))

    def __iter__(self):  # allows `kg, data = change`
        return iter((self.key_group, self.data))

    def __repr__(self):
        return change_repr(self.key_group, self.data)

    def __reduce__(self):
        return (StateChange, (self.key_group, self.data))


cdef StateChange new_change(int key_group, bytes data):
    cdef StateChange change = StateChange.__new__(StateChange)
    change.key_group = key_group
    change.data = data
    return change


_change_py.EQUAL_TYPES.append(StateChange)
