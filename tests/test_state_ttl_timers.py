"""TTL states, timers as keyed state (rescaled like state: FLINK-26063), declared schemas, numpy keys."""
from __future__ import annotations

import datetime as dt
import decimal

import numpy as np
import pytest

from dstl.keygroups import key_group_ranges
from dstl.state.backend import KeyedStateBackend
from dstl.state.schema import StateSchema, ValueSchema, parse_ddl
from dstl.state.timers import TIMER_STATE, TimerService

from state_helpers import FULL, MAXP, storage  # noqa: F401  (storage: fixture)


class Clock:
    def __init__(self, now: int = 0):
        self.now = now

    def __call__(self) -> int:
        return self.now


def _rescale(storage, backends, checkpoint_id, parallelism, **kw):
    """Snapshot every backend, close them, restore at `parallelism` (every old snapshot offered)."""
    snaps = [b.snapshot(checkpoint_id).result() for b in backends]
    for b in backends:
        b.close()
    return [KeyedStateBackend.restore(storage, "op", r, MAXP, snaps, **kw)
            for r in key_group_ranges(MAXP, parallelism)]


def _owner(backends, key):
    from dstl.keygroups import assign_to_key_group

    kg = assign_to_key_group(key, MAXP)
    return next(b for b in backends if b.key_group_range.start <= kg <= b.key_group_range.end)


# ------------------------------------------------------------------ TTL

def test_ttl_value_list_map_expire_at_once_and_updates_reset(storage):
    clock = Clock(1_000)
    b = KeyedStateBackend(storage, "op", FULL, MAXP, ttl_clock=clock)
    v = b.value_state("v", ttl_ms=100)
    lst = b.list_state("l", ttl_ms=100)
    m = b.map_state("m", ttl_ms=100)
    v.update("a", 1)
    v.update("b", 2)
    lst.add("a", "x")
    m.put("a", "k1", 1)
    clock.now = 1_050
    v.update("a", 10)          # resets a's expiry to 1_150
    lst.add("a", "y")          # expires at 1_150, "x" at 1_100
    m.put("a", "k2", 2)
    assert v.get("b") == 2 and lst.get("a") == ["x", "y"] and m.items("a") == [("k1", 1), ("k2", 2)]
    clock.now = 1_100          # expired when expires_at <= now
    assert v.get("b") is None and not v.contains_key("b")
    assert v.get("a") == 10
    assert lst.get("a") == ["y"]
    assert m.items("a") == [("k2", 2)] and m.get("a", "k1") is None
    assert dict(v.items()) == {"a": 10}
    clock.now = 1_150
    assert v.get("a") is None and lst.get("a") == [] and m.is_empty("a")
    assert len(v) == 0
    b.close()


def test_ttl_expired_values_leave_memory_and_the_log_at_materialization(storage):
    clock = Clock(0)
    b = KeyedStateBackend(storage, "op", FULL, MAXP, ttl_clock=clock)
    v = b.value_state("v", ttl_ms=10)
    plain = b.value_state("plain")
    for k in range(50):
        v.update(k, k)
        plain.update(k, k)
    clock.now = 5
    for k in range(10):
        v.update(k, -k)        # these 10 live until 15
    clock.now = 12
    b.materialize()            # purge first: 40 expired values dropped from memory, not snapshotted
    assert sum(len(t.get("v", {})) for t in b._table.values()) == 10
    snap = b.snapshot(1).result()
    b.close()
    # a restore whose clock says "long ago" would show expired values if they were still in the log
    old = Clock(0)
    r = KeyedStateBackend.restore(storage, "op", FULL, MAXP, [snap], ttl_clock=old)
    raw = r.get_state("v")
    assert sorted(raw.keys_with_state()) == list(range(10))
    assert r.get_state("v").meta.options == {"ttl": True}
    assert len(r.get_state("plain")) == 50
    view = r.value_state("v", ttl_ms=10)
    assert [view.get(k) for k in range(10)] == [-k for k in range(10)]
    r.close()


def test_ttl_cannot_be_added_to_an_existing_state_and_is_validated(storage):
    b = KeyedStateBackend(storage, "op", FULL, MAXP)
    b.value_state("v")
    with pytest.raises(ValueError, match="registered with options"):
        b.value_state("v", ttl_ms=5)
    for bad in (0, -1, 1.5, True, "10"):
        with pytest.raises(ValueError, match="ttl_ms"):
            b.value_state("w", ttl_ms=bad)
    b.close()


# ------------------------------------------------------------------ timers

def test_timers_survive_rescale_2_3_1_with_deletions_in_the_right_key_group(storage):
    """Timers and their deletions move with their key groups (FLINK-26063 logged a deletion in the
    wrong key group, so a rescale revived deleted timers)."""
    backends = [KeyedStateBackend(storage, "op", r, MAXP) for r in key_group_ranges(MAXP, 2)]
    keys = [f"k{i}" for i in range(40)]
    for k in keys:
        TimerService(_owner(backends, k)).register(k, 100)
        TimerService(_owner(backends, k)).register(k, 200)
    backends = _rescale(storage, backends, 1, 3)
    for k in keys[:20]:  # delete after a rescale, in the new owner
        TimerService(_owner(backends, k)).delete(k, 100)
    backends = _rescale(storage, backends, 2, 1)
    (one,) = backends
    svc = TimerService(one)
    due = svc.due(150)
    assert sorted(k for _, k in due) == sorted(keys[20:]) and {ts for ts, _ in due} == {100}
    assert svc.list("k0") == [200] and svc.list("k39") == [100, 200]
    for ts, k in due:  # fire: deleted in the same batch
        svc.delete(k, ts)
    backends = _rescale(storage, [one], 3, 3)
    due_again = [t for b in backends for t in TimerService(b).due(150)]
    assert due_again == []  # fired timers never come back
    assert sorted(k for b in backends for k, ts in TimerService(b).all() if ts == 200) == sorted(keys)
    for b in backends:
        b.close()


def test_timer_service_order_and_validation(storage):
    b = KeyedStateBackend(storage, "op", FULL, MAXP)
    svc = TimerService(b)
    svc.register("b", 5)
    svc.register("a", 5)
    svc.register("a", 3)
    svc.register("a", 3)  # again: nothing new
    assert svc.due(5) == [(3, "a"), (5, "a"), (5, "b")]
    assert svc.due(4) == [(3, "a")]
    assert len(svc) == 3
    svc.delete("zzz", 1)  # absent: nothing logged, no error
    with pytest.raises(TypeError, match="timestamp"):
        svc.register("a", 1.5)
    assert TIMER_STATE in b.state_names
    b.close()


# ------------------------------------------------------------------ friction: numpy scalar keys

def test_numpy_scalars_are_keys_and_stored_as_python(storage):
    b = KeyedStateBackend(storage, "op", FULL, MAXP)
    v = b.value_state("v")
    lst = b.list_state("l")
    m = b.map_state("m")
    v.update(np.int64(7), "i")
    v.update(np.str_("s"), "s")
    v.update(np.bytes_(b"b"), "b")
    lst.add(np.int32(7), 1)
    m.put(np.str_("s"), "u", 1)
    assert v.get(7) == "i" and v.get("s") == "s" and v.get(b"b") == "b"
    assert v.get(np.int64(7)) == "i"
    assert {type(k) for k in v.keys_with_state()} == {int, str, bytes}
    assert lst.get(7) == [1] and m.get("s", "u") == 1
    snap = b.snapshot(1).result()  # encodes the stored keys: numpy objects would not serialize
    b.close()
    r = KeyedStateBackend.restore(storage, "op", FULL, MAXP, [snap])
    assert r.get_state("v").get(7) == "i"
    with pytest.raises(TypeError, match="state keys"):
        r.get_state("v").update(np.float64(1.0), 1)
    with pytest.raises(TypeError, match="state keys"):
        r.get_state("v").update(np.bool_(True), 1)
    r.close()


# ------------------------------------------------------------------ declared schemas

def test_value_schema_round_trips_spark_types():
    s = ValueSchema("n long, x double, name string, ok boolean, raw binary, ts timestamp, d date, "
                    "amount decimal(10,2), tags array<string>, attrs map<string,int>, inner struct<a: int, b: string>")
    value = (np.int64(5), 1.5, "u", True, b"\x00", dt.datetime(2024, 1, 2, 3, 4, 5, 6), dt.date(2024, 1, 2),
             decimal.Decimal("1.25"), ["a"], {"k": 1}, (1, "z"))
    stored = s.encode(value)
    assert all(not isinstance(x, np.generic) for x in stored)
    back = s.decode(stored)
    assert back == (5, 1.5, "u", True, b"\x00", dt.datetime(2024, 1, 2, 3, 4, 5, 6), dt.date(2024, 1, 2),
                    decimal.Decimal("1.25"), ["a"], {"k": 1}, (1, "z"))
    assert s.encode({"n": 1, "x": 2.0}) [:2] == [1, 2.0]


def test_value_schema_errors_name_the_field():
    s = ValueSchema("n long, name string")
    with pytest.raises(ValueError, match="2 field"):
        s.encode((1,))
    with pytest.raises(TypeError, match="field 'name'"):
        s.encode((1, 2))
    with pytest.raises(TypeError, match="field 'n'"):
        s.encode(("x", "y"))
    with pytest.raises(ValueError, match="not a valid DDL"):
        ValueSchema("n lung")
    assert ValueSchema("long").encode(3) == [3]  # a bare scalar for a one-field schema


def test_map_user_keys_are_scalars_or_packed():
    one = ValueSchema("k string")
    two = ValueSchema("a string, b long")
    assert one.encode_key(("x",)) == "x" and one.decode_key("x") == ("x",)
    packed = two.encode_key(("x", 1))
    assert isinstance(packed, bytes) and two.decode_key(packed) == ("x", 1)


def test_parse_ddl_without_spark_and_state_schema_record():
    assert parse_ddl("a long, b struct<x: int, y: array<string>>").simpleString() == \
        "struct<a:bigint,b:struct<x:int,y:array<string>>>"
    assert parse_ddl("decimal(5,1)").simpleString() == "decimal(5,1)"
    rec = StateSchema("m", "map", "v long", "k string", ttl_ms=10).to_record()
    assert rec["kind"] == "map" and rec["value_ddl"] == "v bigint" and rec["user_key_ddl"] == "k string"
    again = StateSchema.from_record("m", rec)
    assert again.value == ValueSchema("v long") and again.ttl_ms == 10
    with pytest.raises(ValueError, match="user key"):
        StateSchema("m", "map", "v long")
