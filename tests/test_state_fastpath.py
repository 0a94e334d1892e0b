"""The bound single-key path of ValueState (dstl/_fast/_keyed, StateAppender.bind_value) where it
matters: the StatefulProcessor adapters call it once per key, for the Row and the pandas API; the
kernel's C encoder of lists, tuples and dicts gives msgpack's bytes (and its errors); the
materialization interval and the deferred append error, now kept in the kernel, still act."""
from __future__ import annotations

import collections
import enum

import pandas as pd
import pytest
from hypothesis import given, settings, strategies as st
from pyspark.sql import Row
from pyspark.sql.streaming import StatefulProcessor

from state_helpers import FULL, MAXP, storage  # noqa: F401 - fixture
from test_keyed_kernel import _appender, _scalars, impl_params, logged_everywhere
from dstl.state import changes as C


# --- the processor adapters take the bound kernel -----------------------------------------------------

class _RowTotals(StatefulProcessor):
    """Per key: events and value sum in one ValueState, read and written once per key."""

    def init(self, handle):
        self.totals = handle.getValueState("totals", "events long, value_sum long")

    def handleInputRows(self, key, rows, timerValues):
        old = self.totals.get()
        events, total = old if old is not None else (0, 0)
        for row in rows:
            events += 1
            total += row.value
        self.totals.update((events, total))
        yield Row(user=key[0], events=events, value_sum=total)

    def close(self):
        pass


class _PandasTotals(_RowTotals):
    def handleInputRows(self, key, rows, timerValues):
        old = self.totals.get()
        events, total = old if old is not None else (0, 0)
        for pdf in rows:
            events += len(pdf)
            total += int(pdf["value"].sum())
        self.totals.update((events, total))
        yield pd.DataFrame({"user": [key[0]], "events": [events], "value_sum": [total]})


def _ctx(api, user_type):
    from dstl.spark.task import arrow_output_schema as _arrow_output_schema
    from dstl.spark.processor import BatchContext
    from dstl.state.schema import parse_ddl

    return BatchContext(1000, 0, api=api, input_schema=parse_ddl(f"user {user_type}, value long"), time_zone="UTC",
                        output_arrow_schema=_arrow_output_schema(parse_ddl(
                            f"user {user_type}, events long, value_sum long")))


def _counting(backend, monkeypatch):
    """Counts the calls into what only the class's own ValueState.get/update use: the backend's
    key-group function (get) and `_mutated` (update, with no materialization interval)."""
    calls = {"kg": 0, "mutated": 0}
    kg, mutated = backend._kg, backend._mutated

    def counting_kg(key):
        calls["kg"] += 1
        return kg(key)

    def counting_mutated(n=1):
        calls["mutated"] += 1
        return mutated(n)

    monkeypatch.setattr(backend, "_kg", counting_kg)
    monkeypatch.setattr(backend, "_mutated", counting_mutated)
    return calls


@pytest.mark.parametrize("api", ["row", "pandas"])
@pytest.mark.parametrize("user_type,users", [("long", [5, 1, 9, 1, 5, 5]), ("string", ["bo", "al", "bo", "cy"])])
def test_processor_value_state_calls_are_the_bound_kernel(storage, monkeypatch, api, user_type, users):  # noqa: F811
    from dstl.spark.processor import ProcessorHandle, run_processor
    from dstl.state.backend import KeyedStateBackend
    from dstl.state.value import ValueState

    proc = _RowTotals() if api == "row" else _PandasTotals()
    rows = pd.DataFrame({"user": users, "value": list(range(1, len(users) + 1))})
    expected = {}
    for u, v in zip(users, rows["value"]):
        e, s = expected.get(u, (0, 0))
        expected[u] = (e + 1, s + v)

    # what the adapter holds is the kernel's bound pair
    backend = KeyedStateBackend(storage, f"fast-{api}-{user_type}", FULL, MAXP)
    handle = ProcessorHandle(backend)
    adapter = handle.getValueState("totals", "events long, value_sum long")
    raw = backend.get_state("totals")
    assert adapter._s is raw and type(raw) is ValueState
    for method, name in ((raw.get, "value_get"), (raw.update, "value_update")):
        assert method.__name__ == name and method.__self__ is raw._put, method

    # two batches through the runner: every key is read and written, none through the class's methods
    calls = _counting(backend, monkeypatch)
    for _ in range(2):
        run_processor(proc, rows, backend, _ctx(api, user_type), "user")
    assert calls == {"kg": 0, "mutated": 0}
    twice = {u: (2 * e, 2 * s) for u, (e, s) in expected.items()}
    assert {k: tuple(v) for k, v in raw.items()} == twice
    assert all(type(k) is type(users[0]) for k, _ in raw.items())  # stored as plain Python keys

    # the check can fail: the class's own methods in place of the bound pair are seen
    raw.get, raw.update = ValueState.get.__get__(raw), ValueState.update.__get__(raw)
    run_processor(proc, rows, backend, _ctx(api, user_type), "user")
    n = len(expected)
    assert calls == {"kg": n, "mutated": n}
    assert {k: tuple(v) for k, v in raw.items()} == {u: (3 * e, 3 * s) for u, (e, s) in expected.items()}
    backend.close()


# --- containers packed in C: msgpack's bytes and errors --------------------------------------------------

class _Kind(enum.IntEnum):
    A = 7


_Pair = collections.namedtuple("_Pair", "a b")

_leaves = st.one_of(_scalars, st.sampled_from([_Kind.A, _Pair(1, "x"), collections.OrderedDict(a=1), 2**64 - 1]))
_nested = st.recursive(
    _leaves,
    lambda inner: st.one_of(st.lists(inner, max_size=5), st.lists(inner, max_size=5).map(tuple),
                            st.dictionaries(st.one_of(st.text(max_size=4), st.integers(-300, 300), st.binary(max_size=3)),
                                            inner, max_size=4)),
    max_leaves=30)


def _deep(depth, leaf=1):
    v = leaf
    for _ in range(depth):
        v = [v]
    return v


_TOO_DEEP = _deep(2000)
_EDGES = [
    list(range(15)), list(range(16)), list(range(65535)), list(range(65536)), tuple(range(16)),
    {i: i for i in range(15)}, {i: -i for i in range(16)}, {str(i): None for i in range(65536)},
    [], (), {}, [[], {}, ()], [1.5, -0.0, float("inf"), True, False, None, b"", "", "é" * 40],
    _deep(31), _deep(32), _deep(33), _deep(200), _TOO_DEEP,  # beyond MAX_DEPTH: msgpack packs (or refuses) it
    [1, 2**70], [1, "\ud800"], {"k": object()}, [{1, 2}], {(1, 2): 3}, [1, -2**63, 2**63 - 1, 2**64 - 1, -2**63 - 1],
]


@settings(max_examples=300, deadline=None)
@given(value=_nested, more=st.lists(_nested, max_size=2))
def test_nested_values_encode_as_msgpack_in_both_implementations(value, more):
    logged_everywhere(C.SET, 3, "user-1", [value, *more])


@pytest.mark.parametrize("value", _EDGES, ids=range(len(_EDGES)))
def test_container_edges_encode_as_msgpack_in_both_implementations(value):
    out = logged_everywhere(C.SET, 300, 42, [value])
    if value is _TOO_DEEP:  # nested beyond msgpack's own recursion limit: its ValueError, naming the state
        assert out[0] is ValueError and "state 's', key 42: cannot serialize the change" in out[1]


@impl_params
def test_bound_update_encodes_a_row_value_as_the_class_method_does(mod):
    k, log, backend = _appender(mod)
    get, update = k.for_state(4, "v").bind_value(C.SET, None, None)
    value = [12, 3.25, "kind-a", None, True, [1, 2], {"x": b"y"}]
    update(77, value)
    assert log == [(k.kg(77), C.encode(C.SET, [4, 77, value]))] and get(77) is value


# --- the interval and the deferred error, kept in the kernel --------------------------------------------

def test_interval_and_deferred_error_act_through_the_bound_update(storage):  # noqa: F811
    from dstl.state.backend import KeyedStateBackend

    b = KeyedStateBackend(storage, "interval", FULL, MAXP, materialize_every_changes=4)
    v = b.value_state("v")
    assert b.materialize_every_changes == 4 and b.materialize_every_bytes is None
    for i in range(3):  # the METADATA change is not counted; the 4th update reaches the interval
        v.update(i, i)
    assert b.materializations == 0 and b._since_changes == 3
    v.update(3, 3)
    assert b.materializations == 1 and b._since_changes == 0
    b.materialize_every_changes = None  # set while running: the kernel follows
    for i in range(10):
        v.update(i, -i)
    assert b.materializations == 1 and b._since_changes == 10
    b.materialize_every_bytes = 1
    v.update(0, 5)
    assert b.materializations == 2 and b.materialize_every_bytes == 1
    b.materialize_every_bytes = None

    b._deferred_error = OSError("pre-emptive upload failed")  # as an append that failed leaves it
    with pytest.raises(OSError, match="pre-emptive upload failed"):
        v.update(1, 100)
    assert v.get(1) == 100 and b._deferred_error is None  # applied in memory, raised once
    v.update(1, 101)
    with pytest.raises(ValueError, match="positive int or None"):
        KeyedStateBackend(storage, "bad", FULL, MAXP, materialize_every_changes=0)
    b.close()


# --- the adapters' plain-value encode ------------------------------------------------------------------

@impl_params
def test_plain_list_copies_exactly_typed_tuples_and_lists_only(mod):
    types = (int, float, str)
    for value in [(1, 2.5, "a"), [1, 2.5, "a"]]:
        out = mod.plain_list(value, types)
        assert out == [1, 2.5, "a"] and type(out) is list and out is not value
    for value in [(1, 2, "a"), (True, 2.5, "a"), (1, 2.5), (1, 2.5, "a", None), (1, 2.5, None),
                  Row(a=1, b=2.5, c="a"), _Pair(1, 2.5), "abc", None, {1: 2}]:
        assert mod.plain_list(value, types) is None, value
    assert mod.plain_list((), ()) == [] and mod.plain_list((True,), (bool,)) == [True]


# --- the kernel's per-key-group cache sees every other path ----------------------------------------------

def test_bound_get_sees_what_other_paths_write_and_nothing_after_close(storage):  # noqa: F811
    from dstl.state.backend import KeyedStateBackend
    from dstl.state.value import ValueState

    b = KeyedStateBackend(storage, "cache", FULL, MAXP)
    v = b.value_state("v")
    keys = list(range(300)) + [f"u{i}" for i in range(300)]
    assert all(v.get(k) is None for k in keys)  # no group has entries yet: nothing cached
    v.update_many(keys[:200], list(range(200)))  # the bulk path creates the groups' tables
    v.update(0, "bound")
    assert [v.get(k) for k in keys[:200]] == ["bound"] + list(range(1, 200))
    for k in keys[200:]:
        v.update(k, k)
    v.clear(5)
    ValueState.update.__get__(v)(6, "class")  # the class's path writes into the same tables
    v.update_many([7, 8], [None, "many"])
    slow_get = ValueState.get.__get__(v)
    before = [slow_get(k) for k in keys]
    assert [v.get(k) for k in keys] == before
    assert (v.get(5), v.get(6), v.get(7), v.get(8), v.get("u299")) == (None, "class", None, "many", "u299")
    snap = b.snapshot(1).result(30)
    b.close()
    assert v.get("u299") is None and v.get(8, "gone") == "gone"  # the closed backend holds nothing

    r = KeyedStateBackend.restore(storage, "cache", FULL, MAXP, [snap])
    rv = r.get_state("v")
    assert rv.get.__name__ == "value_get" and [rv.get(k) for k in keys] == before
    rv.update("u1", 1)
    r.materialize()
    assert rv.get("u1") == 1 and rv.get(199) == 199
    r.close()
