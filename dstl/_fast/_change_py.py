"""Pure-Python twin of `dstl._fast._change`: `StateChange`, one change of a changelog.

`dstl.types.StateChange` is the Cython class when the extension is built, this one otherwise (or
with DSTL_PUREPYTHON=1). Objects of the two classes compare equal (and hash alike) when their key
group and data are equal.
"""
from __future__ import annotations

META_KEY_GROUP = -1
MAX_KEY_GROUP = 32767


def check_change_key_group(key_group) -> int:
    """`key_group` as an int in -1..32767 (ValueError otherwise: a non-integer or out of range)."""
    if isinstance(key_group, bool) or not isinstance(key_group, int):
        try:
            import numpy as np

            if isinstance(key_group, np.integer):
                key_group = int(key_group)
            else:
                raise TypeError
        except (ImportError, TypeError):
            raise ValueError(f"key_group must be an int, got {type(key_group).__name__}: {key_group!r}") from None
    if key_group < META_KEY_GROUP or key_group > MAX_KEY_GROUP:
        raise ValueError(f"key_group must be -1 (metadata) or 0..{MAX_KEY_GROUP}, got {key_group}")
    return key_group


def check_change_data(data) -> bytes:
    """`data` as bytes (bytes, bytearray and memoryview accepted; TypeError otherwise)."""
    if isinstance(data, bytes):
        return bytes(data) if type(data) is not bytes else data
    if isinstance(data, (bytearray, memoryview)):
        return bytes(data)
    raise TypeError(f"change data must be bytes-like, got {type(data).__name__}")


def change_repr(key_group: int, data: bytes) -> str:
    shown = data if len(data) <= 32 else data[:32] + b"..."
    return f"StateChange({key_group}, {shown!r})"


# The classes whose objects compare equal to StateChange objects (the Cython module adds its own).
EQUAL_TYPES: list = []


class StateChange:
    """One change: `(key_group, data)`; metadata changes use `META_KEY_GROUP` (-1)."""

    __slots__ = ("key_group", "data")
    META_KEY_GROUP = META_KEY_GROUP

    def __init__(self, key_group: int, data):
        object.__setattr__(self, "key_group", check_change_key_group(key_group))
        object.__setattr__(self, "data", check_change_data(data))

    @classmethod
    def meta(cls, data) -> "StateChange":
        return cls(META_KEY_GROUP, data)

    def is_meta(self) -> bool:
        return self.key_group == META_KEY_GROUP

    def __setattr__(self, name, value):
        raise AttributeError("StateChange is immutable")

    def __eq__(self, other) -> bool:
        if isinstance(other, StateChange) or type(other) in EQUAL_TYPES:
            return self.key_group == other.key_group and self.data == other.data
        return NotImplemented

    def __ne__(self, other) -> bool:
        eq = self.__eq__(other)
        return eq if eq is NotImplemented else not eq

    def __hash__(self) -> int:
        return hash((self.key_group, self.data))

    def __iter__(self):  # allows `kg, data = change`
        yield self.key_group
        yield self.data

    def __repr__(self) -> str:
        return change_repr(self.key_group, self.data)

    def __reduce__(self):
        return (StateChange, (self.key_group, self.data))


EQUAL_TYPES.append(StateChange)

_new_change = object.__new__
_set_kg = StateChange.__dict__["key_group"].__set__
_set_data = StateChange.__dict__["data"].__set__


def make_change(key_group: int, data: bytes) -> StateChange:
    """A change from already-validated parts (the decoder's path: no checks, slots filled directly)."""
    change = _new_change(StateChange)
    _set_kg(change, key_group)
    _set_data(change, data)
    return change
