"""Core value types: sequence numbers, key-group ranges, changes and change sets."""
from __future__ import annotations

import functools
import uuid
from typing import Iterable, Iterator, Optional, Sequence

META_KEY_GROUP = -1
MAX_KEY_GROUP = 32767  # docs/rescaling.md §1: max parallelism <= 32768
INT64_MAX = 2**63 - 1


def _check_int(name: str, value, lo: Optional[int] = None, hi: Optional[int] = None) -> int:
    if isinstance(value, bool) or not isinstance(value, int):
        try:
            import numpy as np

            if isinstance(value, np.integer):
                value = int(value)
            else:
                raise TypeError
        except (ImportError, TypeError):
            raise ValueError(f"{name} must be an int, got {type(value).__name__}: {value!r}") from None
    if lo is not None and value < lo:
        raise ValueError(f"{name} must be >= {lo}, got {value}")
    if hi is not None and value > hi:
        raise ValueError(f"{name} must be <= {hi}, got {value}")
    return value


@functools.total_ordering
class SequenceNumber:
    """A position in one writer's log (Flink's `SequenceNumber.GenericSequenceNumber`)."""

    __slots__ = ("_value",)

    def __init__(self, value: int):
        object.__setattr__(self, "_value", _check_int("sequence number", value, 0, INT64_MAX))

    @classmethod
    def of(cls, value: int) -> "SequenceNumber":
        return cls(value)

    @property
    def value(self) -> int:
        return self._value

    def next(self) -> "SequenceNumber":
        return SequenceNumber(self._value + 1)

    def __setattr__(self, name, value):
        raise AttributeError("SequenceNumber is immutable")

    def __int__(self) -> int:
        return self._value

    __index__ = __int__

    def __eq__(self, other) -> bool:
        if isinstance(other, SequenceNumber):
            return self._value == other._value
        return NotImplemented

    def __lt__(self, other) -> bool:
        if isinstance(other, SequenceNumber):
            return self._value < other._value
        return NotImplemented

    def __hash__(self) -> int:
        return hash(("sqn", self._value))

    def __repr__(self) -> str:
        return f"SequenceNumber({self._value})"

    def __reduce__(self):
        return (SequenceNumber, (self._value,))


def as_sqn(value) -> SequenceNumber:
    """Accept a SequenceNumber or a plain non-negative int."""
    return value if isinstance(value, SequenceNumber) else SequenceNumber(value)


class KeyGroupRange:
    """An inclusive range of key groups `[start, end]`; empty when start > end (docs/rescaling.md §1)."""

    __slots__ = ("_start", "_end")

    EMPTY: "KeyGroupRange"

    def __init__(self, start: int, end: int):
        start = _check_int("key group range start", start, 0, MAX_KEY_GROUP)
        end = _check_int("key group range end", end, -1, MAX_KEY_GROUP)
        if end < start:  # every empty range is the canonical EMPTY
            start, end = 0, -1
        object.__setattr__(self, "_start", start)
        object.__setattr__(self, "_end", end)

    @classmethod
    def of(cls, start: int, end: int) -> "KeyGroupRange":
        if isinstance(end, int) and isinstance(start, int) and end < start:
            raise ValueError(f"key group range end {end} is before start {start}; use KeyGroupRange.EMPTY")
        return cls(start, end)

    @property
    def start(self) -> int:
        return self._start

    @property
    def end(self) -> int:
        return self._end

    # Flink spelling
    def get_start_key_group(self) -> int:
        return self._start

    def get_end_key_group(self) -> int:
        return self._end

    def is_empty(self) -> bool:
        return self._end < self._start

    def contains(self, key_group: int) -> bool:
        return self._start <= key_group <= self._end

    __contains__ = contains

    def intersection(self, other: "KeyGroupRange") -> "KeyGroupRange":
        if not isinstance(other, KeyGroupRange):
            raise ValueError(f"intersection needs a KeyGroupRange, got {type(other).__name__}")
        start, end = max(self._start, other._start), min(self._end, other._end)
        return KeyGroupRange(start, end) if start <= end else KeyGroupRange.EMPTY

    def __len__(self) -> int:
        return max(0, self._end - self._start + 1)

    def __iter__(self) -> Iterator[int]:
        return iter(range(self._start, self._end + 1))

    def __setattr__(self, name, value):
        raise AttributeError("KeyGroupRange is immutable")

    def __eq__(self, other) -> bool:
        if isinstance(other, KeyGroupRange):
            return self._start == other._start and self._end == other._end
        return NotImplemented

    def __hash__(self) -> int:
        return hash(("kgr", self._start, self._end))

    def __repr__(self) -> str:
        return "KeyGroupRange.EMPTY" if self.is_empty() else f"KeyGroupRange({self._start}, {self._end})"

    def __reduce__(self):
        return (KeyGroupRange, (self._start, self._end))


KeyGroupRange.EMPTY = KeyGroupRange(0, -1)


# One change: the Cython class when the extension is built, else its pure-Python twin (same
# attributes, errors, repr, equality, hash and pickling; objects of the two classes compare equal).
from dstl import _impl  # noqa: E402
from dstl._fast import _change_py  # noqa: E402

StateChange = _impl.kernel("_change").StateChange


class StateChangeSet:
    """The changes of one writer between two rollovers: `(log_id, sequence_number, changes)`."""

    __slots__ = ("log_id", "sequence_number", "changes", "size")

    def __init__(self, log_id: uuid.UUID, sequence_number, changes: Iterable[StateChange]):
        if not isinstance(log_id, uuid.UUID):
            raise ValueError(f"log_id must be a uuid.UUID, got {type(log_id).__name__}")
        changes = tuple(changes)
        for c in changes:
            if not isinstance(c, tuple(_change_py.EQUAL_TYPES)):
                raise ValueError(f"changes must be StateChange objects, got {type(c).__name__}")
        object.__setattr__(self, "log_id", log_id)
        object.__setattr__(self, "sequence_number", as_sqn(sequence_number))
        object.__setattr__(self, "changes", changes)
        object.__setattr__(self, "size", sum(len(c.data) for c in changes))

    def __setattr__(self, name, value):
        raise AttributeError("StateChangeSet is immutable")

    def __eq__(self, other) -> bool:
        if isinstance(other, StateChangeSet):
            return (self.log_id, self.sequence_number, self.changes) == (
                other.log_id, other.sequence_number, other.changes)
        return NotImplemented

    def __hash__(self) -> int:
        return hash((self.log_id, self.sequence_number, self.changes))

    def __repr__(self) -> str:
        return (f"StateChangeSet(log_id={self.log_id}, sqn={int(self.sequence_number)}, "
                f"changes={len(self.changes)}, size={self.size})")


def java_uuid_sort_key(u: uuid.UUID):
    """Java's `UUID.compareTo`: both 64-bit halves compared as signed (docs/format.md §5.2)."""
    def signed(x: int) -> int:
        return x - (1 << 64) if x >= (1 << 63) else x

    return (signed(u.int >> 64), signed(u.int & ((1 << 64) - 1)))


__all__: Sequence[str] = [
    "META_KEY_GROUP", "SequenceNumber", "KeyGroupRange", "StateChange", "StateChangeSet",
    "java_uuid_sort_key", "as_sqn", "SealedChangeSet",
]


class SealedChangeSet:
    """A change set already encoded by the change buffer (docs/format.md §4): what uploads carry.

    `body` is the encoded change set (bytes-like, G field first); `size` its raw payload bytes
    (docs/format.md §2), `num_changes` the number of changes in it.
    """

    __slots__ = ("log_id", "sequence_number", "body", "size", "num_changes")

    def __init__(self, log_id: uuid.UUID, sequence_number, body, size: int, num_changes: int):
        self.log_id = log_id
        self.sequence_number = as_sqn(sequence_number)
        self.body = body
        self.size = size
        self.num_changes = num_changes

    @property
    def encoded_size(self) -> int:
        return len(self.body)

    def sort_key(self):
        return java_uuid_sort_key(self.log_id) + (int(self.sequence_number),)

    def __repr__(self) -> str:
        return (f"SealedChangeSet(log_id={self.log_id}, sqn={int(self.sequence_number)}, "
                f"changes={self.num_changes}, size={self.size}, encoded={len(self.body)})")
