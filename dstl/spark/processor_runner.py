"""`run_processor`: one subtask's micro-batch through a StatefulProcessor, in Spark's order, and
`make_task_fn`, the stateful task's function around it (watermark, late rows, null keys, schema
evolution). See dstl.spark.processor for the order of the calls."""
from __future__ import annotations

import dataclasses
import gc
import time
from typing import Any, Callable, Dict, Iterator, List, Optional

import numpy as np

from dstl.spark import task as K
from dstl.spark.errors import ProcessorError, call_fn, processor_failed
from dstl.spark.keys import unpack_key as key_of
from dstl.spark.processor_context import BatchContext, is_stateful_processor
from dstl.spark.processor_handle import ProcessorHandle
from dstl.spark.rows import InputRows, OutputRows
from dstl.state.evolution import evolve_backend, plan_evolution

__all__ = ["run_processor", "make_task_fn", "session_timestamps", "concat_frames", "evolve_states"]


def _frames(result: Any, where: str) -> Iterator[Any]:
    import pandas as pd  # pandas: the spark extra, needed only where a batch runs

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
    import pandas as pd  # pandas: the spark extra, needed only where a batch runs

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
    import pandas as pd  # pandas: the spark extra, needed only where a batch runs

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
    paused = gc.isenabled()
    gc.disable()
    try:
        return _run_processor(processor, rows, backend, ctx, key_col)
    finally:
        if paused:
            gc.enable()


def _run_processor(processor: Any, rows, backend, ctx: BatchContext, key_col: str):
    from pyspark.sql.streaming.stateful_processor import ExpiredTimerInfo  # PySpark: only on its workers

    handle = ProcessorHandle(backend, ctx)
    backend.ttl_clock = handle._batch_clock  # TTL purges at materialization use the batch time too
    processor.init(handle)
    tv = ctx.timer_values()
    row_api = ctx.api == "row"
    if row_api:
        out: Any = OutputRows(ctx.output_arrow_schema)
    else:
        out = _PandasOut()
    composite = ctx.key_columns is not None
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
    except Exception as exc:
        if isinstance(exc, ProcessorError):
            raise
        k = handle._key
        raise processor_failed(processor, None if k is None else key_of(k) if composite else (k,), exc) from exc
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
    import pandas as pd  # pandas: the spark extra, needed only where a batch runs
    import pyarrow as pa  # pyarrow: the spark extra too

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
    import pandas as pd  # pandas: the spark extra, needed only where a batch runs

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
            return call_fn(fn, prepare(rows), backend)

        vectorised_fn.processor = fn  # type: ignore[attr-defined]  # named in errors
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

    task_fn.processor = processor  # type: ignore[attr-defined]  # named in errors
    return task_fn
