"""One micro-batch, the one way `StatefulJob` and `StatefulStream` both run it:

plan -> route -> one stage of P tasks -> the reports collected exactly once -> the checkpoint
completed (dstl.spark.coordinator) -> the result.

The batch is a Spark DataFrame or a pandas DataFrame the driver holds. Each row's subtask comes
from `dstl.spark.routing.subtask_of`: computed on the driver for a pandas batch, in the executors (a
pandas UDF, dstl.spark.keyed.subtask_column) for a Spark one. `choose_route` broadcasts a small
pandas batch and shuffles everything else; the stage (dstl.spark.session.SubtaskStage) keeps subtask
i on its executor batch after batch. A null key rides with subtask 0, whose task counts it (the
``null_rows`` metric); with ``null_keys="error"`` the batch then fails with `NullKeyError` before
anything is committed, with ``"drop"`` the rows are dropped and counted.

What is a front door's own stays there: the stream's watermarks, replay and gap checks, sink and
schema evolutions; the job's `order_by` and events schema. They come in as the arguments and
callbacks of `run_batch`.
"""
from __future__ import annotations

import dataclasses
import time
from dataclasses import dataclass
from typing import Any, Callable, Dict, List, Optional, Sequence

import numpy as np

from dstl.spark.coordinator import CheckpointCoordinator, CheckpointStats
from dstl.spark.keyed import check_order_by, subtask_column
from dstl.spark.plan import CheckpointPlan
from dstl.spark.report import REPORT_SCHEMA, TaskReport
from dstl.spark.routing import SEQ_COL, SUBTASK_COL, NullKeyError, choose_route, subtask_of
from dstl.spark.session import SubtaskStage, collect, ensure_importable_on_workers, struct_from_ddl
from dstl.spark.task import arrow_output_schema, make_task

NULL_KEYS = ("error", "drop")


@dataclass
class BatchResult:
    """What one micro-batch did (the pipeline's progress line and report are built from these)."""

    batch: int
    checkpoint_id: int
    rows_in: int
    rows_out: int
    seconds: float
    #: the checkpoint's duration: slowest task's pre-commit (output staged, state snapshot uploaded)
    #: + the metadata write
    checkpoint_ms: float
    restored: int
    restore_ms: float
    reports: List[TaskReport]
    stats: CheckpointStats

    @property
    def cache_hits(self) -> int:
        return sum(1 for r in self.reports if r.continued)


@dataclass
class BatchRun:
    """One batch as `run_batch` ran it: what a front door builds its result from."""

    plan: CheckpointPlan
    reports: List[TaskReport]
    stats: CheckpointStats
    #: "shuffle" or "broadcast" (dstl.spark.routing)
    route: str
    #: rows with a null key (dropped; with null_keys="error" the batch raised instead)
    null_rows: int
    #: perf_counter() at the start, after preparing the batch, after the tasks
    started: float
    prepared: float
    tasks_done: float

    def result_fields(self, rows_dropped: int = 0) -> Dict[str, Any]:
        """The `BatchResult` fields (`rows_dropped`: rows the processor never saw besides null keys)."""
        reports = self.reports
        restored = [r for r in reports if r.restored]
        return dict(batch=self.plan.batch, checkpoint_id=self.plan.checkpoint_id,
                    rows_in=sum(r.rows_in for r in reports) - self.null_rows - rows_dropped,
                    rows_out=sum(r.rows_out for r in reports), seconds=time.perf_counter() - self.started,
                    checkpoint_ms=max(r.snapshot_ms for r in reports) + self.stats.metadata_ms,
                    restored=len(restored), restore_ms=max((r.restore_ms for r in restored), default=0.0),
                    reports=reports, stats=self.stats)


def is_pandas(batch: Any) -> bool:
    return type(batch).__module__.startswith("pandas")


def keyed_frame(spark, batch, key: str, max_parallelism: int, parallelism: int, events_schema: Any = None):
    """The batch as a Spark DataFrame with its rows' subtask (`SUBTASK_COL`) and arrival order
    (`SEQ_COL`). A pandas batch is keyed on the driver (`events_schema`: its Spark schema, a DDL
    string or StructType; None: Spark infers it); a Spark one in the executors."""
    from pyspark.sql import functions as F  # PySpark

    if key not in batch.columns:
        raise ValueError(f"key column {key!r} not in the batch (columns: {', '.join(batch.columns)})")
    if not is_pandas(batch):
        return (batch.withColumn(SUBTASK_COL, subtask_column(batch, key, max_parallelism, parallelism))
                .withColumn(SEQ_COL, F.monotonically_increasing_id()))
    ensure_importable_on_workers(spark)
    keyed = batch.assign(**{SUBTASK_COL: subtask_of(batch[key], max_parallelism, parallelism),
                            SEQ_COL: np.arange(len(batch), dtype="int64")})
    if events_schema is None:
        return spark.createDataFrame(keyed)
    from pyspark.sql.types import IntegerType, LongType, StructField, StructType  # PySpark

    if isinstance(events_schema, str):
        events_schema = struct_from_ddl(events_schema)
    full = StructType(list(events_schema.fields) + [StructField(SUBTASK_COL, IntegerType(), False),
                                                    StructField(SEQ_COL, LongType(), False)])
    return spark.createDataFrame(keyed, schema=full)


def run_batch(coordinator: CheckpointCoordinator, batch, fn: Callable, schema: Any, *, key: str,
              parallelism: int, stage_for: Callable[[Any], SubtaskStage], spark=None,
              batch_id: Optional[int] = None, null_keys: str = "error", route: Optional[str] = None,
              order_by: Optional[Sequence[str]] = None, events_schema: Any = None,
              plan_changes: Optional[Dict[str, Any]] = None,
              extend: Optional[Callable[[Any], Any]] = None,
              make_fn: Optional[Callable[[Any, Callable], Callable]] = None,
              before_tasks: Optional[Callable[[], None]] = None,
              after_tasks: Optional[Callable[[], None]] = None,
              properties: Optional[Callable[[List[TaskReport]], Dict[str, Any]]] = None,
              after_metadata: Optional[Callable[[], None]] = None) -> BatchRun:
    """Run `batch` as the coordinator's next checkpoint (see the module docstring).

    `spark`: the session (a pandas batch needs one; a Spark batch brings its own). `batch_id`: the
    checkpoint's batch (None: the coordinator's next). `route`: None chooses by the batch
    (dstl.spark.routing.choose_route). `extend(sdf)`: columns the front door adds to the keyed batch;
    `make_fn(sdf, fn)`: the task function, once the keyed batch's schema is known (default `fn`).
    `properties(reports)`: what the checkpoint records beside them. Raises `NullKeyError` (no
    checkpoint; the tasks' work is abandoned) on a null key under ``null_keys="error"``."""
    if null_keys not in NULL_KEYS:
        raise ValueError(f"null_keys must be 'error' or 'drop', got {null_keys!r}")
    started = time.perf_counter()
    route = choose_route(batch, route)  # a small pandas batch is broadcast; everything else is shuffled
    if is_pandas(batch) and spark is None:
        raise ValueError("a pandas micro-batch needs a SparkSession")
    spark = spark if spark is not None else batch.sparkSession
    check_order_by(batch, order_by)
    maxp = coordinator.spec.max_parallelism
    sdf = keyed_frame(spark, batch, key, maxp, parallelism, events_schema)
    if extend is not None:
        sdf = extend(sdf)
    stage = stage_for(spark)
    task_fn = make_fn(sdf, fn) if make_fn is not None else fn
    plan = coordinator.plan(coordinator.next_batch if batch_id is None else batch_id, parallelism)
    if plan_changes:
        plan = dataclasses.replace(plan, **plan_changes)
    prepared = time.perf_counter()
    if before_tasks is not None:
        before_tasks()
    # the stage evaluates `sdf` once (the shuffle's map side, or the broadcast): nothing to persist
    task = make_task(plan, task_fn, arrow_output_schema(schema), list(sdf.columns), order_by)
    reports_df = stage.run(sdf, SUBTASK_COL, task, REPORT_SCHEMA, route=route)
    # collected exactly once: a second evaluation would run the tasks again
    rows = collect(spark, reports_df, f"dstl {coordinator.spec.operator_id} batch {plan.batch}")
    reports = [TaskReport.from_row(r) for r in rows]
    if after_tasks is not None:
        after_tasks()
    tasks_done = time.perf_counter()
    nulls = sum(r.metric("null_rows") for r in reports)
    if nulls and null_keys == "error":
        raise NullKeyError(f"key column {key!r} has {nulls} null value(s) in batch {plan.batch} "
                           f"(of {sum(r.rows_in for r in reports)} rows); pass null_keys='drop' "
                           f"to drop and count them")
    props = properties(reports) if properties is not None else None
    stats = coordinator.complete(plan, reports, properties=props, after_metadata=after_metadata)
    return BatchRun(plan, reports, stats, route, nulls, started, prepared, tasks_done)
