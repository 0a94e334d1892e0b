"""StatefulJob: `stateful_map_in_pandas` + `CheckpointCoordinator`, one call per micro-batch."""
from __future__ import annotations

import time
from dataclasses import dataclass
from typing import Any, Callable, Dict, List, Optional, Sequence

from dstl.spark.coordinator import CheckpointCoordinator, CheckpointStats
from dstl.spark.keyed import (TaskReport, stateful_map_in_pandas_local, stateful_map_in_pandas_staged,
                              with_subtask)


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


def _is_pandas(df) -> bool:
    return type(df).__module__.startswith("pandas")


class StatefulJob:
    """A keyed stateful operator over micro-batches with exactly-once output.

    >>> job = StatefulJob(coordinator, fn, "user_id long, n long", key="user_id", parallelism=2)
    >>> job.run_batch(events_df)          # one checkpoint; output committed when it returns

    `run_batch` takes a Spark DataFrame (keyed with a pandas UDF, shuffled executor to executor) or
    a pandas DataFrame held by the driver (keyed on the driver; broadcast when small, else shuffled;
    needs `spark=`). Either way the batch runs as one stage of P tasks that stay on their executors
    batch after batch, which keeps the worker caches warm. `close()` releases the placement anchor.
    """

    def __init__(self, coordinator: CheckpointCoordinator, fn: Callable, schema: Any, *, key: str,
                 parallelism: int, order_by: Optional[Sequence[str]] = None, spark=None,
                 events_schema: Any = None):
        self.coordinator = coordinator
        self.fn = fn
        self.schema = schema
        self.key = key
        self.parallelism = parallelism
        self.order_by = list(order_by) if order_by else None
        self.spark = spark
        self.events_schema = events_schema
        self._stage = None

    def close(self) -> None:
        """Release the cached anchor that keeps the subtasks on their executors."""
        if self._stage is not None:
            self._stage.close()
            self._stage = None

    def _stage_for(self, spark):
        from dstl.spark.session import SubtaskStage

        if self._stage is None:
            self._stage = SubtaskStage(spark, self.parallelism)
        return self._stage

    def run_batch(self, df, *, properties: Optional[Dict[str, Any]] = None,
                  after_metadata: Optional[Callable[[], None]] = None) -> BatchResult:
        coord = self.coordinator
        batch = coord.next_batch
        plan = coord.plan(batch, self.parallelism)
        t0 = time.perf_counter()
        if _is_pandas(df) and self.spark is None:
            raise ValueError("a pandas micro-batch needs StatefulJob(spark=...)")
        spark = self.spark if self.spark is not None else df.sparkSession
        stage = self._stage_for(spark)
        if _is_pandas(df):  # driver-held batch: keyed on the driver
            reports_df = stateful_map_in_pandas_local(
                spark, df, self.fn, self.schema, key=self.key, checkpoint=plan, order_by=self.order_by,
                events_schema=self.events_schema, stage=stage)
        else:  # keyed by a pandas UDF on the executors, shuffled straight to the placed tasks
            if self.key not in df.columns:
                raise ValueError(f"key column {self.key!r} not in the DataFrame (columns: {', '.join(df.columns)})")
            keyed = with_subtask(df, self.key, plan.max_parallelism, plan.parallelism)
            reports_df = stateful_map_in_pandas_staged(keyed, self.fn, self.schema, checkpoint=plan,
                                                       order_by=self.order_by, stage=stage)
        # collected exactly once: a second evaluation would run the tasks again
        from dstl.spark.session import collect

        rows = collect(spark, reports_df, f"dstl {coord.spec.operator_id} batch {batch}")
        reports = [TaskReport.from_row(r) for r in rows]
        stats = coord.complete(plan, reports, properties=properties, after_metadata=after_metadata)
        seconds = time.perf_counter() - t0
        restored = [r for r in reports if r.restored]
        return BatchResult(
            batch=batch, checkpoint_id=plan.checkpoint_id, rows_in=sum(r.rows_in for r in reports),
            rows_out=sum(r.rows_out for r in reports), seconds=seconds,
            checkpoint_ms=max(r.snapshot_ms for r in reports) + stats.metadata_ms,
            restored=len(restored), restore_ms=max((r.restore_ms for r in restored), default=0.0),
            reports=reports, stats=stats)
