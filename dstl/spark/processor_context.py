"""What a processor run is told: its flavour (`api`), its time mode, and the micro-batch
(`BatchContext`: timestamps, initial state, the Spark schemas). See dstl.spark.processor."""
from __future__ import annotations

from dataclasses import dataclass, field
from typing import Any, Dict, List, Optional

TIME_MODES = {"none": "None", "processingtime": "ProcessingTime", "eventtime": "EventTime"}

#: state names starting with this are dstl's own (timers)
RESERVED_PREFIX = "_dstl"

#: the processor flavours: transformWithStateInPandas (DataFrames) and transformWithState (Rows)
APIS = ("pandas", "row")
DEFAULT_API = "pandas"


def normalize_api(api: Any) -> str:
    """'pandas' or 'row' (the flavour a StatefulProcessor is written for)."""
    if api is None:
        return DEFAULT_API
    mode = str(api).strip().lower() if isinstance(api, str) else None
    if mode not in APIS:
        raise ValueError(f"api must be 'row' (a processor written for transformWithState: Rows in, "
                         f"Rows out) or 'pandas' (for transformWithStateInPandas), got {api!r}")
    return mode


def normalize_time_mode(time_mode: Any) -> str:
    """'None' / 'ProcessingTime' / 'EventTime' from any capitalisation (Spark accepts them so)."""
    if time_mode is None:
        return "None"
    mode = TIME_MODES.get(str(time_mode).replace("_", "").lower())
    if mode is None:
        raise ValueError(f"time_mode must be one of None, ProcessingTime, EventTime; got {time_mode!r}")
    return mode


def is_stateful_processor(obj: Any) -> bool:
    """An object with the methods of Spark's StatefulProcessor (its class or a duck-typed one)."""
    return callable(getattr(obj, "init", None)) and callable(getattr(obj, "handleInputRows", None))


@dataclass
class BatchContext:
    """What one micro-batch's handlers see: its timestamps and (first batch only) initial state."""

    batch_timestamp_ms: int
    watermark_ms: int
    time_mode: str = "None"
    #: per-key initial state rows, applied on the job's first batch (pandas DataFrame or None)
    initial_state: Any = None
    metrics: Dict[str, int] = field(default_factory=dict)
    #: "pandas" or "row" (see the module docstring)
    api: str = DEFAULT_API
    #: the session time zone (timestamps) and the output's Arrow schema; row API only: the Spark
    #: StructTypes of the input rows and of the initial state (value types)
    input_schema: Any = None
    initial_schema: Any = None
    time_zone: Optional[str] = None
    output_arrow_schema: Any = None
    #: EventTime: rows with event time <= this are late (Spark's late-events watermark, the previous
    #: batch's eviction watermark; `watermark_ms` is this batch's, for timers and TimerValues)
    late_watermark_ms: int = 0
    #: several key columns (dstl.spark.keys): the key column holds packed keys, dropped from the
    #: rows, and the processor gets the unpacked tuple; None: one key column, key tuple (k,)
    key_columns: Optional[List[str]] = None
    #: pandas flavour: a key's rows come in DataFrames of at most this many rows, as Spark's
    #: spark.sql.execution.arrow.maxRecordsPerBatch cuts them (0 or less: one DataFrame)
    max_records_per_batch: int = 10_000

    def timer_values(self):
        from pyspark.sql.streaming.stateful_processor import TimerValues  # PySpark: only on its workers

        if self.time_mode == "None":
            return TimerValues(-1, -1)
        wm = self.watermark_ms if self.time_mode == "EventTime" else -1
        return TimerValues(self.batch_timestamp_ms, wm)
