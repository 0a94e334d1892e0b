"""Run one StatefulProcessor natively (`groupBy(...).transformWithStateInPandas` or
`.transformWithState`) and through `foreachBatch(StatefulStream(...))` over the same JSON file
stream, and return both outputs per micro-batch as multisets of plain tuples.

Native runs with the RocksDB provider and without no-data micro-batches (tests/streaming_util.py's
NATIVE_CONF), so both engines see one micro-batch per file. Native's batch timestamps are noted by
a Recording wrapper and replayed to dstl through `clock=`, so processing-time timers and TTL meet
the same clock.
"""
from __future__ import annotations

import collections
import datetime as dt
import decimal
import json
import os
from dataclasses import dataclass, field
from typing import Any, Callable, Dict, List, Optional, Sequence

from conform_processors import Recording, recorded_timestamps
from streaming_util import NATIVE_CONF, spark_conf


@dataclass
class Case:
    name: str
    factory: Callable[[bool], Any]          # use_pandas -> a processor
    output: str                            # output DDL
    input_schema: str                      # input DDL (JSON file stream)
    batches: Sequence[Sequence[dict]]      # one list of records per micro-batch
    keys: Sequence[str] = ("id",)
    time_mode: str = "None"
    output_mode: str = "Update"
    event_time: Optional[str] = None
    delay: Optional[str] = None
    initial: Optional[Sequence[dict]] = None
    initial_schema: Optional[str] = None
    flavours: Sequence[str] = ("pandas", "row")
    stream_options: Dict[str, Any] = field(default_factory=dict)
    #: SQL confs set for both runs (e.g. a session time zone)
    conf: Dict[str, str] = field(default_factory=dict)
    #: schema evolution: one processor class per batch, each run as a new query (native) or a new
    #: StatefulStream (dstl) on the same checkpoint; `factory` and `output` are then unused
    stages: Optional[Sequence[Any]] = None


def _json_value(v):
    if isinstance(v, (dt.datetime, dt.date)):
        return v.isoformat()
    return v


def write_stream(directory: str, batches: Sequence[Sequence[dict]], first: int = 0) -> None:
    os.makedirs(directory, exist_ok=True)
    for i, records in enumerate(batches, start=first):
        tmp = os.path.join(directory, f".b{i:04d}.tmp")
        with open(tmp, "w") as f:
            for r in records:
                f.write(json.dumps({k: _json_value(v) for k, v in r.items()}) + "\n")
        os.utime(tmp, (1_700_000_000 + i, 1_700_000_000 + i))
        os.replace(tmp, os.path.join(directory, f"b{i:04d}.json"))


def plain(value: Any) -> Any:
    """A collected value as something hashable and comparable (Rows and dicts included)."""
    if isinstance(value, tuple) and hasattr(value, "asDict"):
        return ("Row",) + tuple((k, plain(v)) for k, v in value.asDict().items())
    if isinstance(value, dict):
        return ("map",) + tuple(sorted(((plain(k), plain(v)) for k, v in value.items()), key=repr))
    if isinstance(value, (list, tuple)):
        return tuple(plain(v) for v in value)
    if isinstance(value, decimal.Decimal):
        return ("dec", str(value))
    return value


def per_batch(rows: List[Any], columns: Sequence[str]) -> Dict[int, collections.Counter]:
    out: Dict[int, collections.Counter] = collections.defaultdict(collections.Counter)
    for r in rows:
        d = r.asDict()
        out[int(d["batch_id"])][tuple(plain(d[c]) for c in columns)] += 1
    return dict(out)


def _source(spark, case: Case, directory: str):
    return spark.readStream.schema(case.input_schema).option("maxFilesPerTrigger", 1).json(directory)


def _initial(spark, case: Case):
    if case.initial is None:
        return None
    return spark.createDataFrame([tuple(r.values()) for r in case.initial], case.initial_schema)


def run_native(spark, case: Case, flavour: str, directory: str, work: str, attempts: int = 3, collect: bool = True):
    """Native output rows (with batch_id) and the batch timestamps it used.

    Spark waits a fixed 10 s for the Python process that runs the processor's `init` on the driver
    (its PreInit runner) to connect back; on a loaded machine it can start slower, and the query
    fails before its first batch. Then nothing has run: the query starts again, afresh."""
    for attempt in range(attempts):
        try:
            return _run_native(spark, case, flavour, directory, os.path.join(work, f"attempt{attempt}"), collect)
        except Exception as exc:  # noqa: BLE001
            if "failed to connect back" not in str(exc) or attempt == attempts - 1:
                raise
    raise AssertionError("unreachable")


def _run_native(spark, case: Case, flavour: str, directory: str, work: str, collect: bool = True):
    os.makedirs(work, exist_ok=True)
    stamps = os.path.join(work, f"native-{flavour}.ts")
    proc = Recording(case.factory(flavour == "pandas"), stamps)
    events = _source(spark, case, directory)
    if case.event_time is not None:
        events = events.withWatermark(case.event_time, case.delay)
    grouped = events.groupBy(*case.keys)
    op = grouped.transformWithState if flavour == "row" else grouped.transformWithStateInPandas
    init = _initial(spark, case)
    out = op(proc, case.output, case.output_mode, case.time_mode,
             initialState=None if init is None else init.groupBy(*case.keys))
    # each batch as parquet files: the sink also works where foreachBatch runs in another
    # process (Spark Connect runs it in the server's worker)
    out_dir = os.path.join(work, f"native-out-{flavour}")

    def sink(df, batch_id):
        from pyspark.sql import functions as F

        df.withColumn("batch_id", F.lit(batch_id)).write.mode("overwrite").parquet(f"{out_dir}/b{batch_id:05d}")

    with spark_conf(spark, NATIVE_CONF):
        q = (out.writeStream.foreachBatch(sink).option("checkpointLocation", os.path.join(work, f"nck-{flavour}"))
             .trigger(availableNow=True).start())
        try:
            q.awaitTermination()
        finally:
            q.stop()
    collected = spark.read.parquet(f"{out_dir}/b*").collect() if collect and os.path.isdir(out_dir) else []
    return collected, recorded_timestamps(stamps)


def run_dstl(spark, case: Case, flavour: str, directory: str, work: str, stamps: Sequence[int],
             collect: bool = True):
    """dstl's output rows (with batch_id), the clock replaying native's batch timestamps."""
    from dstl.spark import StatefulStream

    ticks = iter(list(stamps))
    last = [max(stamps) if stamps else 0]

    def clock():
        last[0] = next(ticks, last[0])
        return last[0]

    keys = list(case.keys)
    opts = dict(case.stream_options)
    source = _source(spark, case, directory)
    if case.event_time is not None and case.time_mode == "EventTime":
        opts.update(event_time_column=case.event_time, watermark_delay=case.delay)
    elif case.event_time is not None:
        # a watermark without event-time mode: Spark's operator drops no row; the migrated query
        # keeps the source's withWatermark, which a foreachBatch leaves without effect
        source = source.withWatermark(case.event_time, case.delay)
    base = os.path.join(work, f"dstl-{flavour}")
    if LEAN:
        # the rows a processor produces do not depend on where its state lives or how its changes
        # are uploaded (the stream, placement and slot tests run the defaults): no upload service
        # and no slot processes to start for each of these short queries
        opts.setdefault("options", {"upload.mode": "thread"})
    stream = StatefulStream(base, case.factory(flavour == "pandas"), case.output,
                            key=keys[0] if len(keys) == 1 else keys, parallelism=2,
                            time_mode=case.time_mode, api=flavour, initial_state=_initial(spark, case),
                            clock=clock, **opts)
    with _Env({"DSTL_SPARK_SLOTS": "off"} if LEAN else {}):
        for attempt in range(3):
            try:
                q = (source.writeStream.foreachBatch(stream)
                     .option("checkpointLocation", os.path.join(work, f"dck-{flavour}"))
                     .trigger(availableNow=True).start())
                break
            except Exception as exc:  # noqa: BLE001
                # under Connect the server's foreachBatch process must connect back within Spark's
                # fixed 10 s; nothing has run when it does not: start again
                if "failed to connect back" not in str(exc) or attempt == 2:
                    stream.close()
                    raise
        try:
            q.awaitTermination()
        finally:
            q.stop()
            stream.close()
    return (spark.read.parquet(os.path.join(base, "output")).collect() if collect else []), stream


class _Env:
    """Environment variables set for a while (forwarded to the tasks by dstl.spark.session)."""

    def __init__(self, values: Dict[str, str]):
        self.values, self.saved = values, {}

    def __enter__(self):
        self.saved = {k: os.environ.get(k) for k in self.values}
        os.environ.update(self.values)

    def __exit__(self, *exc):
        for k, v in self.saved.items():
            if v is None:
                os.environ.pop(k, None)
            else:
                os.environ[k] = v


#: thread-mode uploads and tasks in the Python workers for the dstl side (DSTL_CONFORMANCE_LEAN=0: the defaults)
LEAN = os.environ.get("DSTL_CONFORMANCE_LEAN", "1") != "0"


def compare(spark, case: Case, flavour: str, work: str):
    """(native per batch, dstl per batch, the dstl stream) for one case in one flavour."""
    if case.stages is not None:
        return _compare_stages(spark, case, flavour, work)
    directory = os.path.join(work, "input")
    if not os.path.isdir(directory):
        write_stream(directory, case.batches)
    with spark_conf(spark, dict(case.conf)):
        native_rows, stamps = run_native(spark, case, flavour, directory, work)
        dstl_rows, stream = run_dstl(spark, case, flavour, directory, work, stamps)
    columns = [c.strip().split()[0] for c in _top_level(case.output)]
    return per_batch(native_rows, columns), per_batch(dstl_rows, columns), stream


def _top_level(ddl: str) -> List[str]:
    """The top-level column definitions of a DDL string (commas inside <...> or (...) are not
    separators)."""
    parts, depth, cur = [], 0, ""
    for ch in ddl:
        if ch in "<(":
            depth += 1
        elif ch in ">)":
            depth -= 1
        if ch == "," and depth == 0:
            parts.append(cur)
            cur = ""
        else:
            cur += ch
    parts.append(cur)
    return [p for p in parts if p.strip()]


def _compare_stages(spark, case: Case, flavour: str, work: str):
    """Schema evolution: batch i's file is added, then stage i's processor runs the next batch,
    natively as a new query on the same checkpoint and on dstl as a new StatefulStream on the
    same base path. Each batch is compared with its own stage's output columns."""
    import dataclasses

    directory = os.path.join(work, "input")
    native: Dict[int, collections.Counter] = {}
    ours: Dict[int, collections.Counter] = {}
    stream = None
    with spark_conf(spark, dict(case.conf)):
        for i, (proc, records) in enumerate(zip(case.stages, case.batches)):
            write_stream(directory, [records], first=i)
            stage = dataclasses.replace(case, factory=proc, output=proc.OUTPUT, stages=None)
            columns = [c.strip().split()[0] for c in _top_level(stage.output)]
            _, stamps = run_native(spark, stage, flavour, directory, work, attempts=1, collect=False)
            _, stream = run_dstl(spark, stage, flavour, directory, work, stamps[-1:], collect=False)
            # each batch read alone: the stages' output schemas differ
            for got, path in ((native, f"{work}/attempt0/native-out-{flavour}/b{i:05d}"),
                              (ours, f"{work}/dstl-{flavour}/output/batch_id={i}")):
                rows = spark.read.parquet(path).collect() if os.path.isdir(path) else []
                got[i] = collections.Counter(tuple(plain(r[c]) for c in columns) for r in rows)
    return native, ours, stream
