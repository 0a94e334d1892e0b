"""Keyed state inside `mapInPandas`: key-group columns and the stateful task.

Routing. Every row gets its key group (Flink's assignment, vectorised in dstl.keygroups) and its
logical subtask ``kg * parallelism // max_parallelism``. Partition i of one Spark stage is subtask i:

* placed (`StatefulStream`, `StatefulJob`): the batch is joined to a cached anchor of P partitions
  (dstl.spark.session.SubtaskStage), so subtask i runs on the executor that ran it last batch and
  continues its state from memory. The rows get there by a shuffle (hash-partitioned by a salt, the
  anchor partitioned the same way: each row moves once, executor to executor), or, for a small
  batch the driver holds, by a broadcast (dstl.spark.routing.choose_route);
* shuffled only (`stateful_map_in_pandas`): ``repartition(parallelism, salt)``, where ``salt`` is a
  per-subtask integer chosen so that Spark's own hash partitioning (Murmur3, seed 42, ``pmod``)
  sends subtask ``i`` to partition ``i``; no placement.

Either way every subtask runs even without rows (so it snapshots), no two subtasks share a task, and
the task fails loudly if Spark ever gave it a row of another subtask.

Each task takes its subtask's `KeyedStateBackend` from the worker's cache (dstl.spark.cache) when it
is exactly at the latest completed checkpoint, otherwise restores it from that checkpoint's changelog
(any old parallelism: docs/rescaling.md §6). It calls ``fn(rows, state)``, stages the output as a parquet
file, snapshots the state for the new checkpoint and returns one report row: the serialised
`KeyedStateSnapshot` beside the staged file and timings. The driver (dstl.spark.coordinator) turns the
reports into checkpoint metadata and only then commits the staged output.
"""
from __future__ import annotations

import json
import os
import socket
import time
import uuid
from dataclasses import dataclass, field
from typing import Any, Callable, Dict, List, Optional, Sequence, Tuple, Union

from dstl.spark.routing import partition_salts, spark_hash_int  # noqa: F401 - importable from here too
from dstl.spark.session import (ANCHOR_COL, ANCHOR_SALT_COL, FORWARDED_ENV_PREFIXES, LOCAL_ONLY_ENV,  # noqa: F401
                                SALT_COL, ensure_importable_on_workers, struct_from_ddl)

KG_COL = "_dstl_kg"
SUBTASK_COL = "_dstl_subtask"
#: arrival order: a join or a shuffle hands a subtask's rows over in another order, so tasks sort by it
SEQ_COL = "_dstl_seq"
INTERNAL_COLS = (KG_COL, SUBTASK_COL, SALT_COL, ANCHOR_COL, ANCHOR_SALT_COL, SEQ_COL)

REPORT_SCHEMA = (
    "subtask int, attempt int, token string, snapshot binary, staged string, rows_in long, "
    "rows_out long, restored boolean, restore_ms double, process_ms double, snapshot_ms double, "
    "state_size long, pid int, host string, cache_hits long, cache_misses long, metrics string, continued boolean, "
    "executor string, restore_source string, hop_ms double, start_ms double")


# ------------------------------------------------------------------ columns

def with_key_group(df, key_col: str, max_parallelism: int, name: str = KG_COL):
    """`df` plus an int column `name`: the Flink key group of `key_col` (vectorised pandas UDF)."""
    from pyspark.sql import functions as F

    from dstl.keygroups import UPPER_BOUND_MAX_PARALLELISM

    if not isinstance(max_parallelism, int) or not 1 <= max_parallelism <= UPPER_BOUND_MAX_PARALLELISM:
        raise ValueError(f"max_parallelism must be in 1..{UPPER_BOUND_MAX_PARALLELISM}, got {max_parallelism!r}")
    if key_col not in df.columns:
        raise ValueError(f"key column {key_col!r} not in the DataFrame (columns: {', '.join(df.columns)})")
    maxp = max_parallelism
    ensure_importable_on_workers(df.sparkSession)

    @F.pandas_udf("int")
    def key_group(keys):  # pragma: no cover - runs in the Python worker
        import pandas as pd

        from dstl.keygroups import assign_key_groups

        return pd.Series(assign_key_groups(keys, maxp), index=keys.index)

    return df.withColumn(name, key_group(F.col(key_col)))


def with_subtask(df, key_col: str, max_parallelism: int, parallelism: int, name: str = SUBTASK_COL,
                 key_group_col: str = KG_COL):
    """`df` plus the key group and the logical subtask index (Flink's operator index) for `parallelism`."""
    from pyspark.sql import functions as F

    if not isinstance(parallelism, int) or not 1 <= parallelism <= max_parallelism:
        raise ValueError(f"parallelism must be in 1..max_parallelism ({max_parallelism}), got {parallelism!r}")
    if key_group_col not in df.columns:
        df = with_key_group(df, key_col, max_parallelism, key_group_col)
    # kg * p < 2^30: exact integer arithmetic, safe under ANSI mode
    expr = f"CAST((`{key_group_col}` * {parallelism}) DIV {max_parallelism} AS INT)"
    return df.withColumn(name, F.expr(expr))


# ------------------------------------------------------------------ the plan shipped to tasks

@dataclass(frozen=True)
class CheckpointPlan:
    """Everything a task needs for one micro-batch (built by the coordinator, pickled into the task)."""

    job_id: str
    operator_id: str
    base_path: str
    #: the changelog storage's options as `dstl.dfs.*` keys, the file system's keyword arguments as
    #: `dstl.dfs.fs.<name>` (credentials among them: in memory only, left out of the repr)
    storage_mapping: Dict[str, Any] = field(repr=False)
    checkpoint_id: int
    batch: int
    parallelism: int
    max_parallelism: int
    output_path: Optional[str]
    #: latest completed checkpoint (None: fresh start) and its accepted attempt tokens per subtask
    #: (None when its parallelism or max parallelism differs: then nothing can be continued from memory)
    restore_checkpoint_id: Optional[int] = None
    restore_tokens: Optional[Tuple[str, ...]] = None
    backend_options: Dict[str, Any] = field(default_factory=dict)
    #: False: the benchmark baseline, state only in the worker's memory (no changelog, no recovery)
    durable: bool = True
    #: call `fn` also for a subtask without rows (StatefulStream: timers fire without input)
    call_without_rows: bool = False

    def staging_dir(self) -> str:
        return f"{self.output_path.rstrip('/')}/_staging/batch-{self.batch:06d}"


@dataclass
class TaskReport:
    """One subtask's result for one micro-batch, as the driver reads it back."""

    subtask: int
    attempt: int
    token: str
    snapshot: bytes
    staged: Optional[str]
    rows_in: int
    rows_out: int
    restored: bool
    restore_ms: float
    process_ms: float
    #: pre-commit of this checkpoint in the task: output staged + state snapshot persisted
    snapshot_ms: float
    state_size: int
    pid: int
    host: str
    cache_hits: int
    cache_misses: int
    #: JSON of the counters `fn` added through `task_metrics()` (e.g. timers fired)
    metrics: str = "{}"
    #: the backend continued from this worker's memory (a cache hit)
    continued: bool = False
    #: the Spark executor that ran the task ("driver" in local mode)
    executor: str = ""
    #: where the state came from: "memory" (continued), "local" (this host's local-recovery copy),
    #: "dfs" (the base path), "new" (no checkpoint yet)
    restore_source: str = ""
    #: the rows' way from the worker to the subtask's slot process (dstl.spark.slot_client); 0 in the worker
    hop_ms: float = 0.0
    #: from taking the subtask's state to calling fn: continuing (ms) or restoring it, confirming
    #: the completed checkpoint, pruning local copies (the hop not included)
    start_ms: float = 0.0

    @classmethod
    def from_row(cls, row) -> "TaskReport":
        d = row.asDict() if hasattr(row, "asDict") else dict(row)
        d["snapshot"] = bytes(d["snapshot"])
        if d.get("metrics") is None:
            d["metrics"] = "{}"
        d["continued"] = bool(d.get("continued"))
        d["executor"] = d.get("executor") or ""
        d["restore_source"] = d.get("restore_source") or ""
        d["hop_ms"] = float(d.get("hop_ms") or 0.0)
        d["start_ms"] = float(d.get("start_ms") or 0.0)
        return cls(**d)

    def metric(self, name: str, default: int = 0) -> int:
        import json

        return json.loads(self.metrics or "{}").get(name, default)


# ------------------------------------------------------------------ what fn can ask about its task

_TASK: Dict[str, Any] = {"subtask": None, "metrics": {}}


def current_subtask() -> Optional[int]:
    """The logical subtask whose `fn` is running (None outside a task)."""
    return _TASK["subtask"]


def task_metrics() -> Dict[str, int]:
    """Counters `fn` may add to; they travel to the driver in the task's report (`metrics`)."""
    return _TASK["metrics"]


# ------------------------------------------------------------------ state backend adapters

def _state_api():
    from dstl.state.backend import KeyedStateBackend, KeyedStateSnapshot

    return KeyedStateBackend, KeyedStateSnapshot


def snapshot_to_subtask_state(index: int, snapshot_bytes: bytes):
    """A task's serialised KeyedStateSnapshot -> K's SubtaskState for the checkpoint metadata."""
    from dstl.state.metadata import SubtaskState

    _, KeyedStateSnapshot = _state_api()
    return SubtaskState.from_keyed_snapshot(index, KeyedStateSnapshot.from_bytes(snapshot_bytes))


def subtask_state_to_snapshot(state, max_parallelism: Optional[int] = None):
    """K's SubtaskState -> the KeyedStateSnapshot S restores from."""
    return state.to_keyed_snapshot(max_parallelism)


def open_backend(storage, plan: CheckpointPlan, subtask: int):
    """A fresh backend (no checkpoint yet) or one restored from the plan's completed checkpoint."""
    return restore_backend(storage, plan, subtask)[0]


def restore_backend(storage, plan: CheckpointPlan, subtask: int):
    """`(backend, source, files)`: `open_backend`'s backend, where its files were read ("local",
    "local+dfs" or "dfs"; "new" without a checkpoint) and the names of the files it restored from."""
    from dstl.keygroups import compute_key_group_range_for_operator_index

    KeyedStateBackend, _ = _state_api()
    kgr = compute_key_group_range_for_operator_index(plan.max_parallelism, plan.parallelism, subtask)
    if plan.restore_checkpoint_id is None:
        backend = KeyedStateBackend(storage, plan.operator_id, kgr, plan.max_parallelism, **plan.backend_options)
        return backend, "new", []
    from dstl.changelog.local_recovery import file_names
    from dstl.state.metadata import read_checkpoint

    meta = read_checkpoint(plan.base_path, plan.restore_checkpoint_id)
    if meta.max_parallelism != plan.max_parallelism:
        raise ValueError(f"checkpoint {meta.checkpoint_id} has max parallelism {meta.max_parallelism}, "
                         f"the job asks for {plan.max_parallelism}; it cannot change (docs/rescaling.md §1)")
    snaps = [subtask_state_to_snapshot(s, meta.max_parallelism) for s in meta.subtasks]
    if getattr(storage, "local_copies", None) is not None:  # other subtasks restoring here need the rest
        _CHECKPOINT_FILES[plan.job_id] = (meta.checkpoint_id, set(file_names(snaps)))
    old = [snap for s, snap in zip(meta.subtasks, snaps)
           if max(s.key_group_range.start, kgr.start) <= min(s.key_group_range.end, kgr.end)]
    backend, source = restore_preferring_local(
        storage, lambda: KeyedStateBackend.restore(storage, plan.operator_id, kgr, plan.max_parallelism, old,
                                                   **plan.backend_options))
    return backend, source, file_names(old)


def restore_preferring_local(storage, restore: Callable[[], Any]) -> Tuple[Any, str]:
    """`(restore(), source)`: the restore reads each file from this host's local copy when it has a
    good one (dstl.changelog.local_recovery). A copy that passed the length check but fails to
    decode (raw files carry no checksum, only their structure is checked) is deleted and the whole
    restore runs again from the base path, so a bad copy costs time, never a wrong state."""
    from dstl.errors import CorruptChangelogError

    copies = getattr(storage, "local_copies", None)
    if copies is None:
        return restore(), "dfs"
    from dstl.changelog.local_recovery import source_of

    copies.read.clear()
    before = copies.counters()
    try:
        return restore(), source_of(before, copies.counters())
    except CorruptChangelogError as exc:
        if copies.hits == before["hits"]:
            raise  # nothing came from a copy: the base path's file itself is bad
        import logging

        suspects = list(copies.read)
        logging.getLogger(__name__).warning(
            "restore from this host's local copies failed (%s): deleting the %d copies it read and "
            "restoring from the base path", exc, len(suspects))
        copies.discard(suspects)
    copies.enabled = False
    try:
        return restore(), "dfs"
    finally:
        copies.enabled = True


#: local recovery in this worker: per cache key, the files of its latest snapshot(s) (kept while the
#: key is cached), and per job the files of the checkpoint the last restore here read
_KEY_FILES: Dict[Tuple, set] = {}
_LAST_FILES: Dict[Tuple, set] = {}
_CHECKPOINT_FILES: Dict[str, Tuple[int, set]] = {}


def _prune_local_copies(storage, plan: CheckpointPlan, key: Tuple, completed_files) -> None:
    """Delete this worker's local copies no checkpoint it still serves references (Flink removes a
    subsumed checkpoint's local state): kept are the files of the completed and the pending snapshot
    of every subtask this worker holds, and those of the latest completed checkpoint a restore here
    read (other subtasks restoring from it on this host need them)."""
    from dstl.changelog.local_recovery import prune
    from dstl.spark.cache import CACHE

    owner = getattr(storage, "local_recovery_dir", None)
    if getattr(storage, "local_copies", None) is None or not owner or plan.restore_checkpoint_id is None:
        return
    _KEY_FILES[key] = set(completed_files)
    live = set(CACHE.checkpoints()) | {key}
    for k in [k for k in _KEY_FILES if k not in live]:
        _KEY_FILES.pop(k, None)
        _LAST_FILES.pop(k, None)
    keep: set = set()
    for k, files in _KEY_FILES.items():
        if k[0] == plan.job_id:
            keep |= files
    ckpt = _CHECKPOINT_FILES.get(plan.job_id)
    if ckpt is not None and ckpt[0] < plan.restore_checkpoint_id:  # subsumed
        del _CHECKPOINT_FILES[plan.job_id]
    elif ckpt is not None:
        keep |= ckpt[1]
    prune(owner, plan.job_id, keep)


def _state_size(snapshot) -> int:
    size = sum(int(getattr(h, "state_size", 0) or 0) for h in snapshot.materialized)
    if snapshot.changelog is not None:
        size += int(snapshot.changelog.state_size or 0)
    return size


# ------------------------------------------------------------------ the task

def _write_staged(plan: CheckpointPlan, subtask: int, token: str, out, arrow_schema) -> Tuple[Optional[str], int]:
    import pyarrow as pa
    import pyarrow.parquet as pq

    from dstl.changelog.fs import filesystem

    if out is None or len(out) == 0:
        return None, 0
    if isinstance(out, (pa.RecordBatch, pa.Table)):  # the row API's output: already Arrow
        table = pa.Table.from_batches([out]) if isinstance(out, pa.RecordBatch) else out
        table = table.select(arrow_schema.names).cast(arrow_schema)
    elif not isinstance(out, __import__("pandas").DataFrame):
        raise TypeError(f"fn must return a pandas DataFrame or None, got {type(out).__name__}")
    else:
        missing = [n for n in arrow_schema.names if n not in out.columns]
        if missing:
            raise ValueError(f"fn's output lacks the schema's columns {missing}")
        table = pa.Table.from_pandas(out[arrow_schema.names], schema=arrow_schema, preserve_index=False)
    path = f"{plan.staging_dir()}/part-{subtask:05d}-{token}.parquet"
    fs, fs_path = filesystem(path)
    fs.makedirs(fs_path.rsplit("/", 1)[0], exist_ok=True)
    with fs.open(fs_path, "wb") as f:
        pq.write_table(table, f)
    return path, table.num_rows


def run_subtask(plan: CheckpointPlan, fn: Callable, rows, subtask: int, attempt: int, arrow_schema) -> Dict[str, Any]:
    """Continue or restore subtask `subtask`'s state, apply `fn`, stage the output, snapshot."""
    from dstl.spark import heap

    try:
        return _run_subtask(plan, fn, rows, subtask, attempt, arrow_schema)
    finally:
        # the state this process holds between tasks out of the collector's way (dstl.spark.heap)
        heap.after_task()


def _run_subtask(plan: CheckpointPlan, fn: Callable, rows, subtask: int, attempt: int, arrow_schema) -> Dict[str, Any]:
    from dstl.spark.cache import CACHE, CacheEntry, storage_for
    from dstl.spark.session import executor_id

    if not plan.durable:
        from dstl.config import StorageConfig

        StorageConfig.of(plan.storage_mapping)  # no storage, but the output needs the file system's arguments
        return _run_in_memory(plan, fn, rows, subtask, attempt, arrow_schema)
    _quiet_expected_warnings()
    storage = storage_for(plan.job_id, plan.storage_mapping)
    key = (plan.job_id, plan.operator_id, plan.parallelism, plan.max_parallelism, subtask)
    CACHE.evict_rescaled(plan.job_id, plan.operator_id, plan.parallelism, plan.max_parallelism)
    t0 = time.perf_counter()
    want_token = plan.restore_tokens[subtask] if plan.restore_tokens is not None else None
    backend = CACHE.acquire(key, plan.restore_checkpoint_id, want_token)
    if backend is not None and backend.storage is not storage:
        # the same checkpoint at another base path (a copied job): its writer would log to the old place
        CACHE._close_stale(CacheEntry(backend, plan.restore_checkpoint_id, want_token), None)
        backend = None
    from_memory = backend is not None
    if backend is None:
        backend, source, completed_files = restore_backend(storage, plan, subtask)
    else:
        source, completed_files = "memory", _LAST_FILES.get(key, ())
    # restored: really rebuilt from a checkpoint's changelog (a fresh job's first batch is not)
    restored = not from_memory and plan.restore_checkpoint_id is not None
    t1 = time.perf_counter()
    token = uuid.uuid4().hex
    try:
        if from_memory:
            # the checkpoint this backend snapshotted is now complete: hand its files to the checkpoint
            backend.confirm(plan.restore_checkpoint_id)
        _prune_local_copies(storage, plan, key, completed_files)
        t_start = time.perf_counter()
        _fault_mid_batch(plan, fn, rows, backend, subtask)
        _TASK["subtask"], _TASK["metrics"] = subtask, {}
        try:
            out = fn(rows, backend) if len(rows) or plan.call_without_rows else None
        finally:
            _TASK["subtask"] = None
        t2 = time.perf_counter()
        staged, rows_out = _write_staged(plan, subtask, token, out, arrow_schema)
        snapshot = backend.snapshot(plan.checkpoint_id).result()
        t3 = time.perf_counter()
        payload = snapshot.to_bytes()
    except BaseException:
        # half-updated: never cached, never used again; its uploads are unreferenced garbage
        try:
            backend.close()
        except Exception:
            pass
        raise
    CACHE.put(key, backend, plan.checkpoint_id, token)
    if getattr(storage, "local_copies", None) is not None:  # completed + pending: either may be restored
        from dstl.changelog.local_recovery import file_names

        _LAST_FILES[key] = set(file_names([snapshot]))
        _KEY_FILES[key] = _KEY_FILES.get(key, set()) | _LAST_FILES[key]
    return dict(subtask=subtask, attempt=attempt, token=token, snapshot=payload, staged=staged,
                rows_in=len(rows), rows_out=rows_out, restored=restored,
                restore_ms=(t1 - t0) * 1e3 if restored else 0.0, process_ms=(t2 - t_start) * 1e3,
                start_ms=(t_start - t0) * 1e3,
                snapshot_ms=(t3 - t2) * 1e3, state_size=_state_size(snapshot), pid=os.getpid(),
                host=socket.gethostname(), cache_hits=CACHE.hits, cache_misses=CACHE.misses,
                metrics=json.dumps(_TASK["metrics"]), continued=from_memory, executor=executor_id(),
                restore_source=source if restored or from_memory else "new")


def run_placed(plan: CheckpointPlan, fn: Callable, rows, subtask: int, attempt: int, arrow_schema) -> Dict[str, Any]:
    """`run_subtask` in the subtask's slot process on this host (dstl.spark.slot_client), where its state
    stays warm whichever Python worker Spark picked; in this worker when slots are off."""
    from dstl.spark import slot_client

    if not slot_client.enabled():
        return dict(run_subtask(plan, fn, rows, subtask, attempt, arrow_schema), hop_ms=0.0)
    from dstl.spark import faults
    from dstl.spark.session import executor_process

    request = dict(plan=plan, fn=fn, rows=rows, subtask=subtask, attempt=attempt, arrow_schema=arrow_schema)
    payload = slot_client.dumps(request, by_value=True)
    return slot_client.call(slot_client.slot_name(plan.job_id, plan.operator_id, subtask), payload, executor_process(),
                      subtask, sent=lambda: faults.point("task.worker_wait", plan.batch, subtask=subtask))


def _quiet_expected_warnings() -> None:
    # After a confirm the checkpoint owns the files; the truncation that follows a confirmed
    # materialization then "releases" untracked files, which the registry logs as a warning per file.
    # In this integration that is the normal path, not a problem worth a line on the console.
    import logging

    logging.getLogger("dstl.changelog.registry").setLevel(logging.ERROR)


_MEMORY: Dict[Tuple, Any] = {}


def _run_in_memory(plan: CheckpointPlan, fn: Callable, rows, subtask: int, attempt: int, arrow_schema):
    """Baseline: the same operator on dict state kept in this worker (lost whenever the worker changes)."""
    from dstl.spark.memory import MemoryState
    from dstl.spark.session import executor_id

    key = (plan.job_id, plan.operator_id, plan.parallelism, subtask)
    state = _MEMORY.setdefault(key, MemoryState())
    token = uuid.uuid4().hex
    t1 = time.perf_counter()
    out = fn(rows, state) if len(rows) else None
    t2 = time.perf_counter()
    staged, rows_out = _write_staged(plan, subtask, token, out, arrow_schema)
    return dict(subtask=subtask, attempt=attempt, token=token, snapshot=b"", staged=staged,
                rows_in=len(rows), rows_out=rows_out, restored=False, restore_ms=0.0, start_ms=0.0,
                process_ms=(t2 - t1) * 1e3, snapshot_ms=0.0, state_size=0, pid=os.getpid(),
                host=socket.gethostname(), cache_hits=0, cache_misses=0, metrics="{}",
                continued=False, executor=executor_id(), restore_source="memory")


def _fault_mid_batch(plan: CheckpointPlan, fn: Callable, rows, backend, subtask: int) -> None:
    """The `task.mid_batch` fault point (dstl.spark.faults; the pipeline's --fail-at): when armed,
    half of the rows reach the state, then the task crashes."""
    from dstl.spark import faults

    def apply_half() -> None:
        half = rows.iloc[: len(rows) // 2]
        if len(half):
            fn(half, backend)

    faults.point("task.mid_batch", plan.batch, subtask=subtask, before=apply_half,
                 detail=f"crashed after applying {len(rows) // 2} of {len(rows)} rows; Spark retries the task")


def _make_task(plan: CheckpointPlan, fn: Callable, arrow_schema, columns: Sequence[str],
               order_by: Optional[Sequence[str]]):
    """The mapInPandas function: partition i is subtask i (by the shuffle's salt, or by the anchor
    of dstl.spark.session.SubtaskStage, whose all-null row stands for a subtask without rows)."""
    def task(batches):  # pragma: no cover - runs in the Python worker (covered by the Spark tests)
        import pandas as pd
        from pyspark import TaskContext

        ctx = TaskContext.get()
        subtask = ctx.partitionId()
        frames = [b for b in batches if len(b)]
        rows = pd.concat(frames, ignore_index=True) if frames else pd.DataFrame(columns=list(columns))
        if ANCHOR_COL in rows.columns:
            anchors = rows[ANCHOR_COL].unique()
            if len(anchors) > 1 or (len(anchors) and int(anchors[0]) != subtask):
                raise RuntimeError(f"Spark task of partition {subtask} scanned anchor rows {sorted(anchors)}: "
                                   f"placement broken")
            rows = rows[rows[SUBTASK_COL].notna()]  # the left join's row for a subtask without rows
        if SEQ_COL in rows.columns and len(rows) > 1:
            rows = rows.sort_values(SEQ_COL, kind="stable")
        if len(rows) and SUBTASK_COL in rows.columns:
            wrong = rows[SUBTASK_COL].to_numpy() != subtask
            if wrong.any():
                raise RuntimeError(f"Spark task for subtask {subtask} received rows of subtask "
                                   f"{int(rows[SUBTASK_COL].to_numpy()[wrong][0])}: routing broken")
        rows = rows.drop(columns=[c for c in INTERNAL_COLS if c in rows.columns]).reset_index(drop=True)
        if order_by and len(rows) > 1:
            rows = rows.sort_values(list(order_by), kind="stable", ignore_index=True)
        report = run_placed(plan, fn, rows, subtask, ctx.attemptNumber(), arrow_schema)
        yield pd.DataFrame([report])

    return task


def _arrow_output_schema(schema):
    from pyspark.sql.pandas.types import to_arrow_schema

    if isinstance(schema, str):
        schema = struct_from_ddl(schema)
    # TimestampType columns are instants (UTC in Arrow); PySpark 4.3 wants the zone named, and
    # PySpark 3.5's to_arrow_schema takes no zone (its timestamps are UTC already)
    try:
        return to_arrow_schema(schema, timezone="UTC")
    except TypeError:
        return to_arrow_schema(schema)


def stateful_map_in_pandas_local(spark, pdf, fn: Callable, schema, *, key: str, checkpoint: CheckpointPlan,
                                 parallelism: Optional[int] = None, max_parallelism: Optional[int] = None,
                                 order_by: Optional[Sequence[str]] = None, events_schema: Any = None,
                                 stage: Any = None, route: Optional[str] = None):
    """Same as `stateful_map_in_pandas` for a micro-batch held by the driver as a pandas DataFrame.

    The driver computes each row's subtask (vectorised key groups) and the batch runs as one stage
    of P tasks placed by `stage` (a `dstl.spark.session.SubtaskStage` the caller keeps across
    batches, so subtask i stays on its executor and continues its state from memory; without one,
    a throw-away stage places the subtasks anew). `route`: "broadcast" or "shuffle"; None chooses by
    the batch's size (dstl.spark.routing.choose_route).
    """
    import pyarrow as pa

    from dstl.keygroups import assign_key_groups, operator_indices_for_key_groups
    from dstl.spark.routing import choose_route

    parallelism = checkpoint.parallelism if parallelism is None else parallelism
    max_parallelism = checkpoint.max_parallelism if max_parallelism is None else max_parallelism
    if checkpoint.parallelism != parallelism or checkpoint.max_parallelism != max_parallelism:
        raise ValueError(f"checkpoint plan is for parallelism {checkpoint.parallelism}/{checkpoint.max_parallelism}, "
                         f"called with {parallelism}/{max_parallelism}")
    if key not in pdf.columns:
        raise ValueError(f"key column {key!r} not in the batch (columns: {', '.join(pdf.columns)})")
    route = choose_route(pdf, route)
    ensure_importable_on_workers(spark)
    arrow_schema = _arrow_output_schema(schema)
    from pyspark.sql.pandas.types import from_arrow_schema
    from pyspark.sql.types import IntegerType, StructField, StructType

    if events_schema is None:  # from the pandas dtypes
        events_schema = from_arrow_schema(pa.Schema.from_pandas(pdf, preserve_index=False))
    elif isinstance(events_schema, str):
        events_schema = struct_from_ddl(events_schema)
    if order_by:
        pdf = pdf.sort_values(list(order_by), kind="stable", ignore_index=True)
    subtasks = operator_indices_for_key_groups(assign_key_groups(pdf[key], max_parallelism),
                                               max_parallelism, parallelism)
    import numpy as np
    from pyspark.sql.types import LongType

    keyed = pdf.assign(**{SUBTASK_COL: subtasks.astype("int32"), SEQ_COL: np.arange(len(pdf), dtype="int64")})
    full = StructType(list(events_schema.fields) + [StructField(SUBTASK_COL, IntegerType(), False),
                                                    StructField(SEQ_COL, LongType(), False)])
    sdf = spark.createDataFrame(keyed, schema=full)
    task = _make_task(checkpoint, fn, arrow_schema, list(keyed.columns), None)
    return _on_stage(spark, stage, parallelism, sdf, task, route)


def _on_stage(spark, stage, parallelism: int, sdf, task, route: str):
    from dstl.spark.session import SubtaskStage

    if stage is None:
        stage = SubtaskStage(spark, parallelism)
    elif stage.parallelism != parallelism:
        raise ValueError(f"the stage is for parallelism {stage.parallelism}, the plan for {parallelism}")
    return stage.run(sdf, SUBTASK_COL, task, REPORT_SCHEMA, route=route)


def stateful_map_in_pandas_staged(df, fn: Callable, schema, *, checkpoint: CheckpointPlan,
                                  order_by: Optional[Sequence[str]] = None, stage: Any = None,
                                  route: str = "shuffle"):
    """`stateful_map_in_pandas` for a Spark DataFrame that already has the `SUBTASK_COL` column:
    one stage of P tasks placed by `stage` (see `stateful_map_in_pandas_local`). With the default
    `route` the batch is shuffled straight to the placed tasks (each row moves once, the driver
    never holds it); "broadcast" ships it whole to every executor (small batches only)."""
    if SUBTASK_COL not in df.columns:
        raise ValueError(f"the DataFrame lacks the {SUBTASK_COL!r} column (use with_subtask first)")
    from pyspark.sql import functions as F

    spark = df.sparkSession
    ensure_importable_on_workers(spark)
    arrow_schema = _arrow_output_schema(schema)
    for c in order_by or ():
        if c not in df.columns:
            raise ValueError(f"order_by column {c!r} not in the DataFrame")
    df = df.withColumn(SEQ_COL, F.monotonically_increasing_id())
    task = _make_task(checkpoint, fn, arrow_schema, list(df.columns), order_by)
    return _on_stage(spark, stage, checkpoint.parallelism, df, task, route)


def stateful_map_in_pandas(df, fn: Callable, schema, *, key: str, checkpoint: CheckpointPlan,
                           parallelism: Optional[int] = None, max_parallelism: Optional[int] = None,
                           storage_config: Any = None, order_by: Optional[Sequence[str]] = None):
    """Run ``fn(rows, state)`` per logical subtask over `df`; returns a DataFrame of task reports.

    `fn` gets all rows of one subtask for this micro-batch (a pandas DataFrame, sorted by `order_by`
    if given) and that subtask's `KeyedStateBackend`; it returns a pandas DataFrame matching `schema`
    (a DDL string or StructType), or None. Output is staged, not committed: hand the reports to
    `CheckpointCoordinator.complete` (or use `StatefulJob`). Evaluate the result exactly once.
    `storage_config` overrides `checkpoint.storage_mapping` when given (mapping or StorageConfig).
    `parallelism` and `max_parallelism` come from the plan; passing them only double-checks them.
    """
    from pyspark.sql import functions as F

    parallelism = checkpoint.parallelism if parallelism is None else parallelism
    max_parallelism = checkpoint.max_parallelism if max_parallelism is None else max_parallelism
    if checkpoint.parallelism != parallelism or checkpoint.max_parallelism != max_parallelism:
        raise ValueError(f"checkpoint plan is for parallelism {checkpoint.parallelism}/{checkpoint.max_parallelism}, "
                         f"called with {parallelism}/{max_parallelism}")
    if storage_config is not None:
        from dstl.config import StorageConfig

        opts = StorageConfig.of(storage_config).to_mapping()
        checkpoint = _replace(checkpoint, storage_mapping=opts)
    arrow_schema = _arrow_output_schema(schema)
    for c in order_by or ():
        if c not in df.columns:
            raise ValueError(f"order_by column {c!r} not in the DataFrame")
    keyed = with_subtask(df, key, max_parallelism, parallelism)
    from dstl.spark.routing import salt_column

    routed = keyed.withColumn(SALT_COL, salt_column(F.col(SUBTASK_COL), parallelism)).repartition(
        parallelism, F.col(SALT_COL))
    task = _make_task(checkpoint, fn, arrow_schema, routed.columns, order_by)
    return routed.mapInPandas(task, REPORT_SCHEMA)


def _replace(plan: CheckpointPlan, **changes) -> CheckpointPlan:
    import dataclasses

    return dataclasses.replace(plan, **changes)
