"""Keyed state on a real changelog (local filesystem, direct and thread upload modes)."""
from __future__ import annotations

import operator
import os

import numpy as np
import pandas as pd
import pyarrow as pa
import pytest

from conftest import heavy
from dstl.keygroups import assign_to_key_group, compute_key_group_range_for_operator_index as kg_range
from dstl.state import changes as C
from dstl.state.backend import KeyedStateBackend, KeyedStateSnapshot
from dstl.state.serializers import PICKLE
from dstl.changelog.storage import open_storage
from dstl.types import KeyGroupRange

from state_helpers import FULL, MAXP, dump, storage  # noqa: F401  (storage: fixture)


def union(backends):
    out = {}
    for b in backends:
        for name, items in dump(b).items():
            dst = out.setdefault(name, {})
            assert not set(dst) & set(items), "two subtasks hold the same key"
            dst.update(items)
    return out


def logged(storage, snapshot):
    """Every decoded change of a snapshot's handles: [(key_group, op, body)]."""
    reader = storage.create_reader()
    out = []
    for h in snapshot.handles():
        for ch in reader.read_all(h):
            op, body = C.decode(ch.data)
            out.append((ch.key_group, op, body))
    return out


def restore(storage, snaps, parallelism=1, index=0, **kw):
    return KeyedStateBackend.restore(storage, "op", kg_range(MAXP, parallelism, index), MAXP, snaps, **kw)


# ------------------------------------------------------------------ per state type

def test_value_state_ops_log_and_restore(storage):
    b = KeyedStateBackend(storage, "op", FULL, MAXP)
    v = b.value_state("v")
    v.update("a", 1)
    v.update(7, {"nested": [1, 2]})
    v.update(b"\x00k", 2.5)
    v.update("a", 3)
    v.clear(7)
    v.update("gone", 1)
    v.update("gone", None)  # None clears, as in Flink
    assert v.get("a") == 3 and v.get(7) is None and v.get(7, "d") == "d" and v.get(b"\x00k") == 2.5
    assert dict(v.items()) == {"a": 3, b"\x00k": 2.5}
    assert v.contains_key("a") and not v.contains_key("gone") and len(v) == 2
    snap = b.snapshot(1).result()
    changes = logged(storage, snap)
    # one change per mutation; within a key group in append order
    assert sorted(op for _, op, _ in changes) == sorted([C.METADATA] + [C.SET] * 5 + [C.CLEAR] * 2)
    assert [(op, body[2] if op == C.SET else None) for _, op, body in changes if op != C.METADATA and body[1] == "a"] == \
        [(C.SET, 1), (C.SET, 3)]
    assert changes[0][0] == -1 and changes[0][1] == C.METADATA  # meta group first (canonical order)
    for kg, op, body in changes[1:]:
        assert kg == assign_to_key_group(body[1], MAXP)
    r = restore(storage, [snap])
    assert dump(r) == dump(b)
    assert r.value_state("v").get("a") == 3


def test_list_state(storage):
    b = KeyedStateBackend(storage, "op", FULL, MAXP)
    ls = b.list_state("l")
    ls.add("k", 1)
    ls.add_all("k", [2, 3])
    ls.add_all("k", [])          # no change
    ls.add("j", "x")
    ls.update("j", ["y", "z"])
    ls.update("i", [1])
    ls.update("i", [])           # clears
    got = ls.get("k")
    got.append(99)               # a copy: the state is unchanged
    assert ls.get("k") == [1, 2, 3] and ls.get("j") == ["y", "z"] and ls.get("i") == []
    ops = sorted(op for _, op, _ in logged(storage, b.snapshot(1).result()))
    assert ops == sorted([C.METADATA, C.ADD_ELEMENT, C.ADD, C.ADD_ELEMENT, C.SET, C.SET, C.CLEAR])
    assert dump(restore(storage, [b.snapshot(2).result()])) == dump(b)


def test_bounded_list_state_keeps_last_n_through_restore(storage):
    b = KeyedStateBackend(storage, "op", FULL, MAXP)
    last = b.list_state("last", max_length=3)
    for i in range(5):
        last.add("u", i)
    last.add_all("u", [10, 11])
    last.add_many(["u", "w", "u"], [20, 30, 21])
    assert last.get("u") == [11, 20, 21] and last.get("w") == [30]
    r = restore(storage, [b.snapshot(1).result()])
    assert r.list_state("last", max_length=3).get("u") == [11, 20, 21]
    with pytest.raises(ValueError, match="registered with options"):
        r.list_state("last", max_length=4)
    with pytest.raises(ValueError, match="max_length"):
        b.list_state("x", max_length=0)


def test_map_state(storage):
    b = KeyedStateBackend(storage, "op", FULL, MAXP)
    m = b.map_state("m")
    m.put("u", "a", 1)
    m.put("u", 2, [1, 2])
    m.put_all("u", {"b": 3, b"c": None})
    m.put_all("u", {})
    m.remove("u", "a")
    m.put("v", "x", 1)
    m.remove("v", "x")           # last entry gone: no state for v
    m.put("w", "x", 1)
    m.clear("w")
    assert m.get("u", "a") is None and m.get("u", 2) == [1, 2] and m.contains("u", b"c")
    assert sorted(m.keys("u"), key=repr) == sorted([2, "b", b"c"], key=repr)
    assert dict(m.items("u")) == {2: [1, 2], "b": 3, b"c": None} and m.size("u") == 3
    assert m.is_empty("v") and m.items("v") == [] and not m.contains_key("v")
    with pytest.raises(TypeError, match="map user keys"):
        m.put("u", (1, 2), 1)
    snap = b.snapshot(1).result()
    ops = [op for _, op, _ in logged(storage, snap)]
    assert ops.count(C.ADD_OR_UPDATE_ELEMENT) == 4 and ops.count(C.ADD) == 1 and ops.count(C.REMOVE_ELEMENT) == 2
    assert dump(restore(storage, [snap])) == dump(b)


def test_reducing_state(storage):
    b = KeyedStateBackend(storage, "op", FULL, MAXP)
    s = b.reducing_state("sum", operator.add)
    s.add("a", 1)
    s.add("a", 2)
    s.add_many(["a", "b", "b"], [10, 1, 1])
    assert s.get("a") == 13 and s.get("b") == 2
    changes = logged(storage, b.snapshot(1).result())
    sets = [body for _, op, body in changes if op == C.SET_INTERNAL]
    # the reduced results are logged, so a replay needs no reduce function
    assert [x[2] for x in sets if x[1] == "a"] == [1, 3, 13] and len(sets) == 4
    r = restore(storage, [b.snapshot(2).result()])
    assert r.get_state("sum").get("a") == 13
    with pytest.raises(RuntimeError, match="register it again"):
        r.get_state("sum").add("a", 1)
    r.reducing_state("sum", operator.add).add("a", 1)
    assert r.get_state("sum").get("a") == 14


def test_pickle_and_custom_serializers(storage):
    class Rev:
        id = "test-reverse"

        def dumps(self, obj):
            return obj[::-1].encode()

        def loads(self, data):
            return bytes(data).decode()[::-1]

    b = KeyedStateBackend(storage, "op", FULL, MAXP)
    p = b.value_state("p", serializer=PICKLE)
    p.update("k", (1, frozenset({2})))
    lp = b.list_state("lp", serializer="pickle")
    lp.add_all("k", [(1,), (2,)])
    mp = b.map_state("mp", serializer=PICKLE)
    mp.put("k", "u", {3})
    rv = b.value_state("rv", serializer=Rev())
    rv.update_many(["a", "b"], ["hello", "world"])
    snap = b.snapshot(1).result()
    assert any(op == C.SET and body[2] == b"olleh" for _, op, body in logged(storage, snap))
    with pytest.raises(ValueError, match="unknown state serializer id 'test-reverse'"):
        restore(storage, [snap])
    r = restore(storage, [snap], serializers={"test-reverse": Rev()})
    assert r.get_state("p").get("k") == (1, frozenset({2}))  # pickle keeps tuples and sets
    assert r.get_state("lp").get("k") == [(1,), (2,)] and r.get_state("mp").get("k", "u") == {3}
    assert r.get_state("rv").get("b") == "world"
    r.materialize()
    r2 = restore(storage, [r.snapshot(5).result()], serializers={"test-reverse": Rev()})
    assert dump(r2) == dump(b)


# ------------------------------------------------------------------ bulk updates

class CountingWriter:
    """Wraps the real writer to count calls (everything still goes to the real writer)."""

    def __init__(self, writer):
        self._w = writer
        self.calls = {"append": 0, "append_many": 0}

    def append(self, *a):
        self.calls["append"] += 1
        return self._w.append(*a)

    def append_many(self, *a):
        self.calls["append_many"] += 1
        return self._w.append_many(*a)

    def __getattr__(self, name):
        return getattr(self._w, name)


@pytest.mark.parametrize("keys", [
    np.arange(2000, dtype=np.int64),
    pd.Series([f"user-{i}" for i in range(2000)]),
    pa.array([f"user-{i}" for i in range(2000)]),
    [f"u{i}".encode() for i in range(2000)],
], ids=["int64", "pandas-str", "arrow-str", "bytes-list"])
def test_update_many_one_append_many_per_batch(storage, keys):
    b = KeyedStateBackend(storage, "op", FULL, MAXP)
    spy = b._writer = CountingWriter(b._writer)
    v = b.value_state("v")
    values = np.arange(2000) * 3 - 1000
    v.update_many(keys, values)
    assert spy.calls == {"append": 0, "append_many": 1}
    pykeys = keys.tolist() if hasattr(keys, "tolist") else (keys.to_pylist() if hasattr(keys, "to_pylist") else keys)
    assert all(v.get(k) == int(x) for k, x in zip(pykeys, values))
    snap = b.snapshot(1).result()
    sets = [(kg, body) for kg, op, body in logged(storage, snap) if op == C.SET]
    assert len(sets) == 2000
    assert all(kg == assign_to_key_group(body[1], MAXP) for kg, body in sets)
    assert dump(restore(storage, [snap])) == dump(b)


def test_update_many_duplicates_none_and_objects(storage):
    b = KeyedStateBackend(storage, "op", FULL, MAXP)
    spy = b._writer = CountingWriter(b._writer)
    v = b.value_state("v")
    v.update("c", 1)
    v.update_many(["a", "b", "a", "c"], [1, 2, 3, None])    # later rows win; None clears
    v.update_many(pd.Series(["x", "y"]), pd.Series([[1, 2], {"k": "v"}]))
    v.update_many([], [])
    v.update_many(["z"], [[[1, 2], [3, 4]]])          # one row, a nested list value
    v.update_many(["w", "q"], [[1, 2], [3, 4]])       # equal-length lists stay row values
    assert v.get("z") == [[1, 2], [3, 4]] and v.get("w") == [1, 2] and v.get("q") == [3, 4]
    v.clear("z"); v.clear("w"); v.clear("q")
    assert spy.calls["append_many"] == 4
    assert dict(v.items()) == {"a": 3, "b": 2, "x": [1, 2], "y": {"k": "v"}}
    assert dump(restore(storage, [b.snapshot(1).result()])) == dump(b)
    with pytest.raises(ValueError, match="differ in length"):
        v.update_many(["a"], [1, 2])
    with pytest.raises(TypeError):
        v.update_many(np.array([1.5]), [1])


def test_bulk_list_and_map(storage):
    b = KeyedStateBackend(storage, "op", FULL, MAXP)
    spy = b._writer = CountingWriter(b._writer)
    users = pd.Series(["u1", "u2", "u1", "u3", "u1"])
    items = pd.Series(["i1", "i2", "i3", "i1", "i1"])
    distinct = b.map_state("distinct")
    distinct.put_many(users, items, np.ones(5, dtype=np.int64))
    last = b.list_state("last", max_length=2)
    last.add_many(users, items)
    assert spy.calls == {"append": 0, "append_many": 2}
    assert sorted(distinct.keys("u1")) == ["i1", "i3"] and last.get("u1") == ["i3", "i1"]
    assert dump(restore(storage, [b.snapshot(1).result()])) == dump(b)


def test_key_validation(storage):
    b = KeyedStateBackend(storage, "op", kg_range(MAXP, 4, 1), MAXP)
    v = b.value_state("v")
    inside = next(k for k in range(1000) if assign_to_key_group(k, MAXP) in b.key_group_range)
    outside = next(k for k in range(1000) if assign_to_key_group(k, MAXP) not in b.key_group_range)
    v.update(inside, 1)
    with pytest.raises(ValueError, match=f"key {outside} belongs to key group"):
        v.update(outside, 1)
    with pytest.raises(ValueError, match="row 1: key"):
        v.update_many([inside, outside], [1, 2])
    assert v.get(inside) == 1 and len(v) == 1  # the failed batch changed nothing
    for bad in (1.5, None, (1,), True, bytearray(b"x")):
        with pytest.raises(TypeError):
            v.update(bad, 1)
    v.update(np.int64(inside), 2)  # numpy scalars are keys (issue 11): stored as the plain int
    assert v.get(inside) == 2 and [type(k) for k in v.keys_with_state()] == [int]
    with pytest.raises(ValueError, match="already registered as value"):
        b.list_state("v")
    assert b.value_state("v") is v


def test_constructor_validation(storage):
    with pytest.raises(ValueError, match="max_parallelism"):
        KeyedStateBackend(storage, "op", FULL, 0)
    with pytest.raises(ValueError, match="within 0..63"):
        KeyedStateBackend(storage, "op", FULL, 64)
    with pytest.raises(ValueError, match="materialize_every_changes"):
        KeyedStateBackend(storage, "op", FULL, MAXP, materialize_every_changes=0)


# ------------------------------------------------------------------ checkpoints, restore, rescale

def test_snapshot_round_trips_through_bytes(storage):
    b = KeyedStateBackend(storage, "op", FULL, MAXP)
    b.value_state("v").update("a", 1)
    b.materialize()
    b.value_state("v").update("b", 2)
    snap = b.snapshot(3).result()
    again = KeyedStateSnapshot.from_bytes(snap.to_bytes())
    assert again == snap and again.checkpoint_id == 3 and again.max_parallelism == MAXP
    assert len(again.materialized) == 1 and again.changelog is not None
    assert set(again.files()) == set(snap.files())
    with pytest.raises(ValueError, match="not valid msgpack|unsupported"):
        KeyedStateSnapshot.from_bytes(b"\xc1garbage")


def test_empty_backend_snapshot(storage):
    b = KeyedStateBackend(storage, "op", FULL, MAXP)
    snap = b.snapshot(1).result()
    assert snap.changelog is None and snap.materialized == []
    assert dump(restore(storage, [snap])) == {}


@pytest.mark.parametrize("old_p, new_p", [(2, 3), (3, 2), (1, 8), (8, 1), (4, 4)])
def test_rescale_keeps_every_key_once(storage, old_p, new_p):
    olds = [KeyedStateBackend(storage, "op", kg_range(MAXP, old_p, i), MAXP) for i in range(old_p)]
    model = {}
    for k in range(600):
        key = f"k{k}"
        owner = next(b for b in olds if assign_to_key_group(key, MAXP) in b.key_group_range)
        owner.value_state("v").update(key, k)
        owner.map_state("m").put(key, "n", k)
        model[key] = k
    snaps = [b.snapshot(1).result() for b in olds]
    news = [restore(storage, snaps, new_p, i) for i in range(new_p)]
    got = union(news)
    assert got["v"] == model and got["m"] == {k: {"n": v} for k, v in model.items()}
    for b in news:  # every new subtask knows every state (metadata replayed from all handles)
        assert sorted(b.state_names) == ["m", "v"]


def test_restore_rejects_other_max_parallelism(storage):
    b = KeyedStateBackend(storage, "op", FULL, MAXP)
    b.value_state("v").update(1, 1)
    snap = b.snapshot(1).result()
    with pytest.raises(ValueError, match="same value"):
        KeyedStateBackend.restore(storage, "op", KeyGroupRange(0, 255), 256, [snap])


def test_conflicting_definitions_across_snapshots(storage):
    a = KeyedStateBackend(storage, "op", kg_range(MAXP, 2, 0), MAXP)
    c = KeyedStateBackend(storage, "op", kg_range(MAXP, 2, 1), MAXP)
    a.value_state("s")
    c.list_state("s")
    with pytest.raises(ValueError, match="defined differently"):
        restore(storage, [a.snapshot(1).result(), c.snapshot(1).result()])


def test_crash_restores_last_completed_checkpoint(storage):
    b = KeyedStateBackend(storage, "op", FULL, MAXP)
    v = b.value_state("v")
    v.update("a", 1)
    snap1 = b.snapshot(1).result()
    b.confirm(1)
    v.update("a", 2)
    v.update("b", 3)
    del b  # crash: no close, the in-memory state is gone
    r = restore(storage, [snap1])
    assert dump(r) == {"v": {"a": 1}}


def test_restored_backend_snapshot_is_complete_and_old_files_can_go(storage, tmp_path):
    b = KeyedStateBackend(storage, "op", FULL, MAXP)
    b.value_state("v").update_many(np.arange(100), np.arange(100))
    snap = b.snapshot(1).result()
    b.confirm(1)
    b.close()
    old_files = set(snap.files())
    r = restore(storage, [snap])
    r.value_state("v").update(1000, 1)
    s2 = r.snapshot(2).result()
    assert old_files <= set(s2.files())             # the old handles are part of it
    assert dump(restore(storage, [s2])) == dump(r)
    r.materialize()
    r.value_state("v").update(1001, 2)
    s3 = r.snapshot(3).result()
    r.confirm(3)
    assert not old_files & set(s3.files())
    for f in old_files:
        os.remove(f)
    assert dump(restore(storage, [s3])) == dump(r)


def test_materialize_on_restore(storage):
    b = KeyedStateBackend(storage, "op", FULL, MAXP)
    b.value_state("v").update_many(np.arange(50), np.arange(50))
    snap = b.snapshot(1).result()
    r = restore(storage, [snap], materialize_on_restore=True)
    s2 = r.snapshot(2).result()
    assert not set(snap.files()) & set(s2.files())
    r.confirm(2)
    for f in snap.files():
        os.remove(f)
    assert dump(restore(storage, [s2])) == dump(b)


def test_thread_mode_futures(tmp_path):
    with open_storage(str(tmp_path / "cl"), batch_persist_delay="5 ms") as st:
        b = KeyedStateBackend(st, "op", FULL, MAXP, materialize_every_changes=500)
        v = b.value_state("v")
        for i in range(3):
            v.update_many(np.arange(300) + i, np.arange(300))
            snap = b.snapshot(i + 1).result(timeout=30)
            b.confirm(i + 1)
        assert b.materializations >= 1
        r = KeyedStateBackend.restore(st, "op", FULL, MAXP, [snap])
        assert dump(r) == dump(b)
        r.close()
        b.close()


def test_abort_keeps_uploads_reusable(storage):
    b = KeyedStateBackend(storage, "op", FULL, MAXP)
    b.value_state("v").update("a", 1)
    s1 = b.snapshot(1).result()
    b.abort(1)
    b.value_state("v").update("b", 2)
    s2 = b.snapshot(2).result()
    # the change set uploaded for checkpoint 1 is reused, not uploaded again
    assert s2.changelog.handles_and_offsets[0] == s1.changelog.handles_and_offsets[0]
    b.confirm(2)
    assert dump(restore(storage, [s2])) == dump(b)


def test_closed_backend_rejects_mutations(storage):
    b = KeyedStateBackend(storage, "op", FULL, MAXP)
    v = b.value_state("v")
    v.update("a", 1)
    b.materialize()
    v.update("b", 2)
    snap = b.snapshot(1).result()
    b.close()
    b.confirm(1)          # a late confirmation of a closed backend is accepted (like the writer's)
    b.abort(2)
    assert dump(restore(storage, [snap])) == {"v": {"a": 1, "b": 2}}
    b.close()
    with pytest.raises(RuntimeError, match="closed"):
        v.update("a", 1)
    with pytest.raises(RuntimeError, match="closed"):
        b.snapshot(1)


@heavy  # S3
@pytest.mark.s3
def test_state_on_s3_rescale_with_materialization(s3_bucket):
    # moto on a loaded machine can take over the default 1 s per attempt; this is not a timeout test
    with open_storage(f"{s3_bucket}/changelog", batch_persist_delay="5 ms", upload_timeout="30 s") as st:
        olds = [KeyedStateBackend(st, "op", kg_range(MAXP, 2, i), MAXP) for i in range(2)]
        model = {}
        keys = pd.Series([f"user-{i}" for i in range(3000)])
        for b in olds:
            kgs = np.array([assign_to_key_group(k, MAXP) for k in keys])
            mine = keys[(kgs >= b.key_group_range.start) & (kgs <= b.key_group_range.end)]
            b.value_state("v").update_many(mine, np.arange(len(mine)))
            model.update(zip(mine.tolist(), range(len(mine))))
        olds[1].materialize()
        late = next(f"late-{i}" for i in range(100) if assign_to_key_group(f"late-{i}", MAXP) >= 64)
        olds[1].value_state("v").update(late, -1)   # the tail after the materialization
        model[late] = -1
        snaps = [b.snapshot(1).result(timeout=60) for b in olds]
        assert all(f.startswith("s3://") for s in snaps for f in s.files())
        news = [restore(st, snaps, 3, i) for i in range(3)]
        assert union(news)["v"] == model
        for b in olds + news:
            b.close()


def _raw_snapshot(storage, changes):
    """A snapshot over hand-written changes (kg, payload), through a real writer."""
    w = storage.create_writer("raw", FULL)
    for kg, payload in changes:
        if kg < 0:
            w.append_meta(payload)
        else:
            w.append(kg, payload)
    h = w.persist(w.initial_sequence_number(), 1).result().job_manager_owned_snapshot
    w.close()
    return KeyedStateSnapshot(FULL, [], h, MAXP)


@pytest.mark.parametrize("payload, message", [
    (b"\x08\x92\x00\x01", "unknown state change operation code 8"),
    (b"\x01\xc1", "undecodable SET"),
    (b"", "empty state change payload"),
    (C.encode(C.SET, [5, 1, 2]), "state id 5 without a preceding METADATA"),
    (C.encode(C.ADD_ELEMENT, [0, 1, 2]), "not a ValueState operation"),
])
def test_corrupt_changes_are_reported(storage, payload, message):
    from dstl.errors import CorruptChangelogError

    meta = C.encode_meta(C.StateMeta(0, "v", "value", "msgpack"))
    snap = _raw_snapshot(storage, [(-1, meta), (assign_to_key_group(1, MAXP), payload)])
    with pytest.raises(CorruptChangelogError, match=message):
        restore(storage, [snap])


def test_metadata_applied_twice_is_harmless(storage):
    meta = C.encode_meta(C.StateMeta(0, "v", "value", "msgpack"))
    kg = assign_to_key_group(1, MAXP)
    snap = _raw_snapshot(storage, [(-1, meta), (-1, meta), (kg, C.encode(C.SET, [0, 1, "a"]))])
    r = restore(storage, [snap, snap])   # the same handle twice: metadata and data replayed twice
    assert dump(r) == {"v": {1: "a"}}


from writer_modes import make_storage, upload_mode  # noqa: E402,F401  (fixtures: every upload mode)


def test_checkpoint_materialize_rescale_in_every_upload_mode(make_storage, upload_mode):
    st = make_storage(batch_persist_delay="2 ms")
    olds = [KeyedStateBackend(st, "op", kg_range(MAXP, 2, i), MAXP) for i in range(2)]
    model = {}
    for b in olds:
        keys = [k for k in range(2000) if assign_to_key_group(k, MAXP) in b.key_group_range]
        b.value_state("v").update_many(np.array(keys), np.array(keys) * 2)
        b.list_state("l", max_length=2).add_many(keys, keys)
        model.update({k: k * 2 for k in keys})
    s1 = [b.snapshot(1).result(timeout=30) for b in olds]
    for b in olds:
        b.confirm(1)
        b.materialize()
        b.value_state("v").update(next(k for k in range(5000) if assign_to_key_group(k, MAXP)
                                        in b.key_group_range), -1)
    s2 = [b.snapshot(2).result(timeout=30) for b in olds]
    for b in olds:
        b.confirm(2)
    for snaps in (s1, s2):
        news = [restore(st, snaps, 3, i) for i in range(3)]
        got = union(news)
        expect = model if snaps is s1 else {**model, **{k: v for b in olds for k, v in b.value_state("v").items()}}
        assert got["v"] == expect
        for b in news:
            b.close()
    for b in olds:
        b.close()


def test_vectorised_reads(storage):
    b = KeyedStateBackend(storage, "op", FULL, MAXP)
    v, ls, m = b.value_state("v"), b.list_state("l"), b.map_state("m")
    v.update_many(["a", "b"], [1, 2])
    ls.add_many(["a", "a", "c"], [1, 2, 3])
    m.put_many(["a", "a", "b"], ["x", "y", "x"], [1, 2, 3])
    assert v.get_many(pd.Series(["a", "zz", "b"]), 0) == [1, 0, 2]
    assert ls.get_many(["a", "b", "c"]) == [[1, 2], [], [3]]
    assert m.get_many(["a", "b", "b", "q"], ["y", "x", "y", "x"], -1) == [2, 3, -1, -1]
    assert m.contains_many(np.array(["a", "b", "q"]), ["x", "y", "x"]).tolist() == [True, False, False]
    with pytest.raises(ValueError, match="differ in length"):
        m.contains_many(["a"], ["x", "y"])
    sub = KeyedStateBackend(storage, "op2", kg_range(MAXP, 4, 0), MAXP)
    outside = next(k for k in range(1000) if assign_to_key_group(k, MAXP) not in sub.key_group_range)
    with pytest.raises(ValueError, match="outside this backend's range"):
        sub.value_state("v").get_many([outside])


def test_unserializable_values_name_the_problem_and_change_nothing(storage):
    b = KeyedStateBackend(storage, "op", FULL, MAXP)
    v = b.value_state("v")
    with pytest.raises(OverflowError, match="row 0: cannot serialize"):
        v.update_many([1, 2], [2**70, 1])
    with pytest.raises(TypeError, match="row 1: cannot serialize"):
        v.update_many(["a", "b"], [1, {3}])
    with pytest.raises(TypeError, match="state 'v', key 'a': cannot serialize"):
        v.update("a", {1, 2})
    with pytest.raises(ValueError, match="outside the int64 range"):
        v.update_many([1, 2**70], [1, 2])
    assert dict(v.items()) == {}
    assert dump(restore(storage, [b.snapshot(1).result()])) == {"v": {}}
