"""Materialization: compact per-key-group snapshots, bounded replay, truncation, file ownership."""
from __future__ import annotations

import os
import time

import numpy as np
import pytest

from dstl.keygroups import assign_to_key_group, compute_key_group_range_for_operator_index as kg_range
from dstl.state import changes as C
from dstl.state.backend import KeyedStateBackend
from dstl.changelog.storage import open_storage
from dstl.types import KeyGroupRange

from faultyfs import FAULTS, faulty, faulty_url  # noqa: F401  (fixture)

from state_helpers import FULL, MAXP, dump, storage  # noqa: F401  (storage: fixture)


def fill(backend, n, start=0):
    backend.value_state("v").update_many(np.arange(start, start + n), np.arange(n) * 2)
    m = backend.map_state("m")
    for k in range(start, start + min(n, 50)):
        m.put(k, "x", k)


def wait_gone(path, timeout=10.0):
    deadline = time.monotonic() + timeout
    while os.path.exists(path) and time.monotonic() < deadline:
        time.sleep(0.02)
    return not os.path.exists(path)


def test_materialized_handle_holds_one_change_per_key_group(storage):
    b = KeyedStateBackend(storage, "op", FULL, MAXP)
    fill(b, 1000)
    b.materialize()
    (handle,) = b._mat.handles
    changes = storage.create_reader().read_all(handle)
    meta = [c for c in changes if c.key_group == -1]
    data = [c for c in changes if c.key_group >= 0]
    assert len(meta) == 2
    assert {c.key_group for c in data} == set(b.key_groups())
    assert len(data) == len(b.key_groups())          # exactly one change per non-empty key group
    assert all(c.data[0] == C.KEY_GROUP_SNAPSHOT for c in data)
    for c in data[:5]:
        _, body = C.decode(c.data)
        keys = [k for _, entries in body for k in entries]
        assert all(assign_to_key_group(k, MAXP) == c.key_group for k in keys)


def test_restore_after_materialization_reads_no_older_changes(storage):
    b = KeyedStateBackend(storage, "op", FULL, MAXP)
    fill(b, 5000)
    s1 = b.snapshot(1).result()
    b.confirm(1)
    b.materialize()
    b.value_state("v").update_many(np.arange(10), np.arange(10) + 100)   # 10 changes after it
    b.map_state("m").remove(3, "x")                                      # 1 more
    s2 = b.snapshot(2).result()
    r = KeyedStateBackend.restore(storage, "op", FULL, MAXP, [s2])
    assert dump(r) == dump(b)
    # the tail has the re-announced metadata (2) and the 11 changes after the materialization
    tail = storage.create_reader().read_all(s2.changelog)
    assert len(tail) == 2 + 11
    n_kg = len(b.key_groups())
    st = r.restore_stats
    assert st["changes_read"] == (2 + n_kg) + (2 + 11)   # materialized handle + tail, nothing older
    assert st["changes_read"] < 5000
    # without the materialization the same state costs every change since the start
    full = KeyedStateBackend.restore(storage, "op", FULL, MAXP, [s1])
    assert full.restore_stats["changes_read"] >= 5000


def test_confirm_truncates_the_log_before_the_materialization(storage):
    b = KeyedStateBackend(storage, "op", FULL, MAXP)
    fill(b, 100)
    b.snapshot(1).result()
    b.confirm(1)
    b.materialize()
    sqn = int(b._mat.sqn)
    assert sqn > 0 and int(b.writer.lowest_sequence_number) == 0
    fill(b, 10, start=500)
    b.snapshot(2).result()
    assert int(b.writer.lowest_sequence_number) == 0    # not before a checkpoint with it is confirmed
    b.confirm(2)
    assert int(b.writer.lowest_sequence_number) == sqn
    assert all(s >= sqn for s in b.writer.uploaded_sequence_numbers())


def test_superseded_unconfirmed_materialization_is_deleted_confirmed_one_kept(storage):
    b = KeyedStateBackend(storage, "op", FULL, MAXP)
    fill(b, 200)
    b.materialize()                      # m1, confirmed by checkpoint 1
    s1 = b.snapshot(1).result()
    b.confirm(1)
    m1_files = s1.materialized[0].files()
    fill(b, 10, start=300)
    b.materialize()                      # m2, only in checkpoint 2, which is never confirmed
    s2 = b.snapshot(2).result()
    m2_files = s2.materialized[0].files()
    fill(b, 10, start=400)
    b.materialize()                      # m3, confirmed by checkpoint 3
    s3 = b.snapshot(3).result()
    b.confirm(3)
    assert all(wait_gone(f) for f in m2_files)          # released: no checkpoint owns it
    assert all(os.path.exists(f) for f in m1_files)     # owned by checkpoint 1 (left to gc)
    assert dump(KeyedStateBackend.restore(storage, "op", FULL, MAXP, [s3])) == dump(b)


def test_interval_by_changes_and_bytes(storage):
    b = KeyedStateBackend(storage, "op", FULL, MAXP, materialize_every_changes=100)
    v = b.value_state("v")
    for i in range(250):
        v.update(i, i)
    assert b.materializations == 2
    v.update_many(np.arange(1000), np.arange(1000))      # checked once, after the batch
    assert b.materializations == 3
    c = KeyedStateBackend(storage, "op2", FULL, MAXP, materialize_every_bytes=4096)
    w = c.value_state("w")
    for i in range(100):
        w.update(i, "x" * 100)
    assert 2 <= c.materializations <= 4
    snap = c.snapshot(1).result()
    assert dump(KeyedStateBackend.restore(storage, "op2", FULL, MAXP, [snap])) == dump(c)


def test_restored_log_counts_towards_the_interval(storage):
    # a subtask restored at every checkpoint (moved, or its Python worker replaced) must still
    # materialize: the log it restored was logged since the last materialization
    every, per_checkpoint = 100, 30
    snap, expected = None, {}
    files, carried = [], []
    for cid in range(1, 16):
        b = (KeyedStateBackend(storage, "op", FULL, MAXP, materialize_every_changes=every) if snap is None
             else KeyedStateBackend.restore(storage, "op", FULL, MAXP, [snap], materialize_every_changes=every))
        if snap is not None:
            assert b._since_changes == b.restore_stats["log_changes"]
            carried.append(b._since_changes)
        v = b.value_state("v")
        for k in range(per_checkpoint):
            v.update(k, cid * 1000 + k)
            expected[k] = cid * 1000 + k
        snap = b.snapshot(cid).result()
        b.confirm(cid)
        files.append(len(snap.files()))
        b.close()
    # one materialization + at most ceil(100 / 30) logs; without the carried count the log would
    # grow by one file per checkpoint (15 here)
    assert max(files[5:]) <= 1 + -(-every // per_checkpoint), files
    assert max(carried) >= 2 * per_checkpoint, carried   # logs of several checkpoints were carried
    restored = KeyedStateBackend.restore(storage, "op", FULL, MAXP, [snap])
    assert dict(restored.value_state("v").items()) == expected
    restored.close()


def test_materialize_without_changes_is_a_no_op(storage):
    b = KeyedStateBackend(storage, "op", FULL, MAXP)
    fill(b, 10)
    b.materialize()
    first = b._mat
    b.materialize()
    assert b._mat is first and b.materializations == 1


@pytest.mark.parametrize("new_p", [1, 3, 4, 8])
def test_materialized_snapshot_splits_on_rescale(storage, new_p):
    b = KeyedStateBackend(storage, "op", FULL, MAXP)
    fill(b, 2000)
    b.materialize()
    snap = b.snapshot(1).result()
    news = [KeyedStateBackend.restore(storage, "op", kg_range(MAXP, new_p, i), MAXP, [snap])
            for i in range(new_p)]
    merged = {}
    for r in news:
        n_kg = len([kg for kg in b.key_groups() if kg in r.key_group_range])
        # only the key-group snapshots of its own range are applied (metadata is read everywhere)
        assert r.restore_stats["changes_applied"] == n_kg
        for name, items in dump(r).items():
            merged.setdefault(name, {}).update(items)
    assert merged == dump(b)


def test_failed_materialization_changes_nothing(faulty, tmp_path):
    st = open_storage(faulty_url(tmp_path / "cl"), upload_mode="direct")
    try:
        b = KeyedStateBackend(st, "op", FULL, MAXP)
        fill(b, 100)
        FAULTS.fail_writes(1)
        with pytest.raises(OSError):
            b.materialize()
        assert b._mat is None and b.materializations == 0
        fill(b, 10, start=1000)
        snap = b.snapshot(1).result()
        assert snap.materialized == []
        assert dump(KeyedStateBackend.restore(st, "op", FULL, MAXP, [snap])) == dump(b)
    finally:
        st.close()


def test_rescale_after_materialization_and_more_changes(storage):
    olds = [KeyedStateBackend(storage, "op", kg_range(MAXP, 2, i), MAXP) for i in range(2)]
    model = {}
    for k in range(400):
        o = olds[0] if assign_to_key_group(k, MAXP) in olds[0].key_group_range else olds[1]
        o.value_state("v").update(k, k)
        model[k] = k
    olds[0].materialize()                 # only one of them materialized
    for k in range(0, 400, 3):
        o = olds[0] if assign_to_key_group(k, MAXP) in olds[0].key_group_range else olds[1]
        o.value_state("v").clear(k)
        del model[k]
    snaps = [o.snapshot(7).result() for o in olds]
    news = [KeyedStateBackend.restore(storage, "op", kg_range(MAXP, 3, i), MAXP, snaps) for i in range(3)]
    merged = {}
    for r in news:
        merged.update(dict(r.get_state("v").all_items()))
    assert merged == model


def test_failed_upload_heals_by_materializing_at_the_next_checkpoint(faulty, tmp_path):
    st = open_storage(faulty_url(tmp_path / "cl"), upload_mode="direct", preemptive_persist_threshold="2 kb")
    try:
        b = KeyedStateBackend(st, "op", FULL, MAXP)
        v = b.value_state("v")
        fill(b, 50)
        FAULTS.fail_writes(1)
        for i in range(200):               # a pre-emptive upload fails somewhere in here
            v.update(i, "x" * 20)
        assert b.writer.highest_failed is not None
        snap = b.snapshot(1).result()      # cannot persist the broken segment: materializes first
        assert b.materializations == 1 and len(snap.materialized) == 1
        b.confirm(1)
        r = KeyedStateBackend.restore(st, "op", FULL, MAXP, [snap])
        assert dump(r) == dump(b)          # nothing accepted was lost
    finally:
        st.close()


def test_failed_checkpoint_upload_then_next_checkpoint(faulty, tmp_path):
    st = open_storage(faulty_url(tmp_path / "cl"), upload_mode="direct")
    try:
        b = KeyedStateBackend(st, "op", FULL, MAXP)
        fill(b, 100)
        FAULTS.fail_writes(1)
        with pytest.raises(OSError):
            b.snapshot(1).result()
        b.abort(1)
        fill(b, 10, start=5000)
        snap = b.snapshot(2).result()
        b.confirm(2)
        assert dump(KeyedStateBackend.restore(st, "op", FULL, MAXP, [snap])) == dump(b)
    finally:
        st.close()


class _FailAfterAppend:
    """The real writer, but append/append_many raise OSError after adding (SEMANTICS §4.5)."""

    def __init__(self, writer):
        self._w = writer

    def append(self, *a):
        self._w.append(*a)
        raise OSError("pre-emptive upload failed")

    def append_many(self, *a):
        self._w.append_many(*a)
        raise OSError("pre-emptive upload failed")

    def __getattr__(self, name):
        return getattr(self._w, name)


def test_append_error_after_the_change_was_logged_keeps_memory_in_step(storage):
    b = KeyedStateBackend(storage, "op", FULL, MAXP)
    v = b.value_state("v")
    real = b._writer
    b._writer = _FailAfterAppend(real)
    with pytest.raises(OSError, match="pre-emptive"):
        v.update("a", 1)
    with pytest.raises(OSError, match="pre-emptive"):
        v.update_many(["b", "c"], [2, 3])
    assert dict(v.items()) == {"a": 1, "b": 2, "c": 3}   # memory matches what the log holds
    b._writer = real
    snap = b.snapshot(1).result()
    assert dump(KeyedStateBackend.restore(storage, "op", FULL, MAXP, [snap])) == dump(b)


def test_big_key_groups_are_split_into_several_changes(storage, monkeypatch):
    from dstl.state import materialize as M

    monkeypatch.setattr(M, "CHUNK_ENTRIES", 7)
    b = KeyedStateBackend(storage, "op", KeyGroupRange(0, 3), MAXP)
    keys = [k for k in range(5000) if assign_to_key_group(k, MAXP) <= 3]
    b.value_state("v").update_many(keys, keys)
    b.list_state("l").add_many(keys[:30], keys[:30])
    b.materialize()
    (handle,) = b._mat.handles
    data = [c for c in storage.create_reader().read_all(handle) if c.key_group >= 0]
    per_kg = {}
    for c in data:
        _, body = C.decode(c.data)
        assert sum(len(entries) for _, entries in body) <= 7
        per_kg[c.key_group] = per_kg.get(c.key_group, 0) + 1
    assert set(per_kg) == set(b.key_groups()) and min(per_kg.values()) > 1
    snap = b.snapshot(1).result()
    for ranges in ([KeyGroupRange(0, 3)], [KeyGroupRange(0, 1), KeyGroupRange(2, 3)]):
        news = [KeyedStateBackend.restore(storage, "op", r, MAXP, [snap]) for r in ranges]
        merged = {}
        for r in news:
            for name, items in dump(r).items():
                merged.setdefault(name, {}).update(items)
        assert merged == dump(b)
