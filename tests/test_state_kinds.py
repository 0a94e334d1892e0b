"""Every state kind provides all of its behaviour; a kind that leaves a part out is refused loudly.

The kinds are the `_State` subclasses registered in dstl.state.kinds; what each must provide is
dstl.state.base.KIND_MEMBERS. The layers above keep one entry per kind (the processor's adapters,
the in-memory baseline) and check it when imported.
"""
from __future__ import annotations

import inspect

import pytest

from dstl.spark import memory as M
from dstl.spark import processor_adapters as PA
from dstl.state import changes as C
from dstl.state.backend import KeyedStateBackend
from dstl.state.base import KIND_CLASSES, KIND_MEMBERS, _State
from dstl.state.kinds import kind_class, kind_names, require_every_kind
from dstl.state.schema import StateSchema
from dstl.state.ttl import purge_expired
from dstl.state.value import ValueState
from state_helpers import FULL, MAXP, storage  # noqa: F401  (storage: fixture)


def _complete_members(**leave_out):
    """Class attributes of a kind that provides everything, minus the names in `leave_out`."""
    attrs = {m: getattr(ValueState, m) for m in KIND_MEMBERS if m != "kind"}
    for name in leave_out:
        attrs.pop(name)
    return attrs


def test_every_kind_of_the_format_is_registered_with_every_member():
    assert kind_names() == list(C.KINDS) == ["value", "list", "map", "reducing"]
    for kind in C.KINDS:
        cls = kind_class(kind)
        assert issubclass(cls, _State) and cls.kind == kind and KIND_CLASSES[kind] is cls
        for member in KIND_MEMBERS:
            # provided by the kind (or a kind it extends), never by the shared base
            owner = next(c for c in cls.__mro__ if member in c.__dict__)
            assert owner is not _State and issubclass(owner, _State), (kind, member)
        assert set(cls.feed_ops) >= {C.CLEAR}, kind
        assert cls.ttl_view is None or cls.ttl_view.__name__.startswith("Ttl"), kind


def test_a_kind_that_leaves_a_member_out_is_refused_at_its_class_statement():
    before = dict(KIND_CLASSES)
    with pytest.raises(TypeError) as exc:
        type("HalfListState", (_State,), dict(_complete_members(_purge_entry=1, _feed_cells=1), kind="list"))
    msg = str(exc.value)
    assert "state kind 'list' (HalfListState) does not provide _purge_entry, _feed_cells" in msg
    assert "KIND_MEMBERS" in msg
    assert KIND_CLASSES == before  # nothing was registered


def test_a_kind_the_format_does_not_know_is_refused():
    before = dict(KIND_CLASSES)
    with pytest.raises(TypeError, match=r"state kind 'aggregating' \(AggregatingState\) is not one of the "
                                        r"format's kinds value, list, map, reducing"):
        type("AggregatingState", (_State,), dict(_complete_members(), kind="aggregating"))
    assert KIND_CLASSES == before


def test_a_second_class_for_a_kind_is_refused():
    with pytest.raises(TypeError, match="state kind 'map' is already provided by MapState, not OtherMapState"):
        type("OtherMapState", (_State,), dict(_complete_members(), kind="map"))
    assert kind_class("map").__name__ == "MapState"


def test_an_unknown_kind_name_is_a_clear_error():
    with pytest.raises(ValueError, match=r"unknown state kind 'set' \(known: value, list, map, reducing\)"):
        kind_class("set")


def test_a_table_per_kind_must_list_every_kind():
    require_every_kind({k: None for k in C.KINDS}, "t")
    with pytest.raises(TypeError, match="the adapters: no entry for map, reducing"):
        require_every_kind({"value": 1, "list": 2}, "the adapters")
    with pytest.raises(TypeError, match="t: entries for unknown kinds bag"):
        require_every_kind(dict({k: 1 for k in C.KINDS}, bag=1), "t")


def test_the_upper_layers_have_an_entry_for_every_kind():
    assert set(PA.ADAPTERS) == set(C.KINDS)
    assert set(M.MEMORY_KINDS) == set(C.KINDS)
    # a processor may declare exactly the kinds that have an adapter
    declarable = {k for k, cls in PA.ADAPTERS.items() if cls is not None}
    assert declarable == {"value", "list", "map"}
    for kind in declarable:
        assert PA.adapter_for(kind).kind == kind
        StateSchema("s", kind, "v long", "k string" if kind == "map" else None)
    with pytest.raises(ValueError, match="cannot hold reducing state"):
        PA.adapter_for("reducing")
    with pytest.raises(ValueError, match="state kind must be value, list or map"):
        StateSchema("s", "reducing", "v long")


@pytest.mark.parametrize("kind", ["value", "list", "map"])
def test_a_deleted_state_handle_fails_on_every_method(kind):
    cls = PA.ADAPTERS[kind]
    public = {n for n, f in inspect.getmembers(cls, inspect.isfunction) if not n.startswith("_")}
    assert set(cls.dropped_messages) == public
    assert issubclass(cls._dropped, cls)
    assert all(getattr(cls._dropped, n) is not getattr(cls, n) for n in public)


def test_a_kind_without_ttl_says_so(storage):
    b = KeyedStateBackend(storage, "op", FULL, MAXP)
    try:
        r = b.reducing_state("total", lambda a, x: a + x)
        with pytest.raises(ValueError, match="reducing state 'total' takes no TTL"):
            r.with_ttl(10, lambda: 0)
        assert type(b.value_state("v", ttl_ms=5)).__name__ == "TtlValueState"
    finally:
        b.close()


def test_ttl_purge_goes_by_each_kinds_layout(storage):
    now = [1000]
    b = KeyedStateBackend(storage, "op", FULL, MAXP, ttl_clock=lambda: now[0])
    try:
        v, li, m = b.value_state("v", ttl_ms=10), b.list_state("l", ttl_ms=10), b.map_state("m", ttl_ms=10)
        v.update("a", 1)
        li.add("a", 1)
        m.put("a", "x", 1)
        now[0] = 1005
        v.update("b", 2)
        li.add("a", 2)
        m.put("a", "y", 2)
        now[0] = 1010  # the first writes expire (expires_at <= now), the second ones live on
        assert purge_expired(b, now[0]) == 3
        assert dict(v.items()) == {"b": 2} and li.get("a") == [2] and m.items("a") == [("y", 2)]
        assert purge_expired(b, 2000) == 3
        assert b.key_groups() == []
    finally:
        b.close()


def test_the_memory_baseline_folds_as_the_reducing_state_does(storage):
    b = KeyedStateBackend(storage, "op", FULL, MAXP)
    try:
        mem = M.MemoryState().reducing_state("r", max)
        real = b.reducing_state("r", max)
        keys, values = ["a", "b", "a", "c", "a"], [3, 1, 7, 2, 5]
        mem.add_many(keys, values)
        real.add_many(keys, values)
        mem.add("b", 9)
        real.add("b", 9)
        assert dict(mem.items()) == dict(real.items()) == {"a": 7, "b": 9, "c": 2}
        assert M.MemoryState().reducing_state("r", max).get("a", -1) == -1
        with pytest.raises(TypeError, match="reduce_fn must be callable"):
            M.MemoryState().reducing_state("r", None)
    finally:
        b.close()
