"""Run a PySpark `StatefulProcessor` on a dstl `KeyedStateBackend`.

`ProcessorHandle` offers what `pyspark.sql.streaming.stateful_processor.StatefulProcessorHandle`
offers (`getValueState`, `getListState`, `getMapState`, timers, `deleteIfExists`), backed by the
subtask's keyed state: every state is scoped to the *implicit* grouping key, which the runner sets
before each call, exactly as Spark does. Values are tuples of the declared schema
(dstl.state.schema); with `ttlDurationMs` the state is a TTL state (dstl.state.ttl) whose clock is
the micro-batch's timestamp. A state call goes straight to the backend (no batching, no pandas).

A processor comes in one of two flavours, the same class either way (`BatchContext.api`):

* ``"pandas"`` (transformWithStateInPandas): per key, ``handleInputRows`` gets an iterator of
  pandas DataFrames of at most spark.sql.execution.arrow.maxRecordsPerBatch rows and yields DataFrames; ``handleInitialState`` gets a DataFrame per key;
* ``"row"`` (PySpark 4.1+'s transformWithState): per key, an iterator of `pyspark.sql.Row`, and it
  yields Rows; ``handleInitialState`` is called once per initial-state Row. No pandas object is
  built per key: the subtask's Rows are built column-wise and the output Rows become one Arrow
  batch (dstl.spark.rows).

`run_processor` is one subtask's micro-batch, in Spark's order (TransformWithStateInPandas):

1. ``init(handle)``;
2. on the job's first batch only, ``handleInitialState(key, ..., timerValues)`` per key (pandas) or
   per initial-state Row (row);
3. ``handleInputRows(key, rows, timerValues)`` per key with input, keys in sorted order, rows
   in arrival order; key is a tuple, as Spark passes it;
4. ``handleExpiredTimer(key, timerValues, ExpiredTimerInfo(ts))`` for every timer with
   ``ts <= batch timestamp`` (ProcessingTime) or ``ts <= watermark`` (EventTime), earliest first;
   the timer is deleted after its call;
5. ``close()``.

Everything the handlers yield is the batch's output: one pandas DataFrame (pandas) or one
`pyarrow.RecordBatch` (row).

The parts, one concern each: dstl.spark.processor_context (the flavour, the time mode,
`BatchContext`), dstl.spark.processor_adapters (Spark's state handles on dstl states, one per state
kind), dstl.spark.processor_handle (`ProcessorHandle`, `declared_schemas`) and
dstl.spark.processor_runner (`run_processor`, `make_task_fn`). This module re-exports their names.
"""
from __future__ import annotations

from dstl.spark.processor_adapters import (ADAPTERS, ListStateAdapter, MapStateAdapter,  # noqa: F401
                                           ValueStateAdapter, adapter_for)
from dstl.spark.processor_context import (APIS, DEFAULT_API, RESERVED_PREFIX, TIME_MODES,  # noqa: F401
                                          BatchContext, is_stateful_processor, normalize_api,
                                          normalize_time_mode)
from dstl.spark.processor_handle import ProcessorHandle, declared_schemas  # noqa: F401
from dstl.spark.processor_runner import (concat_frames, evolve_states, make_task_fn, run_processor,  # noqa: F401
                                         session_timestamps)

__all__ = ["ADAPTERS", "APIS", "DEFAULT_API", "RESERVED_PREFIX", "TIME_MODES", "BatchContext",
           "ListStateAdapter", "MapStateAdapter", "ProcessorHandle", "ValueStateAdapter", "adapter_for",
           "concat_frames", "declared_schemas", "evolve_states", "is_stateful_processor", "make_task_fn",
           "normalize_api", "normalize_time_mode", "run_processor", "session_timestamps"]
