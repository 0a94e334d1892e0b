"""The single-key kernel of keyed state (dstl/_fast/_keyed and its twin) side by side: key groups,
payload bytes (equal to changes.encode), errors, counters and the deferred append error."""
from __future__ import annotations

import math

import pytest
from hypothesis import given, settings, strategies as st

from conftest import expected_implementation
from dstl._fast import _hash_py, _keyed_py
from dstl.state import changes as C
from dstl.types import KeyGroupRange


def _impls():
    impls = [("python", _keyed_py)]
    try:
        from dstl._fast import _keyed
    except ImportError:
        if expected_implementation() == "cython":
            raise
    else:
        impls.append(("cython", _keyed))
    return impls


IMPLS = _impls()
impl_params = pytest.mark.parametrize("mod", [m for _, m in IMPLS], ids=[n for n, _ in IMPLS])


class _Backend:
    operator_id = "op"

    def __init__(self, kgr):
        self.key_group_range = kgr
        self._deferred_error = None
        self._table = {}


def _appender(mod, kgr=KeyGroupRange(0, 127), maxp=128, fail=None):
    log = []

    def append(kg, payload):
        log.append((kg, bytes(payload)))
        if fail is not None:
            raise fail

    backend = _Backend(kgr)
    return mod.KeyedAppender(backend, append, maxp, kgr), log, backend


def _outcome(fn):
    try:
        return ("ok", fn())
    except Exception as exc:  # compared between the implementations
        return (type(exc), str(exc))


_ints = st.one_of(st.integers(-2**63, 2**63 - 1), st.sampled_from(
    [0, 1, 31, 32, 127, 128, 255, 256, 65535, 65536, 2**32 - 1, 2**32, 2**63 - 1, -1, -32, -33, -128, -129,
     -32768, -32769, -2**31, -2**31 - 1, -2**63, 2**64 - 1, 2**64, -2**63 - 1]))
_strs = st.one_of(st.text(max_size=40), st.sampled_from(["", "x" * 31, "y" * 32, "z" * 255, "w" * 256,
                                                         "é" * 40000, "\U0001F600 emoji", "\ud800 lone"]))
_bytes = st.one_of(st.binary(max_size=40), st.sampled_from([b"", b"a" * 255, b"b" * 256, b"c" * 70000]))
_scalars = st.one_of(_ints, _strs, _bytes, st.none(), st.booleans(), st.floats(allow_nan=True),
                     st.sampled_from([math.inf, -0.0, 1.5]))
_values = st.one_of(_scalars, st.lists(_scalars, max_size=3), st.dictionaries(st.text(max_size=3), _ints, max_size=3),
                    st.sampled_from([object(), {1, 2}, complex(1, 2)]))
_keys = st.one_of(_ints, _strs, _bytes, st.sampled_from([True, 1.5, None, bytearray(b"k"), (1,)]))


@settings(max_examples=300, deadline=None)
@given(op=st.sampled_from([C.CLEAR, C.SET, C.ADD_ELEMENT, C.ADD_OR_UPDATE_ELEMENT]), sid=st.integers(0, 300),
       key=_keys, fields=st.lists(_values, max_size=3))
def test_both_implementations_log_what_changes_encode_gives(op, sid, key, fields):
    out = logged_everywhere(op, sid, key, fields)
    if out[0] == "ok":
        assert out[1] == _hash_py.assign_to_key_group(key, 128)


def logged_everywhere(op, sid, key, fields):
    """One change through every implementation's appender: each logs what `changes.encode` gives
    (or fails the same way, logging nothing); returns the common outcome."""
    results = []
    for _, mod in IMPLS:
        k, log, _ = _appender(mod)
        out = _outcome(lambda: k.for_state(sid, "s").change(op, key, *fields))
        results.append((out, log, k.changes, k.nbytes))
    for out, log, changes, nbytes in results:
        if out[0] == "ok":
            assert log == [(out[1], C.encode(op, [sid, key] + list(fields)))]
            assert (changes, nbytes) == (1, len(log[0][1]))
        else:
            assert log == [] and changes == 0
    assert all(r == results[0] for r in results)
    return results[0][0]


@impl_params
def test_key_errors(mod):
    k, log, _ = _appender(mod, KeyGroupRange(0, 9))
    import numpy as np

    cases = [(np.int64(3), TypeError, "convert int64 with int"), (True, TypeError, "got bool"),
             (1.5, TypeError, "got float"), (None, TypeError, "got NoneType"),
             (2**70, ValueError, "outside the int64 range")]
    for key, err, msg in cases:
        with pytest.raises(err, match=msg):
            k.kg(key)
    key = next(f"u{i}" for i in range(1000) if _hash_py.assign_to_key_group(f"u{i}", 128) > 9)
    with pytest.raises(ValueError, match=f"belongs to key group .*outside this backend's range KeyGroupRange.0, 9."):
        k.for_state(0, "s").change(C.SET, key, 1)
    assert log == []


@impl_params
def test_serialize_errors_name_state_and_key(mod):
    k, log, _ = _appender(mod)
    with pytest.raises(TypeError, match="state 'counts', key 5: cannot serialize the change"):
        k.for_state(0, "counts").change(C.SET, 5, object())
    with pytest.raises(OverflowError, match="state 'counts', key 5: cannot serialize the change"):
        k.for_state(0, "counts").change(C.SET, 5, 2**70)
    assert log == [] and k.changes == 0


@impl_params
def test_closed_and_deferred_append_errors(mod):
    k, log, backend = _appender(mod, fail=OSError("pre-emptive upload failed"))
    s = k.for_state(1, "s")
    assert s.change(C.SET, 7, 1) == _hash_py.assign_to_key_group(7, 128)
    assert isinstance(k.deferred_error, OSError) and len(log) == 1 and k.changes == 1
    k.closed = True
    with pytest.raises(RuntimeError, match="keyed state backend 'op' KeyGroupRange.0, 127. is closed"):
        s.change(C.SET, 7, 1)
    with pytest.raises(RuntimeError, match="is closed"):
        k.append(3, b"x")
    assert len(log) == 1


@impl_params
def test_many_fields_fall_back_to_msgpack_arrays(mod):
    k, log, _ = _appender(mod)
    fields = list(range(20))
    k.for_state(2, "s").change(C.ADD, 9, *fields)
    assert log[0][1] == C.encode(C.ADD, [2, 9] + fields)


def test_backend_uses_the_selected_kernel(tmp_path):
    from dstl import _impl
    from dstl.changelog.storage import open_storage
    from dstl.state.backend import KeyedStateBackend

    with open_storage(str(tmp_path)) as st_:
        b = KeyedStateBackend(st_, "op", KeyGroupRange(0, 127), 128)
        assert type(b._k).__module__ == f"dstl._fast._keyed{'' if _impl.IMPLEMENTATION == 'cython' else '_py'}"
        v = b.value_state("v")
        v.update("a", 1)
        assert b._since_changes == 1 and b._since_bytes == len(C.encode(C.SET, [v._sid, "a", 1]))
        b.close()


@impl_params
def test_set_logs_the_change_then_fills_the_table(mod):
    k, log, backend = _appender(mod)
    backend._table = {}
    s = k.for_state(4, "v")
    kg = s.set(C.SET, "ann", b"logged", {"python": "value"})
    assert log == [(kg, C.encode(C.SET, [4, "ann", b"logged"]))]
    assert backend._table == {kg: {"v": {"ann": {"python": "value"}}}}
    s.set(C.SET, "ann", 2, 2)
    assert backend._table[kg]["v"]["ann"] == 2
    with pytest.raises(TypeError, match="cannot serialize"):
        s.set(C.SET, "bob", object(), 1)
    assert len(log) == 2 and "bob" not in backend._table.get(_hash_py.assign_to_key_group("bob", 128), {}).get("v", {})


@impl_params
def test_bound_value_get_and_update_log_fill_and_defer_like_the_state_methods(mod):
    """bind_value's update logs SET and fills the table (the bytes changes.encode gives); None values
    and other key types go to the state's own methods; _mutated runs only when the backend has
    something to do (a deferred append error, a reached materialization interval), and then raises it."""
    k, log, backend = _appender(mod)
    slow = []
    mutated = []
    backend._mutated = lambda: mutated.append(k.deferred_error)
    get, update = k.for_state(4, "v").bind_value(
        C.SET, lambda key, default: slow.append(("get", key, default)) or "slow",
        lambda key, value: slow.append(("update", key, value)))
    update("ann", [1, 2])
    kg = _hash_py.assign_to_key_group("ann", 128)
    assert log == [(kg, C.encode(C.SET, [4, "ann", [1, 2]]))]
    assert backend._table == {kg: {"v": {"ann": [1, 2]}}}
    assert get("ann") == [1, 2] and get(b"nobody", 0) == 0 and get(7) is None
    assert mutated == [] and slow == []
    update("ann", None)
    update(True, 1)
    assert get(1.5, "d") == "slow"
    assert slow == [("update", "ann", None), ("update", True, 1), ("get", 1.5, "d")]
    k.every_changes = 10  # not reached: nothing to do
    update(3, 3)
    assert mutated == [] and k.changes == 2
    k.every_changes = 3
    update(3, 4)
    assert mutated == [None]
    k.every_changes = 0
    k.deferred_error = OSError("pre-emptive upload failed")
    update(3, 5)
    assert len(mutated) == 2 and isinstance(mutated[1], OSError)
    with pytest.raises(ValueError, match="outside this backend's range"):
        k2, _, _ = _appender(mod, kgr=KeyGroupRange(0, 0))
        k2.for_state(1, "v").bind_value(C.SET, None, None)[1]("ann", 1)


def test_value_state_binds_the_fast_path_only_where_it_applies(tmp_path):
    """A plain ValueState with the native serializer gets the kernel's bound methods; a reducing state
    and another serializer keep the class's; materialize_every_changes still fires through the fast path."""
    from dstl.changelog.storage import open_storage
    from dstl.state.backend import KeyedStateBackend
    from dstl.state.serializers import PickleSerializer

    with open_storage(str(tmp_path)) as st_:
        b = KeyedStateBackend(st_, "op", KeyGroupRange(0, 127), 128, materialize_every_changes=3)
        v = b.value_state("v")
        assert v.update.__name__ == "value_update" and v.get.__name__ == "value_get"
        assert b.reducing_state("r", lambda a, c: a + c).update.__func__.__qualname__ == "ReducingState.update"
        assert b.value_state("p", serializer=PickleSerializer()).update.__func__.__qualname__ == "ValueState.update"
        for i in range(3):
            v.update(i, i * 10)
        assert b.materializations == 1 and b._since_changes == 0
        assert [v.get(i) for i in range(3)] == [0, 10, 20]
        b.close()
