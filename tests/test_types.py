import pickle
import uuid

import pytest

from dstl import KeyGroupRange, SequenceNumber, StateChange, StateChangeSet
from dstl.types import META_KEY_GROUP, java_uuid_sort_key


def test_sequence_number_order_hash_next():
    a, b = SequenceNumber.of(3), SequenceNumber(4)
    assert a < b and a.next() == b and int(b) == 4 and hash(a.next()) == hash(b)
    assert sorted([b, a]) == [a, b]
    assert pickle.loads(pickle.dumps(a)) == a
    with pytest.raises(AttributeError):
        a._value = 7
    for bad in (-1, 1.5, "3", True, 2**63):
        with pytest.raises(ValueError):
            SequenceNumber(bad)


def test_key_group_range():
    r = KeyGroupRange.of(2, 5)
    assert len(r) == 4 and list(r) == [2, 3, 4, 5] and r.contains(2) and 5 in r and not r.contains(6)
    assert r.intersection(KeyGroupRange(4, 9)) == KeyGroupRange(4, 5)
    assert r.intersection(KeyGroupRange(6, 9)) is not None
    assert r.intersection(KeyGroupRange(6, 9)) == KeyGroupRange.EMPTY
    assert len(KeyGroupRange.EMPTY) == 0 and KeyGroupRange.EMPTY.is_empty() and list(KeyGroupRange.EMPTY) == []
    assert KeyGroupRange(3, 1) == KeyGroupRange.EMPTY
    with pytest.raises(ValueError):
        KeyGroupRange.of(5, 2)
    for bad in ((-1, 3), (0, 40000), ("a", 2)):
        with pytest.raises(ValueError):
            KeyGroupRange(*bad)
    assert {KeyGroupRange(1, 2), KeyGroupRange(1, 2)} == {KeyGroupRange(1, 2)}
    for bad in (None, (0, 3), 3):
        with pytest.raises(ValueError, match="KeyGroupRange"):
            r.intersection(bad)


def test_state_change_and_set():
    c = StateChange(3, b"x")
    assert c.key_group == 3 and c.data == b"x" and StateChange.META_KEY_GROUP == META_KEY_GROUP == -1
    assert StateChange.meta(b"m").is_meta()
    assert StateChange(1, bytearray(b"ab")).data == b"ab"
    with pytest.raises(TypeError):
        StateChange(1, "str")
    with pytest.raises(ValueError):
        StateChange(-2, b"")
    s = StateChangeSet(uuid.uuid4(), 0, [c, StateChange(-1, b"meta")])
    assert s.size == 5 and s.sequence_number == SequenceNumber(0) and len(s.changes) == 2
    with pytest.raises(ValueError):
        StateChangeSet("not-a-uuid", 0, [])


def test_java_uuid_order_is_signed():
    low = uuid.UUID(int=1 << 127)  # top bit set: negative in Java
    high = uuid.UUID(int=1)
    assert low > high  # Python compares unsigned
    assert java_uuid_sort_key(low) < java_uuid_sort_key(high)
