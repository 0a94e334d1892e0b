"""dstl.spark pieces that need no Spark job: routing hash, worker cache, coordinator, sources, reference."""
from __future__ import annotations

import os

import numpy as np
import pandas as pd
import pytest

from dstl.config import StorageConfig
from dstl.keygroups import compute_key_group_range_for_operator_index
from dstl.app.activity import compare_output, compare_state, reference, user_activity, read_state
from dstl.spark.memory import MemoryState
from dstl.spark.cache import StateCache
from dstl.spark.coordinator import CheckpointCoordinator, JobConflictError, JobSpec
from dstl.spark.routing import partition_salts, spark_hash_int
from dstl.app.source import FileSource, SyntheticSource, batch_bounds
from dstl.state.backend import KeyedStateBackend
from dstl.changelog.storage import FsStateChangelogStorage


def test_spark_hash_int_known_values():
    # Spark: SELECT hash(0), hash(1), hash(-1) (Murmur3_x86_32, seed 42)
    assert spark_hash_int(0) == 933211791
    assert spark_hash_int(1) == -559580957
    assert spark_hash_int(-1) == -1604776387


def test_partition_salts_route_each_subtask_to_its_partition():
    for p in (1, 2, 3, 4, 7, 16):
        salts = partition_salts(p)
        assert len(set(salts)) == p
        assert [spark_hash_int(v) % p for v in salts] == list(range(p))
    with pytest.raises(ValueError):
        partition_salts(0)


def test_batch_bounds_and_synthetic_source_are_deterministic():
    assert batch_bounds(10, 3) == [0, 4, 7, 10]
    a = SyntheticSource(1000, 4, users=50, items=20, seed=7)
    b = SyntheticSource(1000, 4, users=50, items=20, seed=7)
    pd.testing.assert_frame_equal(a.batch(2), b.batch(2))
    all_ = a.all()
    assert len(all_) == 1000 and all_["event_id"].tolist() == list(range(1000))
    assert all_["user_id"].nunique() <= 50
    # skewed: the hottest user has far more than an equal share
    assert all_["user_id"].value_counts().iloc[0] > 3 * 1000 / 50
    assert not SyntheticSource(1000, 4, seed=8).batch(0).equals(a.batch(0))
    with pytest.raises(ValueError, match="--batches"):
        SyntheticSource(3, 4)


def test_file_source_reads_csv_and_parquet(tmp_path):
    df = pd.DataFrame({"user_id": ["a", "b", "a", "c", "b"], "item_id": [1, 2, 3, 1, 2],
                       "amount_cents": [10, 20, 30, 40, 50], "ts": [5, 4, 3, 2, 1]})
    df.to_csv(tmp_path / "e.csv", index=False)
    df.to_parquet(tmp_path / "e.parquet")
    for name in ("e.csv", "e.parquet"):
        src = FileSource(str(tmp_path / name), 2)
        assert src.batch(0)["event_id"].tolist() == [0, 1, 2]
        assert src.batch(1)["batch"].tolist() == [1, 1]
        assert src.spark_type("user_id") == "string" and src.spark_type("item_id") == "long"
    with pytest.raises(FileNotFoundError):
        FileSource(str(tmp_path / "missing.parquet"), 2)
    df.drop(columns=["ts"]).to_parquet(tmp_path / "bad.parquet")
    with pytest.raises(ValueError, match="lacks columns"):
        FileSource(str(tmp_path / "bad.parquet"), 2)


def test_file_source_reads_text_timestamps_and_rejects_other_text(tmp_path):
    # a CSV's timestamps are text (pandas 2: object, pandas 3: str); both become int microseconds
    df = pd.DataFrame({"user_id": ["a", "b"], "item_id": [1, 2], "amount_cents": [10, 20],
                       "ts": ["2024-05-01 00:00:00.0", "2024-05-01 00:00:01.5"]})
    df.to_csv(tmp_path / "t.csv", index=False)
    src = FileSource(str(tmp_path / "t.csv"), 1)
    assert src.all()["ts"].tolist() == [1_714_521_600_000_000, 1_714_521_601_500_000]
    assert src.spark_type("ts") == "long" and src.spark_type("user_id") == "string"
    df.assign(ts=["soon", "later"]).to_csv(tmp_path / "bad.csv", index=False)
    with pytest.raises(ValueError, match="column ts is neither integer microseconds nor timestamps"):
        FileSource(str(tmp_path / "bad.csv"), 1)


def test_operator_matches_reference_in_memory():
    src = SyntheticSource(3000, 3, users=40, items=15, seed=3)
    state = MemoryState()
    outs = [user_activity(src.batch(b).sort_values(["ts", "event_id"]), state) for b in range(3)]
    expected_state, expected_out = reference(src.all())
    out = pd.concat(outs, ignore_index=True)
    assert compare_output(out, expected_out) == []
    actual = {u: {"events": c, "amount_cents": state.value_state("amount_cents").get(u),
                  "distinct_items": state.map_state("items").size(u),
                  "last_items": state.list_state("last_items").get(u),
                  "items": dict(state.map_state("items").items(u))}
              for u, c in state.value_state("count").items()}
    assert compare_state(actual, expected_state) == []
    # the comparison does catch a difference
    u = next(iter(actual))
    actual[u]["last_items"] = actual[u]["last_items"][:-1] + [-1]
    assert any("last_items" in p for p in compare_state(actual, expected_state))
    assert compare_output(pd.concat([out, out.iloc[:1]]), expected_out)


def _backend(storage, maxp=16, p=1, i=0):
    return KeyedStateBackend(storage, "op", compute_key_group_range_for_operator_index(maxp, p, i), maxp)


def test_state_cache_hits_only_the_exact_completed_checkpoint(tmp_path):
    with FsStateChangelogStorage(StorageConfig(base_path=str(tmp_path)), job_id="a" * 32) as storage:
        cache = StateCache()
        key = ("job", "op", 1, 16, 0)
        b = _backend(storage)
        b.value_state("v").update(1, 10)
        b.snapshot(1).result()
        cache.put(key, b, 1, "tok")
        # wrong token (another attempt's snapshot was accepted): stale, closed, never handed out
        assert cache.acquire(key, 1, "other") is None
        assert b.closed and len(cache) == 0
        b2 = _backend(storage)
        b2.snapshot(1).result()
        cache.put(key, b2, 1, "tok")
        # checkpoint 1 did not complete (latest completed is 0)
        assert cache.acquire(key, 0, "tok") is None and b2.closed
        b3 = _backend(storage)
        b3.value_state("v").update(2, 20)
        b3.snapshot(4).result()
        cache.put(key, b3, 4, "t4")
        got = cache.acquire(key, 4, "t4")
        assert got is b3 and not b3.closed
        # taken out while in use: a second acquire (e.g. a concurrent retry) misses
        assert cache.acquire(key, 4, "t4") is None
        assert cache.hits == 1 and cache.misses == 3
        b3.close()


def test_state_cache_closes_idle_entries(tmp_path):
    with FsStateChangelogStorage(StorageConfig(base_path=str(tmp_path)), job_id="f" * 32) as storage:
        cache = StateCache()
        b = _backend(storage)
        b.snapshot(1).result()
        cache.put(("job", "op", 1, 16, 0), b, 1, "t")
        assert cache.evict_idle(idle_s=60) == 0 and not b.closed
        assert cache.evict_idle(idle_s=0) == 1 and b.closed and len(cache) == 0


def test_state_cache_evicts_rescaled_entries(tmp_path):
    with FsStateChangelogStorage(StorageConfig(base_path=str(tmp_path)), job_id="b" * 32) as storage:
        cache = StateCache()
        old = _backend(storage, 16, 2, 0)
        old.snapshot(1).result()
        cache.put(("job", "op", 2, 16, 0), old, 1, "t")
        other_op = _backend(storage, 16, 2, 1)
        cache.put(("job", "other", 2, 16, 1), other_op, 1, "t")
        cache.evict_rescaled("job", "op", 4, 16)
        assert old.closed and not other_op.closed and len(cache) == 1
        cache.clear()
        assert other_op.closed


def _spec(tmp_path, **params):
    return JobSpec.new("op", 16, str(tmp_path / "out"), params)


def test_coordinator_refuses_another_job_and_bad_resume(tmp_path):
    base = str(tmp_path / "base")
    opts = StorageConfig(base_path=base).to_mapping()
    CheckpointCoordinator.open(base, _spec(tmp_path, events=10), opts, resume=False)
    with pytest.raises(JobConflictError, match="already holds job"):
        CheckpointCoordinator.open(base, _spec(tmp_path, events=10), opts, resume=False)
    with pytest.raises(JobConflictError, match="events=10"):
        CheckpointCoordinator.open(base, _spec(tmp_path, events=11), opts, resume=True)
    with pytest.raises(JobConflictError, match="max parallelism"):
        CheckpointCoordinator.open(base, JobSpec.new("op", 32, None, {}), opts, resume=True)
    with pytest.raises(JobConflictError, match="nothing to resume"):
        CheckpointCoordinator.open(str(tmp_path / "empty"), _spec(tmp_path), opts, resume=True)
    c = CheckpointCoordinator.open(base, JobSpec("", "op", 0, None, {}), opts, resume=True)
    assert c.next_batch == 0 and c.spec.max_parallelism == 16


def test_coordinator_commit_is_idempotent_and_recovers(tmp_path):
    """Checkpoint written, output not committed (a crash): reopening commits it exactly once."""
    from dstl.spark.report import TaskReport

    base = str(tmp_path / "base")
    opts = StorageConfig(base_path=base).to_mapping()
    coord = CheckpointCoordinator.open(base, _spec(tmp_path), opts, resume=False)
    plan = coord.plan(0, 2)
    with FsStateChangelogStorage(opts, job_id=coord.spec.job_id) as storage:
        reports = []
        for i in range(2):
            b = _backend(storage, 16, 2, i)
            key = next(k for k in range(1000)
                       if b.key_group_range.contains(__import__("dstl").assign_to_key_group(k, 16)))
            b.value_state("v").update(key, i)
            snap = b.snapshot(1).result()
            staged = f"{plan.staging_dir()}/part-{i:05d}-x.parquet"
            os.makedirs(os.path.dirname(staged), exist_ok=True)
            pd.DataFrame({"x": [i]}).to_parquet(staged)
            reports.append(TaskReport(i, 0, f"t{i}", snap.to_bytes(), staged, 1, 1, True, 0, 0, 0, 0, 1, "h", 0, 0))
            b.close()

    class Crash(Exception):
        pass

    def crash():
        raise Crash()

    with pytest.raises(Crash):
        coord.complete(plan, reports, after_metadata=crash)
    out = tmp_path / "out"
    assert not (out / "batch-000000" / "_SUCCESS").exists()
    again = CheckpointCoordinator.open(base, _spec(tmp_path), opts, resume=True)
    assert again.recovered_output and again.next_batch == 1
    assert sorted(os.listdir(out / "batch-000000")) == ["_SUCCESS", "part-00000.parquet", "part-00001.parquet"]
    assert again.commit_output(again.latest) is False  # idempotent
    assert not (out / "_staging" / "batch-000000").exists()
    # a wrong report set is refused before anything is written
    with pytest.raises(RuntimeError, match="one report per subtask"):
        again.complete(again.plan(1, 2), reports[:1])


def test_read_state_round_trip_through_a_checkpoint(tmp_path):
    """The driver-side reader sees what the operator wrote, after a restore from the changelog."""
    from dstl.state.metadata import SubtaskState

    src = SyntheticSource(500, 2, users=20, items=10, seed=1)
    with FsStateChangelogStorage(StorageConfig(base_path=str(tmp_path)), job_id="c" * 32) as storage:
        b = _backend(storage, 16, 1, 0)
        for i in range(2):
            user_activity(src.batch(i), b)
        snap = b.snapshot(1).result()
        b.close()
        st = SubtaskState.from_keyed_snapshot(0, snap)
        r = KeyedStateBackend.restore(storage, "op", st.key_group_range, 16, [st.to_keyed_snapshot(16)])
        expected, _ = reference(src.all())
        assert compare_state(read_state(r), expected) == []
        r.close()
