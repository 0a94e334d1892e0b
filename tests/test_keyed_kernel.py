"""The single-key kernel of keyed state (dstl/_fast/_keyed and its twin) side by side: key groups,
payload bytes (equal to changes.encode), errors, counters and the deferred append error."""
from __future__ import annotations

import math

import pytest
from hypothesis import given, settings, strategies as st

from conftest import expected_implementation, heavy
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


@heavy  # compares both implementations in one run
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


# -- through a real changelog writer ----------------------------------------------------------------
# The Cython kernel hands a Cython writer's own `append` the encoded change in C (WriterCore._append_raw:
# no bytes object, no Python call); anything else gets bytes through the call. Every pairing of kernel
# and writer core must log the same files.

from test_writer_hotpath import CORES, T, _error, _handle_shape, _read, _Storage  # noqa: E402


def _changes(seed, n):
    """n mixed single-key changes `(sid, name, op, key, fields)`: sets, adds, clears, many-field (msgpack)
    arrays, a nested value, values that do not fit the writer's arena as it is (a new arena, the slow
    copy), keys over the whole key-group range."""
    import random

    rng = random.Random(seed)
    out = []
    for i in range(n):
        sid, name = rng.choice([(0, "v"), (1, "l"), (7, "m")])
        key = rng.choice([rng.randrange(-2**40, 2**40), f"user-{rng.randrange(5000)}", b"k%d" % rng.randrange(99)])
        r = rng.random()
        if r < 0.5:
            op, fields = C.SET, [rng.choice([rng.randrange(-2**63, 2**63), "x" * rng.randrange(300), 1.5, None,
                                             True, [1, "two", 3.0], {"a": [1, {"b": b"c"}]}])]
        elif r < 0.75:
            op, fields = C.ADD_ELEMENT, [rng.randrange(1000)]
        elif r < 0.9:
            op, fields = C.CLEAR, []
        else:
            op, fields = C.ADD_OR_UPDATE_ELEMENT, list(range(rng.randrange(12, 20)))
        if i % 97 == 50:
            fields = [b"\xab" * rng.randrange(70_000, 200_000)]
        out.append((sid, name, op, key, fields))
    return out


def _by_group(changes):
    groups = {}
    for kg, data in changes:
        groups.setdefault(kg, []).append(bytes(data))
    return groups


def test_every_kernel_and_writer_pairing_logs_the_same_files(tmp_path, monkeypatch):
    changes = _changes(11, 1500)
    expected = _by_group((_hash_py.assign_to_key_group(key, 128), C.encode(op, [sid, key] + fields))
                         for sid, _, op, key, fields in changes)
    shapes, reads = {}, {}
    for kname, mod in IMPLS:
        for wname, _ in CORES:
            st_ = _Storage(tmp_path / f"{kname}-{wname}", wname, monkeypatch, preemptive_persist_threshold="4 kb")
            try:
                w = st_.writer(KeyGroupRange(0, 127))
                k = mod.KeyedAppender(_Backend(KeyGroupRange(0, 127)), w.append, 128, KeyGroupRange(0, 127))
                states = {}
                for sid, name, op, key, fields in changes:
                    if sid not in states:
                        states[sid] = k.for_state(sid, name)
                    states[sid].change(op, key, *fields)
                assert (k.changes, k.nbytes) == (len(changes), sum(map(len, sum(expected.values(), []))))
                assert k.deferred_error is None
                h = w.persist(0, 1).result(T).job_manager_owned_snapshot
                shapes[kname, wname] = _handle_shape(h)
                reads[kname, wname] = _read(st_.storage, h)
            finally:
                st_.close()
            assert _by_group(reads[kname, wname]) == expected
            assert len(shapes[kname, wname][0]) > 10  # pre-emptive persists sealed many change sets
    first = next(iter(shapes))
    assert all(shapes[p] == shapes[first] and reads[p] == reads[first] for p in shapes)


def test_writer_errors_are_the_same_through_every_pairing(tmp_path, monkeypatch):
    """The writer's own errors reach the caller unchanged, nothing counted: a key group outside the
    writer's range, a closed writer. A pre-emptive persist that fails with OSError after the change
    was taken leaves it in deferred_error, the change counted and logged."""
    key_out = next(i for i in range(1000) if _hash_py.assign_to_key_group(i, 128) > 63)
    key_in = next(i for i in range(1000) if _hash_py.assign_to_key_group(i, 128) <= 63)
    got = {}
    for kname, mod in IMPLS:
        for wname, _ in CORES:
            st_ = _Storage(tmp_path / f"{kname}-{wname}", wname, monkeypatch, preemptive_persist_threshold="1 kb")
            out = []
            try:
                w = st_.writer(KeyGroupRange(0, 63))
                k = mod.KeyedAppender(_Backend(KeyGroupRange(0, 127)), w.append, 128, KeyGroupRange(0, 127))
                s = k.for_state(3, "v")
                for key in (key_out, key_in):
                    out.append(_outcome(lambda: s.change(C.SET, key, "x" * 10)))
                out.append((k.changes, k.nbytes))

                def fail():
                    raise OSError("pre-emptive upload failed")

                w._preemptive = fail
                out.append(_outcome(lambda: s.change(C.SET, key_in, "y" * 2000)))
                out.append((k.changes, k.nbytes, repr(k.deferred_error), len(w._buffer)))
                w.close()
                try:
                    s.change(C.SET, key_in, 1)
                except Exception as exc:  # compared below, type and message
                    out.append(_error(exc, w))
                out.append((k.changes, k.nbytes))
            finally:
                st_.close()
            got[kname, wname] = out
    first = got[next(iter(got))]
    assert first[0][0] is ValueError and "outside the writer's range KeyGroupRange" in first[0][1]
    assert first[1] == ("ok", _hash_py.assign_to_key_group(key_in, 128)) and first[2][0] == 1
    assert first[4][0] == 2 and "pre-emptive upload failed" in first[4][2] and first[4][3] == 2
    assert "WriterClosedError" in repr(first[5][0]) and first[6] == first[4][:2]
    assert all(v == first for v in got.values())


@pytest.mark.parametrize("wname", [w for w, _ in CORES])
def test_a_writer_that_overrides_append_is_called(tmp_path, monkeypatch, wname):
    """Only WriterCore's own append is taken in C: a subclass's override, and a writer swapped in
    later, get every change through the call."""
    st_ = _Storage(tmp_path, wname, monkeypatch)
    try:
        w = st_.writer(KeyGroupRange(0, 127))
        seen = []

        class Spy(type(w)):
            def append(self, key_group, data):
                seen.append((key_group, data))
                super().append(key_group, data)

        w.__class__ = Spy
        for _, mod in IMPLS:
            k = mod.KeyedAppender(_Backend(KeyGroupRange(0, 127)), w.append, 128, KeyGroupRange(0, 127))
            kg = k.for_state(0, "v").change(C.SET, "ann", 1)
            assert seen[-1] == (kg, C.encode(C.SET, [0, "ann", 1])) and type(seen[-1][1]) is bytes
            other = []
            k.writer_append = lambda g, data: other.append((g, data))
            k.for_state(0, "v").change(C.SET, "bob", 2)
            assert other == [(_hash_py.assign_to_key_group("bob", 128), C.encode(C.SET, [0, "bob", 2]))]
        assert len(seen) == len(IMPLS) and len(w._buffer) == len(IMPLS)
    finally:
        st_.close()


@settings(max_examples=200, deadline=None)
@given(key=_keys, value=_values, sid=st.sampled_from([0, 5, 127, 128, 70000, 2**40]))
def test_bound_update_and_get_agree_in_both_implementations(key, value, sid):
    """The bound update/get (int keys read once, hashed inline, the state id packed once) log what
    changes.encode gives and fail the same way as the twin, for any key, value and state id."""
    results = []
    for _, mod in IMPLS:
        k, log, backend = _appender(mod)
        slow = []
        backend._mutated = lambda: None
        get, update = k.for_state(sid, "v").bind_value(C.SET, lambda kk, d: slow.append(("get", kk)) or d,
                                                       lambda kk, v: slow.append(("update", kk, v)))
        out = _outcome(lambda: update(key, value))
        results.append((out, log, slow, _outcome(lambda: get(key, "absent")), k.changes, k.nbytes))
    for out, log, slow, got, changes, nbytes in results:
        if out[0] == "ok" and not slow:
            assert log == [(_hash_py.assign_to_key_group(key, 128), C.encode(C.SET, [sid, key, value]))]
            assert got == ("ok", value) and (changes, nbytes) == (1, len(log[0][1]))
        else:
            assert log == [] and changes == 0
    assert all(r == results[0] for r in results)
