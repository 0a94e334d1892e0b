"""StateChange: the Cython type and its pure-Python twin side by side (attributes, errors, equality,
hash, repr, pickling), and the objects the decoders and the reader build."""
from __future__ import annotations

import copy
import pickle

import numpy as np
import pytest

from dstl import format as fmt
from dstl.types import META_KEY_GROUP, StateChange, StateChangeSet

from format_helpers import IMPLS, impl_params

CASES = [(-1, b"meta"), (0, b""), (5, b"abc"), (32767, bytes(range(256)) * 3), (127, b"\x00" * 40)]


@impl_params
def test_constructor_attributes_and_helpers(impl):
    cls = impl.StateChange
    for kg, data in CASES:
        c = cls(kg, data)
        assert (c.key_group, c.data) == (kg, data)
        assert type(c.key_group) is int and type(c.data) is bytes
        assert c.is_meta() == (kg == -1)
        kg2, data2 = c
        assert (kg2, data2) == (kg, data)
    assert cls.META_KEY_GROUP == META_KEY_GROUP == -1
    assert cls.meta(b"m") == cls(-1, b"m")
    assert cls(np.int16(4), bytearray(b"ab")).data == b"ab"
    assert cls(4, memoryview(b"xyz")) == cls(4, b"xyz")


@impl_params
def test_errors(impl):
    cls = impl.StateChange
    for kg, data, err, msg in [(-2, b"", ValueError, "key_group must be -1 .metadata. or 0..32767, got -2"),
                               (32768, b"", ValueError, "got 32768"),
                               (True, b"", ValueError, "key_group must be an int, got bool"),
                               ("1", b"", ValueError, "key_group must be an int, got str"),
                               (1, "text", TypeError, "change data must be bytes-like, got str"),
                               (1, None, TypeError, "got NoneType")]:
        with pytest.raises(err, match=msg):
            cls(kg, data)
    c = cls(1, b"x")
    for name in ("key_group", "data", "other"):
        with pytest.raises(AttributeError, match="immutable"):
            setattr(c, name, 2)


@impl_params
def test_equality_hash_repr_pickle(impl):
    cls = impl.StateChange
    a, b = cls(3, b"abc"), cls(3, b"abc")
    assert a == b and not (a != b) and hash(a) == hash(b) == hash((3, b"abc"))
    assert a != cls(4, b"abc") and a != cls(3, b"abd")
    assert a != (3, b"abc") and (a == "x") is False
    assert len({a, b, cls(4, b"abc")}) == 2
    assert repr(a) == "StateChange(3, b'abc')"
    assert repr(cls(1, b"y" * 40)) == "StateChange(1, " + repr(b"y" * 32 + b"...") + ")"
    for proto in range(pickle.HIGHEST_PROTOCOL + 1):
        back = pickle.loads(pickle.dumps(a, protocol=proto))
        assert type(back) is cls and back == a
    assert copy.copy(a) == a and copy.deepcopy([a]) == [a]


def test_both_classes_compare_equal_and_hash_alike():
    objs = [impl.StateChange(5, b"v") for impl in IMPLS]
    for x in objs:
        for y in objs:
            assert x == y and not (x != y) and hash(x) == hash(y)
    assert len(set(objs)) == 1
    assert StateChangeSet.__init__  # both kinds are accepted in a change set
    import uuid

    s = StateChangeSet(uuid.uuid4(), 0, objs)
    assert s.size == len(objs)


def test_the_public_class_is_the_selected_implementation():
    expected = next(i for i in IMPLS if i.name == fmt.IMPLEMENTATION)
    assert StateChange is expected.StateChange


@impl_params
def test_decoded_changes_equal_hand_built_ones_and_pickle(impl):
    rng = np.random.default_rng(5)
    built = [StateChange(int(k), rng.integers(0, 256, int(n), dtype=np.uint8).tobytes())
             for k, n in zip(rng.integers(-1, 40, 300), rng.integers(0, 60, 300))]
    body = fmt.encode_change_set(built)
    changes, end = impl.decode.decode_change_set(body)
    assert end == len(body)
    canonical = sorted(built, key=lambda c: c.key_group)  # stable: append order kept in a group
    assert changes == canonical
    assert [impl.StateChange(c.key_group, c.data) for c in canonical] == changes
    assert all(type(c) is impl.StateChange for c in changes)
    assert pickle.loads(pickle.dumps(changes)) == changes
    lazy = impl.decode.iter_change_set(body, 0, (3, 9))
    assert lazy.end == len(body)
    assert list(lazy) == [c for c in canonical if c.key_group == -1 or 3 <= c.key_group <= 9]
    assert list(lazy) == []  # exhausted


@impl_params
def test_change_iterator_close_and_errors(impl):
    body = fmt.encode_change_set([StateChange(1, b"a"), StateChange(2, b"b")])
    it = impl.decode.iter_change_set(body)
    assert len(it) == 2 and next(it) == StateChange(1, b"a") and len(it) == 1
    it.close()
    assert list(it) == []
    with pytest.raises(fmt.CorruptChangelogError if hasattr(fmt, "CorruptChangelogError") else ValueError):
        impl.decode.iter_change_set(body[:-1])
