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
"""
from __future__ import annotations

import time
from dataclasses import dataclass, field
from typing import Any, Callable, Dict, Iterator, List, Optional, Tuple

from dstl.state.schema import StateSchema
from dstl.state.value import plain_list as _plain_list

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
        from pyspark.sql.streaming.stateful_processor import TimerValues

        if self.time_mode == "None":
            return TimerValues(-1, -1)
        wm = self.watermark_ms if self.time_mode == "EventTime" else -1
        return TimerValues(self.batch_timestamp_ms, wm)


def _plain_types(value_schema) -> Optional[Tuple[type, ...]]:
    """The exact Python type of each field when every field is a plain long/int/double/string/bool
    (stored as itself), else None: then a tuple of exactly those types encodes and decodes as a plain
    copy, which is most per-key state and skips the per-field codecs."""
    from pyspark.sql import types as T

    plain = ((T.ByteType, int), (T.ShortType, int), (T.IntegerType, int), (T.LongType, int),
             (T.DoubleType, float), (T.FloatType, float), (T.StringType, str), (T.BooleanType, bool))
    out = []
    for f in value_schema.struct.fields:
        t = next((py for spark_t, py in plain if isinstance(f.dataType, spark_t)), None)
        if t is None:
            return None
        out.append(t)
    return tuple(out)


class _StateAdapter:
    def __init__(self, handle: "ProcessorHandle", state: Any, spec: StateSchema):
        self._h = handle
        self._s = state
        self._spec = spec
        self._v = spec.value
        self._plain = _plain_types(spec.value)

    def _enc(self, value: Any) -> Any:
        """The value schema's encode, with the plain-tuple fast path (same result)."""
        enc = None if self._plain is None else _plain_list(value, self._plain)
        return self._v.encode(value) if enc is None else enc

    def _dec(self, stored: Any) -> Tuple:
        if self._plain is not None and len(stored) == len(self._plain):
            return tuple(stored)  # plain fields are stored as themselves (None included)
        return self._v.decode(stored)

    def _key(self) -> Any:
        k = self._h._key
        if k is None:
            raise RuntimeError(f"state {self._spec.name!r} is used outside handleInputRows, "
                               f"handleExpiredTimer or handleInitialState (no grouping key is set)")
        return k

    def __repr__(self) -> str:
        return f"{type(self).__name__}({self._spec!r})"


class ValueStateAdapter(_StateAdapter):
    """Spark's ValueState: exists / get / update / clear for the grouping key."""

    kind = "value"

    # exists, get and update are called once or more per key: the key check and the plain-tuple codec
    # are inlined (one Python frame per call instead of three); the state's get/update are the keyed
    # kernel's bound C methods (tests/test_state_fastpath.py)
    def exists(self) -> bool:
        k = self._h._key
        return self._s.get(self._key() if k is None else k) is not None

    def get(self) -> Optional[Tuple]:
        k = self._h._key
        w = self._s.get(self._key() if k is None else k)
        if w is None:
            return None
        p = self._plain
        return tuple(w) if p is not None and len(w) == len(p) else self._v.decode(w)

    def update(self, newValue: Tuple) -> None:
        k = self._h._key
        if k is None:
            k = self._key()  # raises: no grouping key is set
        p = self._plain
        enc = None if p is None else _plain_list(newValue, p)
        self._s.update(k, self._v.encode(newValue) if enc is None else enc)

    def clear(self) -> None:
        self._s.clear(self._key())


class ListStateAdapter(_StateAdapter):
    """Spark's ListState: exists / get / put / appendValue / appendList / clear."""

    kind = "list"

    def exists(self) -> bool:
        return bool(self._s.get(self._key()))

    def get(self) -> Iterator[Tuple]:
        dec = self._v.decode
        return iter([dec(w) for w in self._s.get(self._key())])

    def put(self, newState: List[Tuple]) -> None:
        enc = self._v.encode
        self._s.update(self._key(), [enc(v) for v in newState])

    def appendValue(self, newState: Tuple) -> None:
        self._s.add(self._key(), self._v.encode(newState))

    def appendList(self, newState: List[Tuple]) -> None:
        enc = self._v.encode
        self._s.add_all(self._key(), [enc(v) for v in newState])

    def clear(self) -> None:
        self._s.clear(self._key())


class MapStateAdapter(_StateAdapter):
    """Spark's MapState: exists / getValue / containsKey / updateValue / iterator / keys / values /
    removeKey / clear."""

    kind = "map"

    def __init__(self, handle, state, spec):
        super().__init__(handle, state, spec)
        self._k = spec.user_key

    def exists(self) -> bool:
        return not self._s.is_empty(self._key())

    def getValue(self, key: Tuple) -> Optional[Tuple]:
        w = self._s.get(self._key(), self._k.encode_key(key))
        return None if w is None else self._v.decode(w)

    def containsKey(self, key: Tuple) -> bool:
        return self._s.contains(self._key(), self._k.encode_key(key))

    def updateValue(self, key: Tuple, value: Tuple) -> None:
        self._s.put(self._key(), self._k.encode_key(key), self._v.encode(value))

    def iterator(self) -> Iterator[Tuple[Tuple, Tuple]]:
        kd, vd = self._k.decode_key, self._v.decode
        return iter([(kd(uk), vd(w)) for uk, w in self._s.items(self._key())])

    def keys(self) -> Iterator[Tuple]:
        kd = self._k.decode_key
        return iter([kd(uk) for uk in self._s.keys(self._key())])

    def values(self) -> Iterator[Tuple]:
        vd = self._v.decode
        return iter([vd(w) for w in self._s.values(self._key())])

    def removeKey(self, key: Tuple) -> None:
        uk = self._k.encode_key(key)
        if self._s.contains(self._key(), uk):
            self._s.remove(self._key(), uk)

    def clear(self) -> None:
        self._s.clear(self._key())


# After `deleteIfExists(name)` Spark's state server has no column family `name`: every call on a
# handle of it fails with a PySparkRuntimeError whose text starts as the state client's does.
_MISSING = ("[STATE_STORE_UNSUPPORTED_OPERATION_ON_MISSING_COLUMN_FAMILY] State store operation={op} "
            "not supported on missing column family={name}.")
_DROPPED_MESSAGES = {
    "value": {"exists": "Error checking value state exists", "get": "Error getting value state",
              "update": "Error updating value state", "clear": "Error clearing value state"},
    "list": {"exists": "Error checking value state exists", "get": "Error getting list state",
             "put": "Error updating value state", "appendValue": "Error updating value state",
             "appendList": "Error updating value state", "clear": "Error clearing value state"},
    "map": {"exists": "Error checking map state exists", "getValue": "Error getting value",
            "containsKey": "Error checking if map state contains key",
            "updateValue": "Error updating map state value", "iterator": "Error getting map state iterator",
            "keys": "Error getting map state keys", "values": "Error getting map state values",
            "removeKey": "Error removing key from map state", "clear": "Error clearing map state"},
}


def _dropped_class(live: type, kind: str) -> type:
    """`live`'s methods, each raising as Spark does on a deleted state."""
    def failing(method: str, text: str):
        def call(self, *args, **kwargs):
            from pyspark.errors import PySparkRuntimeError

            raise PySparkRuntimeError(f"{text}: " + _MISSING.format(op=method, name=self._spec.name))
        call.__name__ = method
        return call

    attrs = {m: failing(m, t) for m, t in _DROPPED_MESSAGES[kind].items()}
    attrs["__doc__"] = f"A {live.__name__} whose state was deleted (deleteIfExists): every call raises."
    return type(f"Dropped{live.__name__}", (live,), attrs)


class ProcessorHandle:
    """Spark's StatefulProcessorHandle on a dstl backend (or, without one, a recorder of declared
    states: what the driver runs `init` with to learn the state schemas, as Spark's PRE_INIT does)."""

    def __init__(self, backend: Any = None, ctx: Optional[BatchContext] = None):
        self._b = backend
        self._ctx = ctx or BatchContext(0, 0)
        self._key: Any = None
        self.schemas: Dict[str, StateSchema] = {}
        self._timers = None
        #: the handles given out per state name (deleteIfExists turns them into failing ones)
        self._handed: Dict[str, List[_StateAdapter]] = {}
        self._defined: set = set()

    # ---------------------------------------------------------------- states
    def _declare(self, spec: StateSchema) -> StateSchema:
        if not isinstance(spec.name, str) or not spec.name:
            raise ValueError(f"a state name must be a non-empty str, got {spec.name!r}")
        if spec.name.startswith(RESERVED_PREFIX):
            raise ValueError(f"state names starting with {RESERVED_PREFIX!r} are reserved for dstl: {spec.name!r}")
        if spec.name in self._defined:
            from pyspark.errors import PySparkRuntimeError

            # Spark refuses a second definition in one init, even after deleteIfExists
            raise PySparkRuntimeError(
                f"Error initializing {spec.kind} state: [STATEFUL_PROCESSOR_DUPLICATE_STATE_VARIABLE_DEFINED] "
                f"State variable with name {spec.name} has already been defined in the StatefulProcessor.")
        self._defined.add(spec.name)
        self.schemas[spec.name] = spec
        return spec

    def _raw(self, spec: StateSchema):
        from dstl.state import ttl as T

        b = self._b
        if b is None:
            return None
        options = {T.TTL_OPTION: True} if spec.ttl_ms is not None else {}
        existing = b._states.get(spec.name)
        if existing is not None and bool(existing.meta.options.get(T.TTL_OPTION)) != bool(options):
            have = "with" if existing.meta.options.get(T.TTL_OPTION) else "without"
            raise ValueError(f"state {spec.name!r} was created {have} a TTL; its TTL cannot be "
                             f"{'removed' if have == 'with' else 'added'} (use another state name)")
        if existing is not None and existing.kind != spec.kind:
            raise ValueError(f"state {spec.name!r} holds {existing.kind} state, not {spec.kind} state")
        raw = b._register(spec.name, spec.kind, None, options)
        if spec.ttl_ms is None:
            return raw
        clock = self._batch_clock
        cls = {"value": T.TtlValueState, "list": T.TtlListState, "map": T.TtlMapState}[spec.kind]
        return cls(raw, spec.ttl_ms, clock)

    def _batch_clock(self) -> int:
        return self._ctx.batch_timestamp_ms

    def _hand_out(self, cls: type, spec: StateSchema):
        adapter = cls(self, self._raw(spec), spec)
        self._handed.setdefault(spec.name, []).append(adapter)
        return adapter

    def getValueState(self, stateName: str, schema: Any, ttlDurationMs: Optional[int] = None) -> ValueStateAdapter:
        spec = self._declare(StateSchema(stateName, "value", schema, ttl_ms=ttlDurationMs))
        return self._hand_out(ValueStateAdapter, spec)

    def getListState(self, stateName: str, schema: Any, ttlDurationMs: Optional[int] = None) -> ListStateAdapter:
        spec = self._declare(StateSchema(stateName, "list", schema, ttl_ms=ttlDurationMs))
        return self._hand_out(ListStateAdapter, spec)

    def getMapState(self, stateName: str, userKeySchema: Any, valueSchema: Any,
                    ttlDurationMs: Optional[int] = None) -> MapStateAdapter:
        spec = self._declare(StateSchema(stateName, "map", valueSchema, userKeySchema, ttlDurationMs))
        return self._hand_out(MapStateAdapter, spec)

    def deleteIfExists(self, stateName: str) -> None:
        """Remove the state and every value of it (every key of this subtask: the whole state).
        As in Spark, a handle of it raises `PySparkRuntimeError` on any call afterwards, and the
        name cannot be defined again in the same `init`."""
        b = self._b
        self.schemas.pop(stateName, None)
        for adapter in self._handed.get(stateName, []):
            adapter.__class__ = adapter._dropped
        if b is None or stateName not in b._states:
            return
        raw = b._states[stateName]
        for key in raw.keys_with_state():
            raw.clear(key)

    # ---------------------------------------------------------------- timers
    def _timer_service(self):
        if self._ctx.time_mode == "None":
            raise RuntimeError("timers need time_mode='ProcessingTime' or 'EventTime' (this stream has "
                               "time_mode='None')")
        if self._b is None:
            raise RuntimeError("timers can only be used while handling rows or timers")
        if self._timers is None:
            from dstl.state.timers import TimerService

            self._timers = TimerService(self._b)
        return self._timers

    def _timer_key(self) -> Any:
        if self._key is None:
            raise RuntimeError("timers are per grouping key: use them in handleInputRows, "
                               "handleExpiredTimer or handleInitialState")
        return self._key

    def registerTimer(self, expiryTimestampMs: int) -> None:
        self._timer_service().register(self._timer_key(), expiryTimestampMs)

    def deleteTimer(self, expiryTimestampMs: int) -> None:
        self._timer_service().delete(self._timer_key(), expiryTimestampMs)

    def listTimers(self) -> Iterator[int]:
        return iter(self._timer_service().list(self._timer_key()))


for _cls in (ValueStateAdapter, ListStateAdapter, MapStateAdapter):
    _cls._dropped = _dropped_class(_cls, _cls.kind)


def declared_schemas(processor: Any) -> Dict[str, StateSchema]:
    """The states `processor.init` declares (run on the driver with a recording handle)."""
    handle = ProcessorHandle(None)
    processor.init(handle)
    try:
        processor.close()
    except Exception:  # a close() that expects a fully initialised processor: harmless here
        pass
    return handle.schemas


def _frames(result: Any, where: str) -> Iterator[Any]:
    import pandas as pd

    if result is None:
        return
    if isinstance(result, pd.DataFrame):
        yield result
        return
    for item in result:
        if item is None:
            continue
        if not isinstance(item, pd.DataFrame):
            hint = ""
            if isinstance(item, tuple) and hasattr(item, "asDict"):
                hint = (" (this StatefulStream runs the pandas API; a processor written for "
                        "transformWithState, which yields Rows, needs api='row')")
            raise TypeError(f"{where} must yield pandas DataFrames, got {type(item).__name__}{hint}")
        yield item


def _groups(rows, key_col: str):
    """(key, rows of that key) per distinct key, keys sorted, each frame with a fresh RangeIndex."""
    import numpy as np
    import pandas as pd

    if not len(rows):
        return
    keys = rows[key_col].to_numpy()
    order = np.argsort(keys, kind="stable")
    skeys = keys[order]
    ordered = rows.take(order)
    if len(skeys) > 1:
        cuts = np.flatnonzero(skeys[1:] != skeys[:-1]) + 1
    else:
        cuts = np.empty(0, dtype=np.int64)
    starts = [0] + cuts.tolist()
    ends = cuts.tolist() + [len(skeys)]
    uniq = skeys[starts].tolist()
    for k, s, e in zip(uniq, starts, ends):
        part = ordered.iloc[s:e]
        part.index = pd.RangeIndex(e - s)
        yield k, part


def _chunks(part, cap: int):
    """A key's rows as Spark's pandas flavour hands them over: DataFrames of at most `cap` rows
    (spark.sql.execution.arrow.maxRecordsPerBatch), each with a fresh RangeIndex."""
    import pandas as pd

    n = len(part)
    if cap <= 0 or n <= cap:
        return iter([part])
    out = []
    for s in range(0, n, cap):
        chunk = part.iloc[s:s + cap]
        chunk.index = pd.RangeIndex(len(chunk))
        out.append(chunk)
    return iter(out)


class _PandasOut:
    """What the handlers yield, pandas flavour: DataFrames, concatenated at the end."""

    def __init__(self):
        self.frames: List[Any] = []

    def extend(self, result: Any, where: str) -> None:
        self.frames.extend(_frames(result, where))

    def result(self):
        return concat_frames(self.frames) if self.frames else None


def run_processor(processor: Any, rows, backend, ctx: BatchContext, key_col: str):
    """One subtask's micro-batch through a StatefulProcessor (see the module docstring).

    The cyclic garbage collector is paused for the call: a batch allocates a few objects per row and
    per key (Rows, tuples, generators, frames), which are freed by reference counting, and the
    collector's passes over them every 700 allocations cost about a third of building the Rows.
    Cycles the handlers create are collected once the call returns."""
    import gc

    paused = gc.isenabled()
    gc.disable()
    try:
        return _run_processor(processor, rows, backend, ctx, key_col)
    finally:
        if paused:
            gc.enable()


def _run_processor(processor: Any, rows, backend, ctx: BatchContext, key_col: str):
    from pyspark.sql.streaming.stateful_processor import ExpiredTimerInfo

    handle = ProcessorHandle(backend, ctx)
    backend.ttl_clock = handle._batch_clock  # TTL purges at materialization use the batch time too
    processor.init(handle)
    tv = ctx.timer_values()
    row_api = ctx.api == "row"
    if row_api:
        from dstl.spark.rows import InputRows, OutputRows

        out: Any = OutputRows(ctx.output_arrow_schema)
    else:
        out = _PandasOut()
    composite = ctx.key_columns is not None
    if composite:
        from dstl.spark.keys import unpack_key as key_of
    try:
        init_rows = ctx.initial_state
        if init_rows is not None and len(init_rows):
            if row_api:  # Spark's Row mode: one call per initial-state Row
                init = InputRows(init_rows, key_col, ctx.initial_schema, ctx.time_zone, drop_key=composite)
                for k, part in init.groups():
                    handle._key = k
                    for row in part:
                        processor.handleInitialState(key_of(k) if composite else (k,), row, tv)
            else:
                for k, part in _groups(init_rows, key_col):
                    handle._key = k
                    if composite:
                        processor.handleInitialState(key_of(k), part.drop(columns=[key_col]), tv)
                    else:
                        processor.handleInitialState((k,), part, tv)
        t_in = time.perf_counter()
        handle_rows, extend = processor.handleInputRows, out.extend
        if row_api:
            groups = InputRows(rows, key_col, ctx.input_schema, ctx.time_zone, drop_key=composite).groups()
            t_rows = time.perf_counter()
            for k, part in groups:
                handle._key = k
                extend(handle_rows(key_of(k) if composite else (k,), iter(part), tv), "handleInputRows")
        elif composite:
            t_rows = t_in
            cap = ctx.max_records_per_batch
            for k, part in _groups(rows, key_col):
                handle._key = k
                extend(handle_rows(key_of(k), _chunks(part.drop(columns=[key_col]), cap), tv), "handleInputRows")
        else:
            t_rows = t_in
            cap = ctx.max_records_per_batch
            for k, part in _groups(rows, key_col):
                handle._key = k
                extend(handle_rows((k,), _chunks(part, cap), tv), "handleInputRows")
        fired = 0
        threshold = {"ProcessingTime": ctx.batch_timestamp_ms, "EventTime": ctx.watermark_ms}.get(ctx.time_mode)
        if threshold is not None:
            timers = handle._timer_service()
            for ts, k in timers.due(threshold):
                if ts not in timers.state.keys(k):  # deleted by an earlier handler of this batch
                    continue
                handle._key = k
                extend(processor.handleExpiredTimer(key_of(k) if composite else (k,), tv, ExpiredTimerInfo(ts)),
                       "handleExpiredTimer")
                timers.delete(k, ts)
                fired += 1
        ctx.metrics["timers_fired"] = ctx.metrics.get("timers_fired", 0) + fired
    finally:
        handle._key = None
        processor.close()
    if not row_api:
        return session_timestamps(out.result(), ctx)
    t_handled = time.perf_counter()
    batch = out.to_batch()
    # where a Row API call's time goes (the task report's metrics; bench/streaming_report.py)
    m = ctx.metrics
    m["rows_in_us"] = int((t_rows - t_in) * 1e6)
    m["handlers_us"] = int((t_handled - t_rows) * 1e6)
    m["rows_out_us"] = int((time.perf_counter() - t_handled) * 1e6)
    return batch


def session_timestamps(pdf, ctx: BatchContext):
    """The pandas flavour's output as Spark takes it: a naive datetime64 value of a TimestampType
    column is a local time of the session time zone (spark.sql.session.timeZone), an aware one is
    its instant; both become UTC instants, which is what the output's Arrow schema holds.
    TimestampNTZType columns (Arrow timestamps without a zone) stay as they are."""
    if pdf is None or ctx.output_arrow_schema is None or not ctx.time_zone:
        return pdf
    import pandas as pd
    import pyarrow as pa

    out = pdf
    for field in ctx.output_arrow_schema:
        if not (pa.types.is_timestamp(field.type) and field.type.tz) or field.name not in pdf.columns:
            continue
        col = pdf[field.name]
        if isinstance(col.dtype, pd.DatetimeTZDtype):
            col = col.dt.tz_convert("UTC")
        elif pd.api.types.is_datetime64_dtype(col.dtype):
            col = col.dt.tz_localize(ctx.time_zone, ambiguous=False).dt.tz_convert("UTC")
        else:
            continue
        if out is pdf:  # the processor's own DataFrame stays as it yielded it
            out = pdf.copy(deep=False)
        out[field.name] = col
    return out


def concat_frames(frames: List[Any]):
    """One DataFrame from many small ones (typically one per key): column arrays concatenated with
    numpy, several times faster than `pd.concat` on tens of thousands of one-row frames; `pd.concat`
    whenever the frames differ in columns or hold extension arrays."""
    import numpy as np
    import pandas as pd

    if len(frames) == 1:
        return frames[0]
    cols = list(frames[0].columns)
    if len(frames) < 64 or len(set(cols)) != len(cols):
        return pd.concat(frames, ignore_index=True)
    parts: List[List[Any]] = [[] for _ in cols]
    try:
        for f in frames:
            if list(f.columns) != cols:
                return pd.concat(frames, ignore_index=True)
            for i in range(len(cols)):
                arr = f._get_column_array(i)
                if not isinstance(arr, np.ndarray):
                    return pd.concat(frames, ignore_index=True)
                parts[i].append(arr)
    except AttributeError:  # a pandas without _get_column_array
        return pd.concat(frames, ignore_index=True)
    return pd.DataFrame({c: np.concatenate(p) for c, p in zip(cols, parts)})


def evolve_states(backend, evolutions: Dict[str, Dict[str, Any]], now_ms: int) -> List[str]:
    """Convert the values of the states in `evolutions` (dstl.state.evolution.plan_state_evolution's
    result) held by a restored backend to their new layout, then materialize, so the checkpoint this
    batch writes holds only values of the new layout (its log restarts after the materialization).
    Returns the names of the states converted."""
    from dstl.state.evolution import evolve_backend, plan_evolution

    done = []
    for name, recs in sorted(evolutions.items()):
        if name not in backend.state_names:
            continue  # this subtask holds none of it
        convert = plan_evolution(name, recs["old"], recs["new"])
        if convert is not None:
            evolve_backend(backend, name, convert)
            done.append(name)
    if done:
        backend.ttl_clock = lambda: now_ms  # expiry at materialization is judged at the batch time
        backend.materialize(force=True)
    return done


def make_task_fn(processor: Any, key_col: str, ctx: BatchContext,
                 initial_by_subtask: Optional[Dict[int, Any]] = None,
                 event_cols: Optional[List[str]] = None,
                 evolutions: Optional[Dict[str, Dict[str, Any]]] = None) -> Callable:
    """`fn(rows, backend)` for the stateful task: a StatefulProcessor, or a vectorised function
    (called as is) when `processor` is not one.

    Before the user's code sees the rows, with `event_cols` (epoch ms, one per watermarked column)
    each column's largest event time is noted (late rows and null keys included, as Spark's
    watermark operator sees every row), rows whose first event-time column is at or before the
    late-events watermark are counted and dropped (dstl.spark.watermark), and the columns removed;
    null keys are counted and dropped (the driver decides whether that is an error).
    `evolutions` (the first batch after a resume whose declared schemas changed): the states whose
    stored values are converted to their new layout before the processor sees them."""
    import dataclasses

    import numpy as np

    from dstl.spark import task as K

    vectorised = not is_stateful_processor(processor)
    ts = ctx.batch_timestamp_ms
    event_cols = list(event_cols or [])

    def prepare(rows):
        metrics = K.task_metrics()
        if not len(rows):
            present = [c for c in event_cols if c in rows.columns]
            return rows.drop(columns=present) if present else rows
        if event_cols:
            maxima = {}
            for i, c in enumerate(event_cols):
                et = rows[c].to_numpy(dtype="float64", na_value=np.nan)
                if not np.isnan(et).all():
                    maxima[str(i)] = int(np.nanmax(et))
            if maxima:
                metrics["max_event_ms"] = maxima
            first = rows[event_cols[0]].to_numpy(dtype="float64", na_value=np.nan)
            late = first <= ctx.late_watermark_ms  # NaN (a null event time) is never late
            if late.any():
                metrics["late_rows"] = int(late.sum())
                rows = rows[~late]
            rows = rows.drop(columns=event_cols)
        null = rows[key_col].isna().to_numpy()
        if null.any():
            metrics["null_rows"] = int(null.sum())
            rows = rows[~null]
        if null.any() and rows[key_col].dtype.kind == "f":  # an integer key column that held nulls
            rows = rows.astype({key_col: "int64"})
        return rows.reset_index(drop=True)

    if vectorised:
        fn = processor

        def vectorised_fn(rows, backend):
            backend.ttl_clock = lambda: ts  # TTL states of fn expire against the batch timestamp
            rows = prepare(rows)
            return fn(rows, backend) if len(rows) else None

        return vectorised_fn

    def task_fn(rows, backend):
        rows = prepare(rows)
        if evolutions:
            evolved = evolve_states(backend, evolutions, ctx.batch_timestamp_ms)
            if evolved:
                K.task_metrics()["evolved_states"] = len(evolved)
        sub = K.current_subtask()
        init = None if initial_by_subtask is None else initial_by_subtask.get(sub)
        local = dataclasses.replace(ctx, initial_state=init, metrics={})
        out = run_processor(processor, rows, backend, local, key_col)
        K.task_metrics().update(local.metrics)
        return out

    return task_fn
