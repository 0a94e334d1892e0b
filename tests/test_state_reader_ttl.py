"""The readers on the layouts StatefulStream writes: TTL values ([value, expires_at_ms], METADATA
option ttl), timers (the `_dstl_timers` map state) and declared value schemas (the checkpoint's
`state_schemas` property)."""
from __future__ import annotations

import pytest

from conftest import heavy
from dstl.changelog.storage import open_storage
from dstl.keygroups import key_group_ranges
from dstl.state import (CheckpointMetadata, KeyedStateBackend, SubtaskState, read_changes_pandas,
                        read_state_pandas, read_timers_pandas, write_checkpoint)

JOB = "7ee17ee17ee17ee17ee17ee17ee17ee1"
SCHEMAS = {"profile": {"kind": "value", "value": {"type": "struct", "fields": [
    {"name": "name", "type": "string", "nullable": True, "metadata": {}},
    {"name": "visits", "type": "long", "nullable": True, "metadata": {}}]}, "ttl_ms": None}}


def _write(base, steps):
    """steps: [fn(backend_for_key)], one checkpoint each."""
    storage = open_storage(base, upload_mode="direct", job_id=JOB)
    ranges = key_group_ranges(128, 2)
    backends = [KeyedStateBackend(storage, "op", r, 128) for r in ranges]
    from dstl.keygroups import assign_to_key_group

    def of(key):
        kg = assign_to_key_group(key, 128)
        return next(b for b, r in zip(backends, ranges) if r.contains(kg))
    try:
        for cid, step in enumerate(steps, 1):
            step(of)
            snaps = [b.snapshot(cid).result() for b in backends]
            write_checkpoint(base, CheckpointMetadata(cid, 128, 2, [SubtaskState.from_keyed_snapshot(i, s)
                                                                   for i, s in enumerate(snaps)],
                                                      {"batch": cid - 1, "state_schemas": SCHEMAS}, job_id=JOB))
            for b in backends:
                b.confirm(cid)
    finally:
        for b in backends:
            b.close()
        storage.close()


def _ttl(b, name, kind):
    return b(name)._register(name, kind, None, {"ttl": True})


def test_expired_values_are_not_returned_and_timers_and_schemas_read(tmp_path):
    base = str(tmp_path / "job")

    def step1(of):
        for key, exp in (("a", 1000), ("b", 5000)):
            of(key)._register("last", "value", None, {"ttl": True}).update(key, ["seen", exp])
            lst = of(key)._register("events", "list", None, {"ttl": True})
            lst.add(key, ["e1", 1000])
            lst.add(key, ["e2", 9000])
            of(key)._register("seen", "map", None, {"ttl": True}).put(key, "x", [1, exp])
            of(key).map_state("_dstl_timers").put(key, exp + 7, 1)
            of(key).value_state("profile").update(key, [key.upper(), 3])

    def step2(of):
        of("b").map_state("_dstl_timers").remove("b", 5007)
        of("b").map_state("_dstl_timers").put("b", 6000, 1)
        of("a")._register("last", "value", None, {"ttl": True}).update("a", ["again", 8000])

    _write(base, [step1, step2])
    df = read_state_pandas(base, now_ms=2000)
    import pandas as pd

    got = sorted((r.key, r.state, None if pd.isna(r.position) else int(r.position), r.value)
                 for r in df.itertuples())
    assert ("a", "last", None, '"again"') in got and ("b", "last", None, '"seen"') in got
    assert [g for g in got if g[1] == "events"] == [("a", "events", 0, '"e2"'), ("b", "events", 0, '"e2"')]
    assert [g[0] for g in got if g[1] == "seen"] == ["b"]  # a's entry expired at 1000
    assert "_dstl_timers" not in set(df["state"])
    later = read_state_pandas(base, "last", now_ms=8500)
    assert later.empty
    timers = read_timers_pandas(base)
    assert list(zip(timers.key, timers.timestamp_ms)) == [("a", 1007), ("b", 6000)]
    assert list(zip(*[read_timers_pandas(base, checkpoint_id=1)[c] for c in ("key", "timestamp_ms")])) == \
        [("a", 1007), ("b", 5007)]
    prof = read_state_pandas(base, "profile")
    assert list(prof.columns) == ["key", "key_group", "state", "kind", "user_key", "position", "name", "visits"]
    assert sorted(zip(prof.key, prof.name, prof.visits)) == [("a", "A", 3), ("b", "B", 3)]
    changes = read_changes_pandas(base, 1, 2)
    assert sorted(zip(changes.key, changes.state, changes.op, changes.value.fillna(""))) == [
        ("a", "last", "update", '"again"'), ("b", "_dstl_timers", "put", "1"), ("b", "_dstl_timers", "remove", "")]


@pytest.mark.spark
@heavy  # the pandas test covers the same rows under both builds
def test_spark_readers_on_ttl_timers_and_schemas(spark, tmp_path):
    from dstl.spark import read_state, read_timers

    base = str(tmp_path / "job")

    def step(of):
        for key, exp in (("a", 1000), ("b", 5000)):
            of(key)._register("last", "value", None, {"ttl": True}).update(key, ["seen", exp])
            of(key).map_state("_dstl_timers").put(key, exp + 7, 1)
            of(key).value_state("profile").update(key, [key.upper(), 3])

    _write(base, [step])
    assert sorted(read_state(spark, base, "last", now_ms=2000).toPandas()["key"]) == ["b"]
    t = read_timers(spark, base).toPandas().sort_values("timestamp_ms")
    assert list(zip(t.key, t.timestamp_ms)) == [("a", 1007), ("b", 5007)]
    prof = read_state(spark, base, "profile")
    assert prof.columns[-2:] == ["name", "visits"] and dict(prof.dtypes)["visits"] == "bigint"
    assert sorted((r.key, r.name, r.visits) for r in prof.collect()) == [("a", "A", 3), ("b", "B", 3)]
