"""StatefulJob: a keyed function on dstl state over micro-batches, one checkpoint per `run_batch`
(the batch loop of dstl.spark.batch, shared with StatefulStream)."""
from __future__ import annotations

from typing import Any, Callable, Dict, Optional, Sequence

from dstl.spark import progress as P
from dstl.spark.batch import BatchResult, is_pandas, run_batch
from dstl.spark.coordinator import CheckpointCoordinator
from dstl.spark.live_rescale import check_rescale
from dstl.spark.session import SubtaskStage
from dstl.spark.task import count_null_keys

__all__ = ["StatefulJob", "BatchResult"]


class StatefulJob(P.ProgressHooks):
    """A keyed stateful operator over micro-batches with exactly-once output.

    >>> job = StatefulJob(coordinator, fn, "user_id long, n long", key="user_id", parallelism=2)
    >>> job.run_batch(events_df)          # one checkpoint; output committed when it returns

    `run_batch` takes a Spark DataFrame (keyed with a pandas UDF, shuffled executor to executor) or
    a pandas DataFrame held by the driver (keyed on the driver; broadcast when small, else shuffled;
    needs `spark=`). Either way the batch runs as one stage of P tasks that stay on their executors
    batch after batch, which keeps the worker caches warm. `fn` gets each subtask's rows sorted by
    `order_by` (stable: ties keep their arrival order). A null key fails the batch with
    `NullKeyError` before anything is committed; `null_keys="drop"` drops and counts such rows.
    `close()` releases the placement anchor.
    """

    def __init__(self, coordinator: CheckpointCoordinator, fn: Callable, schema: Any, *, key: str,
                 parallelism: int, order_by: Optional[Sequence[str]] = None, spark=None,
                 events_schema: Any = None, null_keys: str = "error"):
        if null_keys not in ("error", "drop"):
            raise ValueError(f"null_keys must be 'error' or 'drop', got {null_keys!r}")
        self.coordinator = coordinator
        self.fn = fn
        self.schema = schema
        self.key = key
        self.parallelism = parallelism
        self.order_by = list(order_by) if order_by else None
        self.spark = spark
        self.events_schema = events_schema
        self.null_keys = null_keys
        self._stage = None
        #: the batches' progress records and their listeners (dstl.spark.progress)
        self.progress = P.ProgressLog()

    def close(self) -> None:
        """Release the cached anchor that keeps the subtasks on their executors."""
        if self._stage is not None:
            self._stage.close()
            self._stage = None

    def rescale(self, parallelism: int) -> None:
        """Run the next batch with `parallelism` subtasks: key groups move to their new subtasks,
        restored from this host's local copies where it can. ValueError, changing nothing, outside
        1..the job's max parallelism."""
        self.parallelism = check_rescale(parallelism, self.coordinator.spec.max_parallelism)

    def _stage_for(self, spark) -> SubtaskStage:
        if self._stage is not None and self._stage.parallelism != self.parallelism:
            self._stage.close()  # rescaled: a new anchor places the new number of subtasks
            self._stage = None
        if self._stage is None:
            self._stage = SubtaskStage(spark, self.parallelism)
        return self._stage

    def run_batch(self, df, *, properties: Optional[Dict[str, Any]] = None,
                  after_metadata: Optional[Callable[[], None]] = None) -> BatchResult:
        """Run `df` (Spark or pandas) as the next micro-batch: one checkpoint, output committed."""
        if is_pandas(df) and self.spark is None:
            raise ValueError("a pandas micro-batch needs StatefulJob(spark=...)")
        run = run_batch(self.coordinator, df, count_null_keys(self.fn, self.key), self.schema, key=self.key,
                        parallelism=self.parallelism, stage_for=self._stage_for, spark=self.spark,
                        null_keys=self.null_keys, order_by=self.order_by, events_schema=self.events_schema,
                        properties=lambda reports: {**(properties or {}), "progress": P.checkpoint_figures(reports)},
                        after_metadata=after_metadata)
        res = BatchResult(**run.result_fields())
        self.progress.publish(P.batch_progress(res, self.parallelism))
        return res
