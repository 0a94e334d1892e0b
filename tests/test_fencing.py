"""One writer per base path: the writer lease, exclusive checkpoint creation, and two real concurrent
writers on local disk and on moto's S3 (exactly one wins; its state and output are exact; the loser
leaves nothing `dstl gc` would not remove)."""
from __future__ import annotations

import os
import subprocess
import sys
import threading
import uuid

import pandas as pd
import pytest

import writer_race
from conftest import heavy
from dstl.changelog import fs as dfs
from dstl.spark.coordinator import CheckpointCoordinator
from dstl.state.fencing import LEASE_DIR, BasePathInUseError, WriterLease, current_holder

HERE = os.path.dirname(os.path.abspath(__file__))


def _memory_base() -> str:
    return f"memory://fencing-{uuid.uuid4().hex[:10]}/base"


def test_lease_takeover_fences_the_older_run_on_a_store_without_atomic_create():
    base = _memory_base()
    fs, _ = dfs.root_of(base)
    assert not dfs.has_atomic_create(fs)
    a = WriterLease.acquire(base, "a" * 32)
    a.check()
    b = WriterLease.acquire(base, "b" * 32)
    b.check()
    assert b.epoch == a.epoch + 1
    with pytest.raises(BasePathInUseError) as err:
        a.check()
    msg = str(err.value)
    assert msg.startswith(f"base path {base} is being written by job {'b' * 32} (query started at "
                          f"{b.started_at}")
    assert msg.endswith("stop that query, or use another base path")
    assert current_holder(base)["writer"] == b.writer
    assert len(fs.ls(f"{base}/{LEASE_DIR}")) == 1  # the replaced run's epoch file is gone


@pytest.mark.parametrize("store", ["memory", "local"])
def test_racing_takeovers_leave_exactly_one_holder(store, tmp_path):
    """Eight runs take the base path over at once: whatever the store, exactly one still holds it."""
    base = _memory_base() if store == "memory" else str(tmp_path / "base")
    leases, errors = [], []
    start = threading.Barrier(8)

    def take(i):
        start.wait()
        try:
            leases.append(WriterLease.acquire(base, f"{i:032x}"))
        except BasePathInUseError as exc:
            errors.append(exc)

    threads = [threading.Thread(target=take, args=(i,)) for i in range(8)]
    for t in threads:
        t.start()
    for t in threads:
        t.join(30)
    assert len(leases) + len(errors) == 8
    holders = []
    for lease in leases:
        try:
            lease.check()
            holders.append(lease)
        except BasePathInUseError:
            pass
    assert len(holders) == 1
    assert current_holder(base)["writer"] == holders[0].writer


def _report(storage_opts, coord, plan, subtask: int, value: int):
    """A real task body's report without Spark: run_subtask on a one-row batch."""
    import pyarrow as pa

    from dstl.spark.report import TaskReport
    from dstl.spark.task import run_subtask

    rows = pd.DataFrame({"key": [subtask]}, dtype="int64")

    def fn(r, state):
        state.value_state("v").update(int(r["key"].iloc[0]), value)
        return pd.DataFrame({"key": [subtask], "count": [value]})

    schema = pa.schema([("key", pa.int64()), ("count", pa.int64())])
    return TaskReport(**run_subtask(plan, fn, rows, subtask, 0, schema))


@pytest.fixture
def worker_cache():
    """run_subtask keeps its storages (and their upload threads) for the process: close them after."""
    from dstl.spark import cache

    yield
    cache.shutdown()


def test_a_replaced_coordinator_fails_before_it_writes_commits_or_deletes(worker_cache):
    """memory:// has no atomic create: the lease alone fences. The old run's checkpoint is refused
    before anything is written, its staged output is removed, and its finish() deletes nothing."""
    from dstl.state.metadata import list_checkpoints

    base = _memory_base()
    opts = writer_race.options(base)
    first = CheckpointCoordinator.open(base, writer_race.spec(base), opts, resume=False)
    old = CheckpointCoordinator.open(base, writer_race.spec(base), opts, resume=True)
    plan = old.plan(0, 1)
    report = _report(opts, old, plan, 0, 5)
    fs, staged = dfs.filesystem(report.staged)
    assert fs.exists(staged)
    new = CheckpointCoordinator.open(base, writer_race.spec(base), opts, resume=True)
    with pytest.raises(BasePathInUseError, match=f"being written by job {new.spec.job_id} "
                                                 rf"\(query started at {new.lease.started_at}"):
        old.complete(plan, [report])
    assert list_checkpoints(base) == [] and not fs.exists(staged)
    with pytest.raises(BasePathInUseError):
        first.finish()
    with pytest.raises(BasePathInUseError):
        old.collect_garbage(final=True)
    plan = new.plan(0, 1)
    new.complete(plan, [_report(opts, new, plan, 0, 7)])
    assert list_checkpoints(base) == [1]
    assert new.latest.properties["writer"]["writer"] == new.lease.writer


def test_two_new_jobs_on_one_base_path_one_creates_it(tmp_path):
    base = str(tmp_path / "base")
    opts = writer_race.options(base)
    winner = CheckpointCoordinator.open(base, writer_race.spec(base), opts, resume=False)
    with pytest.raises(BasePathInUseError, match=f"being written by job {winner.spec.job_id}"):
        from dstl.spark.coordinator import _write_job_file

        fs, root = dfs.root_of(base)
        _write_job_file(fs, f"{root}/_dstl_job.json", base, writer_race.spec(base), exclusive=True)


def test_checkpoint_create_is_exclusive_on_s3(s3_bucket):
    """s3fs sends If-None-Match: * and moto honours it: of six racing writers of one checkpoint id
    exactly one succeeds, and the others' error names the winner's run."""
    from dstl.state.metadata import CheckpointExistsError, read_checkpoint, write_checkpoint
    from test_checkpoint_metadata import _metadata

    base = f"{s3_bucket}/base"
    write_checkpoint(base, _metadata(1))
    results = []
    start = threading.Barrier(6)

    def attempt(tag):
        meta = _metadata(2, tag=tag)
        meta.properties["writer"] = {"started_at": f"T-{tag}"}
        start.wait()
        try:
            write_checkpoint(base, meta)
            results.append(tag)
        except CheckpointExistsError as exc:
            results.append(str(exc))

    threads = [threading.Thread(target=attempt, args=(f"w{i}",)) for i in range(6)]
    for t in threads:
        t.start()
    for t in threads:
        t.join(60)
    winners = [r for r in results if r.startswith("w")]
    assert len(results) == 6 and len(winners) == 1
    assert read_checkpoint(base, 2).subtasks[0].materialized[0].files()[0].endswith(f"mat-{winners[0]}-0")
    for r in results:
        if r != winners[0]:
            assert f"query started at T-{winners[0]}" in r and "use another base path" in r


def _files(base: str):
    fs, root = dfs.root_of(base)
    fs.invalidate_cache()
    return sorted(p[len(root.rstrip("/")) + 1:] for p in fs.find(root))


@pytest.mark.parametrize("store", ["local", pytest.param("s3", marks=heavy)])  # S3: the local run covers both builds
def test_two_concurrent_writers_exactly_one_wins(store, tmp_path, request):
    """Two runs resume one job at the same moment (a restarted query and the old one's zombie
    driver). The later takeover wins and finishes every batch; the other fails with the message
    before it commits anything. The winner's state and output equal a pandas recomputation, and
    after `dstl gc` nothing of the loser remains."""
    from dstl.changelog.checkpoints import files_referenced
    from dstl.state.reader import read_state_pandas
    from dstl.tools.gc import changelog_files, collect, load_retained

    if store == "s3":
        base = f"{request.getfixturevalue('s3_bucket')}/job"
    else:
        base = str(tmp_path / "job")
    batches = 6
    job = CheckpointCoordinator.open(base, writer_race.spec(base), writer_race.options(base), resume=False)
    barrier = tmp_path / "barrier"
    barrier.mkdir()
    env = dict(os.environ, PYTHONPATH=os.pathsep.join([os.path.dirname(HERE), HERE]))
    procs = [subprocess.Popen([sys.executable, os.path.join(HERE, "writer_race.py"), base, str(batches),
                               str(barrier), name], stdout=subprocess.PIPE, stderr=subprocess.PIPE, text=True,
                              env=env) for name in ("a", "b")]
    outs = []
    try:
        for p in procs:
            out, err = p.communicate(timeout=240)
            outs.append((p.returncode, out.strip(), err))
    finally:
        for p in procs:
            if p.poll() is None:
                p.kill()
    codes = sorted(c for c, _, _ in outs)
    assert codes == [0, 3], outs
    lost = next(o for c, o, _ in outs if c == 3)
    assert lost.startswith(f"LOST base path {base} is being written by job {job.spec.job_id} (query started at ")
    assert lost.endswith("stop that query, or use another base path")

    counts, rows = writer_race.expected(batches)
    state = read_state_pandas(base, "count")
    assert dict(zip(state["key"].astype(int), state["value"].astype(int))) == counts
    fs, root = dfs.root_of(base)
    got = []
    for b in range(batches):
        d = f"{root}/output/batch-{b:06d}"
        names = sorted(n.rsplit("/", 1)[-1] for n in fs.ls(d, detail=False))
        assert names == ["_SUCCESS", "part-00000.parquet", "part-00001.parquet"]
        for part in names[1:]:
            with fs.open(f"{d}/{part}", "rb") as f:
                df = pd.read_parquet(f)
            got += [(b, int(k), int(c)) for k, c in zip(df["key"], df["count"])]
    assert sorted(got) == rows

    collect(base, load_retained([], 2, base), 0, delete=True)
    referenced = {k.rsplit("/", 1)[-1] for k in files_referenced(base, latest=2)}
    left = {info["name"].rsplit("/", 1)[-1] for _, _, info in changelog_files(base)}
    assert left == referenced
    others = [f for f in _files(base) if not f.startswith(f"{job.spec.job_id}/dstl/")]
    assert not [f for f in others if "_staging" in f or "inprogress" in f]
    assert len([f for f in others if f.startswith(f"{LEASE_DIR}/")]) == 1
    assert len([f for f in others if f.startswith("checkpoints/")]) == 2


def test_errors_are_public():
    import dstl
    from dstl.changelog.fs import StoreUnreachableError

    assert dstl.BasePathInUseError is BasePathInUseError and issubclass(BasePathInUseError, dstl.DstlError)
    assert dstl.StoreUnreachableError is StoreUnreachableError and issubclass(StoreUnreachableError, OSError)
