"""StatefulStream: a Spark StatefulProcessor (or a vectorised function) on rescalable dstl state.

>>> stream = StatefulStream(base_path, processor, "user string, n long", key="user", parallelism=4)
>>> query = events.writeStream.foreachBatch(stream).option("checkpointLocation", ckpt).start()
>>> stream.run(static_df)        # the same for a batch DataFrame: one checkpoint per call

One micro-batch is one dstl checkpoint, which records Spark's batch id (checkpoint ids may run ahead
of batch ids: a bootstrapped first checkpoint, an offline rescale). Per batch, on the driver:

1. a replayed batch id (already in a completed checkpoint) changes no state: it only finishes that
   batch's output commit and calls the sink if it has not returned yet; a gap is an error;
2. the input gets its logical subtask column (null keys: an error, or dropped and counted), late
   rows are dropped and counted (EventTime), and the batch runs as ONE Spark stage of P concurrent
   tasks, task i = subtask i, each on the executor that ran it last batch (dstl.spark.session), so it
   continues its state from its Python worker's memory. The rows reach the tasks by a shuffle,
   executor to executor; only a small pandas batch the driver holds is broadcast
   (dstl.spark.routing);
3. the checkpoint metadata (watermark, state schemas, Spark's batch id) is written atomically,
   then the staged output is committed to ``<output>/batch_id=N/`` and the sink called once.
"""
from __future__ import annotations

import collections
import dataclasses
import datetime as dt
import logging
import os
import re
import time
from dataclasses import dataclass
from typing import Any, Callable, Deque, Dict, List, Optional

import numpy as np
import pandas as pd

from dstl.changelog.fs import filesystem, probe_base_path
from dstl.config import storage_config
from dstl.keygroups import UPPER_BOUND_MAX_PARALLELISM, compute_default_max_parallelism
from dstl.spark import faults, routing
from dstl.spark import progress as P
from dstl.spark.autoscale import AutoscalePolicy
from dstl.spark.batch import BatchResult, is_pandas, run_batch
from dstl.spark.coordinator import JOB_FILE, CheckpointCoordinator, CheckpointStats, JobConflictError, JobSpec
from dstl.spark.live_rescale import check_rescale, rescaled_from
from dstl.spark.keys import KEY_COL, check_key_types, normalize_keys, pack_columns
from dstl.spark.processor import (BatchContext, declared_schemas, is_stateful_processor, make_task_fn, normalize_api,
                                  normalize_time_mode)
from dstl.spark.routing import NullKeyError, subtask_of
from dstl.spark.session import SubtaskStage, application_of, ensure_importable_on_workers, struct_from_ddl
from dstl.spark.sink import OUTPUT_LAYOUT, mark_sink_done, prune_markers, read_batch_output, sink_done
from dstl.spark.task import arrow_output_schema
from dstl.spark.timer_rounds import ROUND_SOURCE, TimerRounds, active_query_ids, round_due, spark_position
from dstl.spark.watermark import DEFAULT_POLICY, POLICY_CONF, Watermarks, normalize_policy
from dstl.state.evolution import plan_state_evolution
from dstl.state.metadata import latest_checkpoint, list_checkpoints, read_checkpoint
from dstl.state.schema import parse_ddl

log = logging.getLogger(__name__)

OPERATOR_ID = "stateful-stream"
ET_COL = "_dstl_event_ms"
DEFAULT_MATERIALIZE_EVERY = 1_000_000

__all__ = ["StatefulStream", "StreamBatchResult", "StreamGapError", "NullKeyError"]


class StreamGapError(RuntimeError):
    """Spark delivered a batch id beyond the next one this job expects."""


@dataclass
class StreamBatchResult(BatchResult):
    """A BatchResult plus what the stream adds: Spark's batch id and the watermark bookkeeping."""

    batch_id: int = 0
    replayed: bool = False
    late_rows: int = 0
    null_rows: int = 0
    watermark_ms: int = 0
    batch_timestamp_ms: int = 0
    timers_fired: int = 0
    sink_called: bool = False
    #: states whose stored values this batch converted to a changed declared schema
    evolved_states: List[str] = dataclasses.field(default_factory=list)
    #: where the batch's time went on the driver: prepare (key column, counts, persist), tasks, commit
    phases_ms: Dict[str, float] = dataclasses.field(default_factory=dict)
    #: how the rows reached their subtasks: "shuffle" or "broadcast" (dstl.spark.routing)
    route: str = ""
    #: the number of subtasks this batch ran with
    parallelism: int = 0
    #: the parallelism before this batch when it moved state to a new one (rescale), else None
    rescaled_from: Optional[int] = None


_UNITS_MS = {"ms": 1, "millisecond": 1, "milliseconds": 1, "s": 1000, "sec": 1000, "second": 1000,
             "seconds": 1000, "m": 60_000, "min": 60_000, "minute": 60_000, "minutes": 60_000,
             "h": 3_600_000, "hour": 3_600_000, "hours": 3_600_000, "d": 86_400_000, "day": 86_400_000,
             "days": 86_400_000}


def parse_delay_ms(delay: Any) -> int:
    """A watermark delay in ms from an int (ms), a timedelta or a string like '10 seconds'."""
    if delay is None:
        return 0
    if isinstance(delay, dt.timedelta):
        return int(delay.total_seconds() * 1000)
    if isinstance(delay, bool):
        raise TypeError(f"watermark_delay must be ms, a timedelta or a string like '10 seconds', got {delay!r}")
    if isinstance(delay, int):
        if delay < 0:
            raise ValueError(f"watermark_delay must be >= 0, got {delay}")
        return delay
    if isinstance(delay, str):
        m = re.fullmatch(r"\s*(\d+)\s*([a-zA-Z]+)\s*", delay)
        if m and m.group(2).lower() in _UNITS_MS:
            return int(m.group(1)) * _UNITS_MS[m.group(2).lower()]
    raise ValueError(f"watermark_delay must be ms, a timedelta or a string like '10 seconds', got {delay!r}")


def _check_int(name: str, v: Any, lo: int, hi: Optional[int] = None) -> int:
    if isinstance(v, bool) or not hasattr(v, "__index__"):
        raise TypeError(f"{name} must be an int, got {type(v).__name__} {v!r}")
    v = int(v)
    if v < lo or (hi is not None and v > hi):
        raise ValueError(f"{name} must be in {lo}..{hi if hi is not None else ''}, got {v}")
    return v


class StatefulStream(P.ProgressHooks):
    """A keyed stateful operator for `foreachBatch` and batch DataFrames (see the module docstring).

    `processor`: a `StatefulProcessor` (instance, any object with its methods) or a vectorised
    `fn(rows: pd.DataFrame, state: KeyedStateBackend) -> pd.DataFrame`. `api`: the flavour the
    processor is written for, "pandas" (the default: transformWithStateInPandas, DataFrames in and
    out) or "row" (transformWithState: Rows in and out). `output_schema`: DDL or StructType of what
    it returns (a DDL string is parsed without a session, or at the first batch). Options beyond Spark's: `null_keys` ("error" or "drop"),
    `initial_state` (a DataFrame for `handleInitialState`, applied on the job's first batch),
    `clock` (ms; the batch timestamp, for tests), `retain` (checkpoints kept),
    `materialize_every` (changes logged per subtask before a compact snapshot), `resume_from` (roll
    the job back to this retained checkpoint before the first batch; see `open`), `timer_interval`
    (in a streaming query: run Spark's no-data batches as timer rounds on an idle stream, at most
    this often; dstl.spark.timer_rounds).

    `storage_options`: the base path file system's keyword arguments, as pandas and fsspec take them
    (`{"key": ..., "secret": ..., "client_kwargs": {"endpoint_url": ...}}`); they reach every process
    that opens it and are never written. `options`: dstl's storage options (`{"upload.mode": "thread"}`
    or `dstl.dfs.*` keys; docs/options.md).

    On resume, each state the processor declares is compared with the schema recorded in the
    checkpoint it continues from (dstl.state.evolution): added fields read as null, removed ones are
    dropped, int -> long and float -> double widen, and the first batch converts the stored values
    (log and materializations alike) and records the new schemas. A rename or narrowing raises
    `SchemaEvolutionError` from `open()`, before anything at the base path changes.
    """

    #: the operator id in the job file (bootstrap_state(..., operator_id=StatefulStream.operator_id))
    operator_id = OPERATOR_ID

    def __init__(self, base_path: str, processor: Any, output_schema: Any, *, key: Any, parallelism: Any,
                 max_parallelism: Optional[int] = None, time_mode: str = "None",
                 event_time_column: Any = None, watermark_delay: Any = None,
                 output_path: Optional[str] = None, sink: Optional[Callable[[Any, int], None]] = None,
                 storage_options: Optional[Dict[str, Any]] = None, options: Optional[Dict[str, Any]] = None,
                 null_keys: str = "error",
                 initial_state: Any = None, clock: Optional[Callable[[], int]] = None, retain: int = 2,
                 materialize_every: Optional[int] = DEFAULT_MATERIALIZE_EVERY,
                 resume_from: Optional[int] = None, api: str = "pandas",
                 watermark_policy: Optional[str] = None, timer_interval: Any = None, autoscale: Any = None):
        if not isinstance(base_path, str) or not base_path:
            raise ValueError(f"base_path must be a non-empty path or URL, got {base_path!r}")

        keys = normalize_keys(key)
        self.is_processor = is_stateful_processor(processor)
        if not self.is_processor and not callable(processor):
            raise TypeError("processor must be a StatefulProcessor or a function fn(rows, state)")
        self.api = normalize_api(api)
        if self.api == "row" and not self.is_processor:
            raise ValueError("api='row' is for a StatefulProcessor written for transformWithState; a "
                             "vectorised fn(rows, state) always gets a pandas DataFrame")
        self.autoscale = None
        if parallelism == "auto":
            if autoscale is None:
                raise ValueError('parallelism="auto" needs autoscale=(min, max) bounds')
            self.autoscale = AutoscalePolicy.of(autoscale, max_parallelism)
            parallelism = self.autoscale.min_parallelism
        elif autoscale is not None:
            raise ValueError(f'autoscale={autoscale!r} needs parallelism="auto", got parallelism={parallelism!r}')
        self.parallelism = _check_int("parallelism", parallelism, 1, UPPER_BOUND_MAX_PARALLELISM)
        self._ran_with: Optional[int] = None  # the parallelism of the last batch this object ran
        # validated once, here at the boundary; the stored value wins on resume
        self.max_parallelism = None if max_parallelism is None else _check_int(
            "max_parallelism", max_parallelism, 1, UPPER_BOUND_MAX_PARALLELISM)
        if self.max_parallelism is not None and self.parallelism > self.max_parallelism:
            raise ValueError(f"parallelism {self.parallelism} exceeds max_parallelism {self.max_parallelism}")
        self.time_mode = normalize_time_mode(time_mode)
        columns = [event_time_column] if isinstance(event_time_column, str) else list(event_time_column or [])
        if any(not isinstance(c, str) or not c for c in columns) or len(set(columns)) != len(columns):
            raise ValueError(f"event_time_column must be a column name or a list of distinct names, "
                             f"got {event_time_column!r}")
        if self.time_mode == "EventTime" and not columns:
            raise ValueError("time_mode='EventTime' needs event_time_column")
        if columns and self.time_mode != "EventTime":
            raise ValueError(f"event_time_column={event_time_column!r} needs time_mode='EventTime'")
        if watermark_delay is not None and self.time_mode != "EventTime":
            raise ValueError("watermark_delay needs time_mode='EventTime'")
        if isinstance(watermark_delay, (list, tuple)):
            if len(watermark_delay) != len(columns):
                raise ValueError(f"watermark_delay has {len(watermark_delay)} delays for "
                                 f"{len(columns)} event-time columns")
            delays = [parse_delay_ms(d) for d in watermark_delay]
        else:
            delays = [parse_delay_ms(watermark_delay)] * len(columns)
        #: {event-time column: its delay in ms}; the first column decides which rows are late
        self.watermark_delays_ms = dict(zip(columns, delays))
        self.watermark_delay_ms = delays[0] if delays else 0
        if watermark_policy is not None:
            watermark_policy = normalize_policy(watermark_policy)
        self.watermark_policy = watermark_policy
        if null_keys not in ("error", "drop"):
            raise ValueError(f"null_keys must be 'error' or 'drop', got {null_keys!r}")
        if sink is not None and not callable(sink):
            raise TypeError("sink must be a function sink(out_df, batch_id)")
        if retain < 1:
            raise ValueError(f"retain must be >= 1, got {retain}")
        self.resume_from = None if resume_from is None else _check_int("resume_from", resume_from, 1)
        self.base_path = _absolute(base_path).rstrip("/")  # tasks do not run in the driver's directory
        self.processor = processor
        self.output_schema = output_schema
        #: the key columns; with several, `key` is the packed column dstl.spark.keys adds per batch
        self.keys = keys
        self.key = keys[0] if len(keys) == 1 else KEY_COL
        self.event_time_column = columns[0] if columns else None
        self.event_time_columns = columns
        self.output_path = (_absolute(output_path) if output_path else f"{self.base_path}/output").rstrip("/")
        self.sink = sink

        # dstl's options and the file system's keyword arguments (in memory only; the repr hides them)
        self.storage_config = storage_config(self.base_path, options, storage_options)
        self.null_keys = null_keys
        self.initial_state = initial_state
        self.clock = clock or (lambda: int(time.time() * 1000))
        self.retain = retain
        self.backend_options = {"materialize_every_changes": materialize_every} if materialize_every else {}
        if timer_interval is not None and self.time_mode == "None":
            raise ValueError("timer_interval needs time_mode='ProcessingTime' or 'EventTime' (no timers otherwise)")
        interval_ms = parse_delay_ms(timer_interval) if timer_interval is not None else 0
        if timer_interval is not None and interval_ms <= 0:
            raise ValueError(f"timer_interval must be a positive interval, got {timer_interval!r}")
        #: seconds between timer rounds on an idle stream (dstl.spark.timer_rounds); 0: none
        self.timer_interval_s = interval_ms / 1000.0
        self._rounds: Optional[TimerRounds] = None
        self._output_struct = _parse_output_schema(output_schema)  # None: parsed at the first batch
        self._schemas = None
        #: {state: {"old": record, "new": record}} to convert in the next batch (a resume's first)
        self._evolutions: Dict[str, Dict[str, Any]] = {}
        self.coordinator = None
        self._stage = None
        #: the latest batches' results (a long-running query keeps only these)
        self.results: Deque[StreamBatchResult] = collections.deque(maxlen=100)
        #: the batches' progress records and their listeners (dstl.spark.progress)
        self.progress = P.ProgressLog()

    # ---------------------------------------------------------------- open or create
    def open(self):
        """Create the job at `base_path`, or resume the one there (a new parallelism rescales).

        With `resume_from=N`, the job first rolls back to its retained checkpoint N
        (dstl.spark.rollback): later checkpoints are abandoned, the committed output of their
        batches moves under `<output>/_rolled_back/<time>/` and their sink markers are dropped, so
        the job's next batch is N's Spark batch id + 1 and every later batch is processed (and
        delivered to the sink) anew, once. Batch ids up to N's are replays; a query must deliver
        the next one (docs/streaming.md, "Rolling back, bootstrapping, rescaling offline")."""
        if self.coordinator is not None:
            return self.coordinator

        probe_base_path(self.base_path)  # no credentials, no bucket: one message now, not after task retries
        fs, root = filesystem(self.base_path)
        exists = fs.exists(f"{root}/{JOB_FILE}")
        if self.resume_from is not None and not exists:
            raise JobConflictError(f"resume_from={self.resume_from}: there is no job to roll back at "
                                   f"{self.base_path} ({JOB_FILE} missing)")
        declared = None
        if self.is_processor:
            declared = {n: s.to_record() for n, s in declared_schemas(self.processor).items()}
            if exists:  # a forbidden schema change fails here, before a roll-back moves anything
                self._plan_evolution(_resume_point(self.base_path, self.resume_from), declared)
        maxp = self.max_parallelism
        if maxp is None and not exists:
            maxp = compute_default_max_parallelism(self.parallelism)
        params = {"kind": "StatefulStream", "key": self.keys[0] if len(self.keys) == 1 else self.keys,
                  "time_mode": self.time_mode,
                  "event_time_column": self.event_time_column}
        spec = JobSpec.new(OPERATOR_ID, maxp or 0, self.output_path, params)
        coord = CheckpointCoordinator.open(self.base_path, spec, self.storage_config, resume=exists,
                                           retain=self.retain, backend_options=self.backend_options,
                                           output_layout=OUTPUT_LAYOUT, resume_from=self.resume_from)
        if self.parallelism > coord.spec.max_parallelism:
            raise JobConflictError(f"parallelism {self.parallelism} exceeds the job's max parallelism "
                                   f"{coord.spec.max_parallelism} (fixed when the job at {self.base_path} "
                                   f"was created)")
        if declared is not None:
            self._schemas = self._plan_evolution(coord.latest, declared)
        self.coordinator = coord
        return coord

    def _plan_evolution(self, meta, declared: Dict[str, Any]) -> Dict[str, Any]:
        """Compare the declared state schemas with those recorded in `meta` (None: a new job); note
        the conversions for the next batch and return the schemas to record (recorded states the
        processor no longer declares keep their record: their values stay)."""
        recorded = dict((meta.properties.get("state_schemas") or {}) if meta is not None else {})
        self._evolutions = plan_state_evolution(recorded, declared)
        recorded.update(declared)
        return recorded

    @property
    def max_parallelism_in_use(self) -> int:
        return self.open().spec.max_parallelism

    def rescale(self, parallelism: int) -> None:
        """Run the next micro-batch with `parallelism` subtasks, in this query (docs/rescaling.md,
        "Live rescale"). Raises ValueError, changing nothing, outside 1..max parallelism."""
        self.parallelism = check_rescale(parallelism, self.open().spec.max_parallelism)

    # ---------------------------------------------------------------- entry points
    def __getstate__(self) -> Dict[str, Any]:
        # Spark Connect pickles the foreachBatch function to the server's foreachBatch worker: the
        # open job (storage, threads) and the session-bound stage are rebuilt there, never shipped
        state = dict(self.__dict__)
        state["coordinator"] = None
        if "_stage" in state:
            state["_stage"] = None
        state["_rounds"] = None
        return state

    def __call__(self, df, batch_id: int) -> "StreamBatchResult":
        """The `foreachBatch` function: process Spark's micro-batch `batch_id` exactly once."""
        return self.process(df, int(batch_id))

    def run(self, df) -> "StreamBatchResult":
        """Process a batch DataFrame (Spark or pandas) as the next micro-batch: one checkpoint."""
        return self.process(df, self.open().next_batch, source="run")

    def process(self, df, batch_id: int, source: str = "foreachBatch") -> "StreamBatchResult":
        rounds = self._timer_rounds(df) if source == "foreachBatch" else self._rounds
        if rounds is None:
            return self._process(df, batch_id, source)
        with rounds.lock:  # never at the same time as a timer round
            if rounds.error is not None:
                err, rounds.error = rounds.error, None
                raise RuntimeError(f"a timer round of the job at {self.base_path} failed: {err}") from err
            try:
                return self._process(df, batch_id, source)
            finally:
                rounds.batch_done()

    def _timer_rounds(self, df) -> Optional[TimerRounds]:
        """The timer-round thread of this stream in a streaming query (None: not asked for)."""
        if not self.timer_interval_s or is_pandas(df):
            return self._rounds
        spark = df.sparkSession
        if self._rounds is None:
            self._rounds = TimerRounds(self.timer_interval_s, lambda: self._run_round(spark),
                                       self._round_due, lambda: active_query_ids(spark))
        self._round_schema = df.schema
        self._rounds.watch(active_query_ids(spark))
        return self._rounds

    def _round_due(self) -> bool:
        latest = self.open().latest
        return round_due(self.time_mode, latest.properties if latest is not None else None)

    def _run_round(self, spark) -> "StreamBatchResult":
        """One timer round: an empty input as dstl's next batch (dstl.spark.timer_rounds)."""
        empty = spark.createDataFrame([], self._round_schema)
        return self._run_batch(empty, self.open().next_batch, ROUND_SOURCE)

    def _process(self, df, batch_id: int, source: str) -> "StreamBatchResult":
        coord = self.open()
        spark_done, spark_batch = spark_position(coord.latest.properties if coord.latest is not None else None)
        expected = spark_done + 1
        if source == "run":
            batch_id = expected
        if batch_id < expected:
            if coord.latest.properties.get("source") == "run":
                # not a replay: Spark's ids would silently skip this batch's rows
                raise StreamGapError(
                    f"batch {batch_id} arrived from a streaming query, but the job at {self.base_path} "
                    f"already holds batches up to {expected - 1} from run(); a query's batch ids must "
                    f"continue the job's (start it with a fresh checkpoint location only after "
                    f"{expected} batches, or give the job its own base path)")
            return self._replay(batch_id, df, spark_batch if batch_id == spark_done else None)
        if batch_id > expected:
            done = "no batch yet" if expected == 0 else f"batches up to {expected - 1}"
            if coord.rolled_back is not None:
                raise StreamGapError(
                    f"batch {batch_id} arrived, but the job at {self.base_path} was rolled back to checkpoint "
                    f"{coord.rolled_back.checkpoint_id} and has completed {done}: the query must deliver batch "
                    f"{expected} next (stop it and rewind its checkpoint location with "
                    f"dstl.spark.rewind_query_checkpoint(location, {expected - 1}), or feed the redone "
                    f"batches with run())")
            raise StreamGapError(
                f"batch {batch_id} arrived, but the job at {self.base_path} has completed {done}: batch "
                f"ids must follow each other (was the Spark checkpoint location replaced, or another "
                f"query's used?)")
        if coord.latest is not None and spark_batch < coord.next_batch - 1:
            # timer rounds after the last Spark batch whose sink a driver crash cut short
            self._deliver_committed(self._session_of(df), range(spark_batch + 1, coord.next_batch), -1)
        return self._run_batch(df, coord.next_batch, source, spark_id=batch_id)

    def close(self) -> None:
        """After the last batch (query stopped): stop the timer rounds, delete changelog files no
        checkpoint needs, and release the placement anchor."""
        if self._rounds is not None:
            self._rounds.stop()
        if self._stage is not None:
            self._stage.close()
            self._stage = None
        if self.coordinator is not None:
            self.coordinator.finish()

    def _stage_for(self, spark, parallelism: int):
        """The stage of `parallelism` tasks that keeps subtask i on its executor: kept across the
        session objects of one application (the placement carries over), a new one for another
        application or another parallelism."""
        if self._stage is not None and self._stage.spark is not spark:
            if application_of(self._stage.spark) == application_of(spark):
                self._stage.rebind(spark)
            else:
                self._stage.close()
                self._stage = None
        if self._stage is not None and self._stage.parallelism != parallelism:
            self._stage.close()  # rescaled: a new anchor places the new number of subtasks
            self._stage = None
        if self._stage is None:
            self._stage = SubtaskStage(spark, parallelism)
        return self._stage

    # ---------------------------------------------------------------- one batch
    def _session_of(self, df):
        """The batch's SparkSession (a pandas batch: the active one)."""
        if not is_pandas(df):
            return df.sparkSession
        from pyspark.sql import SparkSession  # PySpark

        spark = SparkSession.getActiveSession()
        if spark is None:
            raise RuntimeError("a pandas batch needs an active SparkSession")
        return spark

    def _run_batch(self, df, batch_id: int, source: str = "foreachBatch",
                   spark_id: Optional[int] = None) -> "StreamBatchResult":
        """dstl batch `batch_id`: Spark's batch `spark_id`, or a timer round (`spark_id` None)."""
        coord = self.coordinator
        at = "timers" if spark_id is None else "stream"  # the fault points' prefix
        # read once: rescale() from another thread during this batch takes effect at the next one
        parallelism = self.parallelism
        if spark_id is None:
            last_spark, last_batch = spark_position(coord.latest.properties if coord.latest is not None else None)
        else:
            last_spark, last_batch = spark_id, batch_id
        # a small pandas batch is broadcast, everything else shuffled; looked up on the module, where
        # bench/scale_route.py replaces it to force the broadcast route
        route = routing.choose_route(df)
        spark = self._session_of(df)
        for col in self.keys + self.event_time_columns:
            if col not in df.columns:
                what = "key column" if col in self.keys else "event_time_column"
                raise ValueError(f"{what} {col!r} is not in batch {batch_id} (columns: {', '.join(df.columns)})")
        if len(self.keys) > 1:  # the packed key is computed in the executors, whatever the batch
            df = spark.createDataFrame(df) if is_pandas(df) else df
            df = df.withColumn(self.key, _packed_key_column(df, self.keys))
        batch_ts = int(self.clock())
        latest = coord.latest
        marks = self._watermarks(spark, latest)
        maxp = coord.spec.max_parallelism
        et_cols = [f"{ET_COL}_{i}" for i in range(len(self.event_time_columns))]

        def with_event_ms(keyed):
            for name, col in zip(et_cols, self.event_time_columns):
                keyed = keyed.withColumn(name, _event_ms(keyed, col))
            return keyed

        def task_fn(keyed, _fn):
            out_schema = self._output_struct_type()
            ctx = BatchContext(batch_ts, marks.eviction_ms, self.time_mode, api=self.api,
                               late_watermark_ms=marks.late_ms,
                               key_columns=self.keys if len(self.keys) > 1 else None)
            ctx = self._row_context(ctx, spark, keyed, out_schema)  # the pandas flavour needs the time zone too
            initial = self._initial_by_subtask(maxp, parallelism) if latest is None else None
            return make_task_fn(self.processor, self.key, ctx, initial, event_cols=et_cols,
                                evolutions=self._evolutions)

        counted: Dict[str, Any] = {}

        def properties(reports):
            late = sum(r.metric("late_rows") for r in reports)
            maxima: Dict[str, Optional[int]] = {}
            for i, col in enumerate(self.event_time_columns):
                seen = [r.metric("max_event_ms", {}).get(str(i)) for r in reports]
                seen = [m for m in seen if m is not None]
                maxima[col] = max(seen) if seen else None
            after = marks.advance(maxima, self.watermark_delays_ms)
            fired = sum(r.metric("timers_fired") for r in reports)
            counted.update(late=late, watermark_ms=after.eviction_ms, fired=fired)
            return {"spark_batch_id": spark_id, "source": source, "batch_timestamp_ms": batch_ts,
                    "last_spark_batch_id": last_spark, "last_spark_batch": last_batch,
                    "late_rows": late, "null_rows_dropped": sum(r.metric("null_rows") for r in reports),
                    "time_mode": self.time_mode, "state_schemas": self._schemas or {},
                    "timers_fired": fired, "progress": P.checkpoint_figures(reports), **after.properties(marks)}

        run = run_batch(coord, df, self.processor, self._output_struct_type(), key=self.key,
                        parallelism=parallelism, stage_for=lambda s: self._stage_for(s, parallelism),
                        spark=spark, batch_id=batch_id,
                        null_keys=self.null_keys, route=route, extend=with_event_ms, make_fn=task_fn,
                        plan_changes={"call_without_rows": self.is_processor},
                        before_tasks=lambda: faults.point(f"{at}.before_tasks", batch_id),
                        after_tasks=lambda: faults.point(f"{at}.after_tasks", batch_id),
                        properties=properties,
                        after_metadata=lambda: faults.point(f"{at}.after_checkpoint", batch_id))
        evolved = sorted(self._evolutions)
        self._evolutions = {}  # the checkpoint holds the new layout and records the new schemas
        sink_called = self._deliver(spark, batch_id, run.plan.checkpoint_id, at)
        t_end = time.perf_counter()
        faults.point(f"{at}.after_sink", batch_id)
        res = StreamBatchResult(
            **run.result_fields(rows_dropped=counted["late"]),  # rows_in: what the processor was given
            batch_id=batch_id, late_rows=counted["late"], null_rows=run.null_rows,
            watermark_ms=counted["watermark_ms"], batch_timestamp_ms=batch_ts, timers_fired=counted["fired"],
            sink_called=sink_called, evolved_states=evolved, route=run.route,
            phases_ms={"prepare": (run.prepared - run.started) * 1e3, "tasks": (run.tasks_done - run.prepared) * 1e3,
                       "commit": (t_end - run.tasks_done) * 1e3})
        res.seconds = time.perf_counter() - run.started
        res.parallelism = run.plan.parallelism
        res.rescaled_from = rescaled_from(latest, run.plan.parallelism)
        self.results.append(res)
        self.progress.publish(P.batch_progress(res, res.parallelism, **P.query_ids(spark)))
        if self.autoscale is not None:
            nxt = self.autoscale.observe(res.parallelism, res.seconds, res.rescaled_from is not None)
            if nxt != self.parallelism:
                log.info("autoscale: batch %d took %.2fs at parallelism %d; the next batch runs at %d",
                         batch_id, res.seconds, res.parallelism, nxt)
                self.rescale(nxt)
        return res

    def _watermarks(self, spark, latest):
        """This batch's watermarks (dstl.spark.watermark), from the checkpoint it continues from."""
        policy = self.watermark_policy
        if policy is None:
            policy = normalize_policy(spark.conf.get(POLICY_CONF, DEFAULT_POLICY) or DEFAULT_POLICY)
        props = latest.properties if latest is not None else None
        marks = Watermarks.from_properties(props, self.event_time_columns, policy)
        if self.watermark_policy is not None and marks.policy != self.watermark_policy:
            log.warning("watermark_policy=%r ignored: the job at %s runs with the policy %r recorded in "
                        "its checkpoints (as Spark keeps a query's)", self.watermark_policy,
                        self.base_path, marks.policy)
        return marks

    def _output_struct_type(self):
        """The output schema as a StructType (a DDL string only Spark parses: parsed now, once)."""
        if self._output_struct is None:
            self._output_struct = _parse_output_schema(self.output_schema, spark_only=True)
        return self._output_struct

    def _row_context(self, ctx, spark, sdf, out_schema):
        """The session time zone, the output's Arrow schema and the pandas flavour's DataFrame size;
        the row API's input value types."""
        init_schema = getattr(self.initial_state, "schema", None)
        return dataclasses.replace(
            ctx, input_schema=sdf.schema, time_zone=spark.conf.get("spark.sql.session.timeZone", None),
            max_records_per_batch=int(spark.conf.get("spark.sql.execution.arrow.maxRecordsPerBatch", "10000")),
            initial_schema=init_schema if hasattr(init_schema, "fields") else None,
            output_arrow_schema=arrow_output_schema(out_schema))

    def _deliver(self, spark, batch_id: int, checkpoint_id: int, at: str = "stream") -> bool:
        """Call the sink for a committed batch unless it already returned; True if called."""
        if sink_done(self.base_path, batch_id):
            return False
        called = False
        if self.sink is not None:
            out = read_batch_output(spark, self.coordinator.batch_output_dir(batch_id), self._output_struct_type())
            self.sink(out, batch_id)
            called = True
        faults.point(f"{at}.mid_sink", batch_id)
        mark_sink_done(self.base_path, batch_id, checkpoint_id)
        prune_markers(self.base_path, batch_id - 10)
        return called

    def _replay(self, batch_id: int, df, own: Optional[int] = None) -> "StreamBatchResult":
        """A batch id already in a completed checkpoint: no state change; finish output and sink
        of its dstl batch `own` and the timer rounds after it (None: only an older checkpoint had it)."""
        coord = self.coordinator
        latest = coord.latest
        spark = self._session_of(df) if df is not None else None
        called = False
        last = int(latest.properties["batch"])
        spark_done, _ = spark_position(latest.properties)
        if own is not None:
            todo = range(own, last + 1)
        else:  # an older batch: its folder has Spark's id only while no timer round has run
            todo = [batch_id] if spark_done == last else []
        if spark is not None:
            called = self._deliver_committed(spark, todo, own)
        log.info("batch %d is already in checkpoint %s: replay changes no state", batch_id,
                 latest.checkpoint_id)
        stats = CheckpointStats(latest.checkpoint_id, batch_id, 0.0, 0.0, 0.0, 0, 0, 0, 0)
        res = StreamBatchResult(batch=batch_id, checkpoint_id=latest.checkpoint_id, rows_in=0, rows_out=0,
                                seconds=0.0, checkpoint_ms=0.0, restored=0, restore_ms=0.0, reports=[],
                                stats=stats, batch_id=batch_id, replayed=True,
                                watermark_ms=int(latest.properties.get("watermark_ms", 0)),
                                sink_called=called)
        self.results.append(res)
        return res

    def _deliver_committed(self, spark, batches, own: Optional[int] = None) -> bool:
        """Finish the sink calls of committed dstl `batches` (`own`: the Spark batch among them; the
        others are timer rounds). True if the sink was called."""
        coord = self.coordinator
        called = False
        for b in batches:
            fs, path = filesystem(coord.batch_output_dir(b))
            if fs.exists(f"{path}/_SUCCESS"):
                at = "timers" if own is not None and b != own else "stream"
                called = self._deliver(spark, b, coord.latest.checkpoint_id, at) or called
        return called

    def _initial_by_subtask(self, maxp: int, parallelism: int):
        """The initial state rows per subtask (collected to the driver once, on the first batch)."""
        if self.initial_state is None:
            return None
        if not self.is_processor:
            raise ValueError("initial_state needs a StatefulProcessor (handleInitialState)")

        pdf = self.initial_state
        if not type(pdf).__module__.startswith("pandas"):
            pdf = pdf.toPandas()
        for col in self.keys:
            if col not in pdf.columns:
                raise ValueError(f"initial_state lacks the key column {col!r} (columns: {', '.join(pdf.columns)})")
        if len(self.keys) > 1:
            pdf = pdf.copy()
            pdf[self.key] = pack_columns([pdf[k] for k in self.keys])
        nulls = int(pdf[self.key].isna().sum())
        if nulls:
            if self.null_keys == "error":
                raise NullKeyError(f"key column {self.key!r} has {nulls} null value(s) in initial_state; "
                                   f"pass null_keys='drop' to drop them")
            pdf = pdf[pdf[self.key].notna()]
        subs = subtask_of(pdf[self.key], maxp, parallelism)
        return {i: pdf[subs == i].reset_index(drop=True) for i in np.unique(subs).tolist()}


def _resume_point(base_path: str, resume_from: Optional[int]):
    """The checkpoint a resume continues from (None if unreadable: the coordinator reports why)."""
    try:
        if resume_from is not None:
            return read_checkpoint(base_path, resume_from) if resume_from in list_checkpoints(base_path) else None
        return latest_checkpoint(base_path)
    except Exception:  # noqa: BLE001 - CheckpointCoordinator.open raises the precise error
        return None


def _absolute(path: str) -> str:
    """A relative local path (no scheme) made absolute against the driver's working directory."""
    return path if "://" in path or os.path.isabs(path) else os.path.abspath(path)


def _parse_output_schema(schema: Any, spark_only: bool = False):
    """The output schema as a StructType, checked by converting it to Arrow. A DDL string is parsed
    without a session (dstl.state.schema.parse_ddl); one that needs Spark's parser (comments,
    NOT NULL, ...) is parsed by Spark when a session is active, else None: at the first batch."""
    from pyspark.sql.types import StructType  # PySpark

    try:
        if isinstance(schema, str) and not spark_only:
            try:
                struct = parse_ddl(schema)
            except ValueError:
                from pyspark.sql import SparkSession  # PySpark

                if SparkSession.getActiveSession() is None:
                    return None
                struct = struct_from_ddl(schema)
        else:
            struct = struct_from_ddl(schema) if isinstance(schema, str) else schema
        if not isinstance(struct, StructType):
            raise TypeError(f"a {type(struct).__name__}, not a struct of columns")
        arrow_output_schema(struct)
        return struct
    except Exception as exc:
        # Spark's parse errors begin with a line break: the reason goes on the first line
        raise ValueError(f"output_schema {schema!r} is not a valid DDL string or StructType: "
                         f"{str(exc).strip() or type(exc).__name__}") from exc


def _packed_key_column(df, keys: List[str]):
    """The stored key of several key columns (dstl.spark.keys), as a vectorised pandas UDF."""
    from pyspark.sql import functions as F  # PySpark

    check_key_types(df.schema, keys)
    ensure_importable_on_workers(df.sparkSession)

    @F.pandas_udf("binary")
    def packed(*cols):  # pragma: no cover - runs in the Python worker
        return pd.Series(pack_columns(cols), index=cols[0].index, dtype=object)

    return packed(*[F.col(k) for k in keys])


def _event_ms(df, column: str):
    """The event time as epoch milliseconds: a timestamp column, or a number already in ms."""
    from pyspark.sql import functions as F  # PySpark
    from pyspark.sql import types as T  # PySpark

    dtype = df.schema[column].dataType
    if isinstance(dtype, (T.TimestampType, T.TimestampNTZType)):
        return F.unix_millis(F.col(column).cast("timestamp"))
    if isinstance(dtype, (T.IntegerType, T.LongType, T.ShortType, T.ByteType)):
        return F.col(column).cast("long")
    raise TypeError(f"event_time_column {column!r} must be a timestamp or an integer of epoch ms, "
                    f"not {dtype.simpleString()}")
