"""The task body: what runs in the Python worker (or the subtask's slot process) for one subtask and
one micro-batch.

`make_task` is the `mapInPandas` function: partition i is subtask i; it checks that every row is
subtask i's, restores arrival order and hands the rows to `run_placed`, which runs `run_subtask` in
the subtask's slot process (dstl.spark.slot_client) or in this worker. `run_subtask` takes the
subtask's `KeyedStateBackend` from the process's cache (dstl.spark.cache) when it is exactly at the
latest completed checkpoint, otherwise restores it (dstl.spark.restore); calls ``fn(rows, state)``;
stages the output as a parquet file; snapshots the state for the new checkpoint; and returns the
report row (dstl.spark.report). `current_subtask` and `task_metrics` are what `fn` may ask.
"""
from __future__ import annotations

import json
import logging
import os
import socket
import time
import uuid
from typing import Any, Callable, Dict, Optional, Sequence, Tuple

import pandas as pd
import pyarrow as pa
import pyarrow.parquet as pq

from dstl.changelog.fs import filesystem, make_parent_dirs
from dstl.config import StorageConfig
from dstl.spark import faults, heap, slot_client
from dstl.spark import task_figures as figures
from dstl.spark.cache import CACHE, CacheEntry, storage_for
from dstl.spark.errors import call_fn, output_lacks_columns, store_failed
from dstl.spark.memory import MemoryState
from dstl.spark.plan import CheckpointPlan
from dstl.spark.restore import (last_snapshot_files, prune_local_copies, remember_snapshot_files,
                                restore_backend)
from dstl.spark.routing import SALT_COL, SEQ_COL, SUBTASK_COL, NullKeyError
from dstl.spark.session import ANCHOR_COL, ANCHOR_SALT_COL, executor_id, executor_process, struct_from_ddl

#: the key-group column `with_key_group` adds
KG_COL = "_dstl_kg"
#: the route's columns, dropped before `fn` sees the rows
INTERNAL_COLS = (KG_COL, SUBTASK_COL, SALT_COL, ANCHOR_COL, ANCHOR_SALT_COL, SEQ_COL)


# ------------------------------------------------------------------ what fn can ask about its task

#: the subtask whose fn runs in this process now, and the counters it adds (one task at a time)
_TASK: Dict[str, Any] = {"subtask": None, "metrics": {}}


def current_subtask() -> Optional[int]:
    """The logical subtask whose `fn` is running (None outside a task)."""
    return _TASK["subtask"]


def task_metrics() -> Dict[str, int]:
    """Counters `fn` may add to; they travel to the driver in the task's report (`metrics`)."""
    return _TASK["metrics"]


def _state_size(snapshot) -> int:
    size = sum(int(getattr(h, "state_size", 0) or 0) for h in snapshot.materialized)
    if snapshot.changelog is not None:
        size += int(snapshot.changelog.state_size or 0)
    return size


# ------------------------------------------------------------------ null keys (dstl.spark.routing.subtask_of)

def _split_null_keys(rows, key: str):
    """(rows without a null key, how many had one)."""
    null = rows[key].isna().to_numpy() if len(rows) else None
    if null is None or not null.any():
        return rows, 0
    kept = rows[~null]
    if kept[key].dtype.kind == "f":  # an integer key column that held nulls
        kept = kept.astype({key: "int64"})
    return kept.reset_index(drop=True), int(null.sum())


def count_null_keys(fn: Callable, key: str) -> Callable:
    """`fn` behind the null-key rule's task side: rows with a null key (they all reach subtask 0)
    are dropped and counted as the task's ``null_rows`` metric; the driver raises or accepts."""
    def counted(rows, state):
        rows, nulls = _split_null_keys(rows, key)
        if nulls:
            task_metrics()["null_rows"] = nulls
        return call_fn(fn, rows, state)

    counted.processor = fn  # type: ignore[attr-defined]  # named in errors
    return counted


def refuse_null_keys(fn: Callable, key: str) -> Callable:
    """`fn` behind a task that fails with `NullKeyError` on a null key (no driver decides later)."""
    def refused(rows, state):
        _, nulls = _split_null_keys(rows, key)
        if nulls:
            raise NullKeyError(f"key column {key!r} has {nulls} null value(s) in subtask "
                               f"{current_subtask()}'s rows; keys must not be null")
        return fn(rows, state)

    return refused


# ------------------------------------------------------------------ the task

def _write_staged(plan: CheckpointPlan, subtask: int, token: str, out, arrow_schema,
                  fn: Any = None) -> Tuple[Optional[str], int]:
    if out is None or len(out) == 0:
        return None, 0
    if isinstance(out, (pa.RecordBatch, pa.Table)):  # the row API's output: already Arrow
        table = pa.Table.from_batches([out]) if isinstance(out, pa.RecordBatch) else out
        table = table.select(arrow_schema.names).cast(arrow_schema)
    elif not isinstance(out, pd.DataFrame):
        raise TypeError(f"fn must return a pandas DataFrame or None, got {type(out).__name__}")
    else:
        missing = [n for n in arrow_schema.names if n not in out.columns]
        if missing:
            # the processor's name, not the task function's that wraps it
            raise output_lacks_columns(getattr(fn, "processor", fn), missing, list(out.columns))
        table = pa.Table.from_pandas(out[arrow_schema.names], schema=arrow_schema, preserve_index=False)
    path = f"{plan.staging_dir()}/part-{subtask:05d}-{token}.parquet"
    fs, fs_path = filesystem(path)
    make_parent_dirs(fs, fs_path.rsplit("/", 1)[0])
    with fs.open(fs_path, "wb") as f:
        pq.write_table(table, f)
    return path, table.num_rows


def run_subtask(plan: CheckpointPlan, fn: Callable, rows, subtask: int, attempt: int, arrow_schema) -> Dict[str, Any]:
    """Continue or restore subtask `subtask`'s state, apply `fn`, stage the output, snapshot."""
    try:
        return _run_subtask(plan, fn, rows, subtask, attempt, arrow_schema)
    finally:
        # the state this process holds between tasks out of the collector's way (dstl.spark.heap)
        heap.after_task()


def _run_subtask(plan: CheckpointPlan, fn: Callable, rows, subtask: int, attempt: int, arrow_schema) -> Dict[str, Any]:
    if not plan.durable:
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
        source, completed_files = "memory", last_snapshot_files(key)
    # restored: really rebuilt from a checkpoint's changelog (a fresh job's first batch is not)
    restored = not from_memory and plan.restore_checkpoint_id is not None
    t1 = time.perf_counter()
    token = uuid.uuid4().hex
    try:
        if from_memory:
            # the checkpoint this backend snapshotted is now complete: hand its files to the checkpoint
            backend.confirm(plan.restore_checkpoint_id)
        prune_local_copies(storage, plan, key, completed_files)
        t_start = time.perf_counter()
        _fault_mid_batch(plan, fn, rows, backend, subtask)
        _TASK["subtask"], _TASK["metrics"] = subtask, {}
        uploads = figures.upload_mark(storage)
        try:
            out = fn(rows, backend) if len(rows) or plan.call_without_rows else None
        finally:
            _TASK["subtask"] = None
        t2 = time.perf_counter()
        staged, rows_out = _write_staged(plan, subtask, token, out, arrow_schema, fn)
        try:
            snapshot = backend.snapshot(plan.checkpoint_id).result()
        except Exception as exc:
            config = storage.config
            attempts = config.max_attempts if config.retry_policy == "fixed" else 1
            failed = store_failed(plan.base_path, subtask, attempts, time.perf_counter() - t2, exc)
            if failed is exc:
                raise
            raise failed from exc
        t3 = time.perf_counter()
        # the batch's progress record (dstl.spark.progress): rows held, what the batch uploaded
        _TASK["metrics"][figures.ROWS_TOTAL] = figures.state_rows(backend)
        _TASK["metrics"].update(figures.upload_delta(storage, uploads))
        payload = snapshot.to_bytes()
    except BaseException:
        # half-updated: never cached, never used again; its uploads are unreferenced garbage
        try:
            backend.close()
        except Exception:
            pass
        raise
    CACHE.put(key, backend, plan.checkpoint_id, token)
    remember_snapshot_files(storage, key, snapshot)
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
    if not slot_client.enabled():
        return dict(run_subtask(plan, fn, rows, subtask, attempt, arrow_schema), hop_ms=0.0)
    request = dict(plan=plan, fn=fn, rows=rows, subtask=subtask, attempt=attempt, arrow_schema=arrow_schema)
    payload = slot_client.dumps(request, by_value=True)
    return slot_client.call(slot_client.slot_name(plan.job_id, plan.operator_id, subtask), payload, executor_process(),
                      subtask, sent=lambda: faults.point("task.worker_wait", plan.batch, subtask=subtask))


def _quiet_expected_warnings() -> None:
    # After a confirm the checkpoint owns the files; the truncation that follows a confirmed
    # materialization then "releases" untracked files, which the registry logs as a warning per file.
    # In this integration that is the normal path, not a problem worth a line on the console.
    logging.getLogger("dstl.changelog.registry").setLevel(logging.ERROR)


_MEMORY: Dict[Tuple, Any] = {}


def _run_in_memory(plan: CheckpointPlan, fn: Callable, rows, subtask: int, attempt: int, arrow_schema):
    """Baseline: the same operator on dict state kept in this worker (lost whenever the worker changes)."""
    key = (plan.job_id, plan.operator_id, plan.parallelism, subtask)
    state = _MEMORY.setdefault(key, MemoryState())
    token = uuid.uuid4().hex
    t1 = time.perf_counter()
    out = fn(rows, state) if len(rows) else None
    t2 = time.perf_counter()
    staged, rows_out = _write_staged(plan, subtask, token, out, arrow_schema, fn)
    return dict(subtask=subtask, attempt=attempt, token=token, snapshot=b"", staged=staged,
                rows_in=len(rows), rows_out=rows_out, restored=False, restore_ms=0.0, start_ms=0.0,
                process_ms=(t2 - t1) * 1e3, snapshot_ms=0.0, state_size=0, pid=os.getpid(),
                host=socket.gethostname(), cache_hits=0, cache_misses=0, metrics="{}",
                continued=False, executor=executor_id(), restore_source="memory")


def _fault_mid_batch(plan: CheckpointPlan, fn: Callable, rows, backend, subtask: int) -> None:
    """The `task.mid_batch` fault point (dstl.spark.faults; the pipeline's --fail-at): when armed,
    half of the rows reach the state, then the task crashes."""
    def apply_half() -> None:
        half = rows.iloc[: len(rows) // 2]
        if len(half):
            fn(half, backend)

    faults.point("task.mid_batch", plan.batch, subtask=subtask, before=apply_half,
                 detail=f"crashed after applying {len(rows) // 2} of {len(rows)} rows; Spark retries the task")


def make_task(plan: CheckpointPlan, fn: Callable, arrow_schema, columns: Sequence[str],
               order_by: Optional[Sequence[str]]):
    """The mapInPandas function: partition i is subtask i (by the shuffle's salt, or by the anchor
    of dstl.spark.session.SubtaskStage, whose all-null row stands for a subtask without rows)."""
    def task(batches):  # pragma: no cover - runs in the Python worker (covered by the Spark tests)
        from pyspark import TaskContext  # PySpark: only in a Spark task

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


def arrow_output_schema(schema):
    """The output schema (DDL or StructType) as the Arrow schema tasks stage their output with."""
    from pyspark.sql.pandas.types import to_arrow_schema  # PySpark

    if isinstance(schema, str):
        schema = struct_from_ddl(schema)
    # TimestampType columns are instants (UTC in Arrow); PySpark 4.3 wants the zone named, and
    # PySpark 3.5's to_arrow_schema takes no zone (its timestamps are UTC already)
    try:
        return to_arrow_schema(schema, timezone="UTC")
    except TypeError:
        return to_arrow_schema(schema)
