"""PySpark integration: keyed, durable, rescalable state for Python code in `mapInPandas`.

* `with_key_group` / `with_subtask`: vectorised key-group and logical-subtask columns;
  `subtask_of`: the one function that gives a key its subtask (a null key: subtask 0).
* `stateful_map_in_pandas`: runs `fn(rows, state)` once per logical subtask and micro-batch, the
  subtask's `KeyedStateBackend` restored from the changelog or continued from the worker's cache.
* `CheckpointCoordinator`: the driver side; one micro-batch = one checkpoint, metadata written
  atomically before the batch's output is committed.
* `StatefulJob`: the two together (what the `dstl pipeline` command uses).
* `StatefulStream`: Spark's `StatefulProcessor` (pandas or, with `api="row"`, Row-based) or a
  vectorised function on dstl state, for `foreachBatch` and batch DataFrames, classic or Spark
  Connect: exactly-once, TTL, timers, rescalable (docs/streaming.md).

PySpark, pandas and pyarrow are imported lazily, so `import dstl.spark` is cheap.
"""
from __future__ import annotations

from typing import Dict

from dstl._lazy import lazy_getattr

_EXPORTS: Dict[str, str] = {
    "with_key_group": "dstl.spark.keyed", "with_subtask": "dstl.spark.keyed",
    "stateful_map_in_pandas": "dstl.spark.keyed", "CheckpointPlan": "dstl.spark.plan",
    "TaskReport": "dstl.spark.report", "partition_salts": "dstl.spark.routing",
    "subtask_of": "dstl.spark.routing", "current_subtask": "dstl.spark.task", "task_metrics": "dstl.spark.task",
    "StateCache": "dstl.spark.cache",
    "CheckpointCoordinator": "dstl.spark.coordinator", "JobSpec": "dstl.spark.coordinator",
    "JobConflictError": "dstl.spark.coordinator",
    "StatefulJob": "dstl.spark.job", "BatchResult": "dstl.spark.batch",
    "StatefulStream": "dstl.spark.stream", "StreamBatchResult": "dstl.spark.stream",
    "StreamGapError": "dstl.spark.stream", "NullKeyError": "dstl.spark.routing",
    "ProcessorHandle": "dstl.spark.processor",
    "read_state": "dstl.spark.state_reader", "read_changes": "dstl.spark.state_reader",
    "bootstrap_state": "dstl.spark.bootstrap", "read_timers": "dstl.spark.state_reader",
    "rewind_query_checkpoint": "dstl.spark.query_checkpoint",
    "SlotMemoryError": "dstl.spark.memory_limit",
    "progress_of": "dstl.spark.progress", "ProcessorError": "dstl.spark.errors",
    "OutputSchemaError": "dstl.spark.errors", "SlotError": "dstl.spark.errors",
    "AutoscalePolicy": "dstl.spark.autoscale",
}
__all__ = sorted(_EXPORTS)

__getattr__ = lazy_getattr("dstl.spark", _EXPORTS, globals())
