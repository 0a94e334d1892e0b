"""A JSON file stream, runners for Spark's native transformWithStateInPandas and for dstl's
StatefulStream over it, and pandas reference computations of tests/processors.py's processors.

Batch b of the stream is one JSON-lines file whose event times lie in
[T0_MS + b * BATCH_SPAN_MS, T0_MS + (b + 1) * BATCH_SPAN_MS), in whole seconds, so no event is ever
late and both engines see the same micro-batches (`maxFilesPerTrigger=1`).
"""
from __future__ import annotations

import contextlib
import json
import os
from dataclasses import dataclass, field
from typing import Dict, Iterator, List, Optional, Sequence

import numpy as np
import pandas as pd

T0_MS = 1_767_225_600_000                  # 2026-01-01T00:00:00Z
BATCH_SPAN_MS = 60_000
KINDS = ("view", "cart", "buy", "like")
EVENTS_SCHEMA = "user string, kind string, value long, ts_ms long"
ROCKSDB_PROVIDER = "org.apache.spark.sql.execution.streaming.state.RocksDBStateStoreProvider"
# What Spark's native operator needs in local mode: the RocksDB provider (transformWithState runs
# only on it), and no "no-data" micro-batches, which Spark would otherwise add after the last file
# just to advance the watermark; a foreachBatch over the raw events never gets those, so with them
# the two engines would not see the same batches.
NATIVE_CONF = {
    "spark.sql.streaming.stateStore.providerClass": ROCKSDB_PROVIDER,
    "spark.sql.streaming.noDataMicroBatches.enabled": "false",
}


def make_batches(n_batches: int, events_per_batch: int, n_keys: int, seed: int = 7) -> List[pd.DataFrame]:
    """Deterministic events: batch b depends only on (seed, b)."""
    out = []
    for b in range(n_batches):
        rng = np.random.default_rng([seed, b])
        seconds = np.sort(rng.integers(0, BATCH_SPAN_MS // 1000, events_per_batch))
        out.append(pd.DataFrame({
            "user": np.char.add("u", rng.integers(0, n_keys, events_per_batch).astype(str)).astype(object),
            "kind": np.asarray(KINDS, dtype=object)[rng.integers(0, len(KINDS), events_per_batch)],
            "value": rng.integers(1, 100, events_per_batch).astype(np.int64),
            "ts_ms": T0_MS + b * BATCH_SPAN_MS + seconds.astype(np.int64) * 1000,
        }))
    return out


def write_json_batch(directory: str, index: int, batch: pd.DataFrame) -> str:
    """One batch as one JSON-lines file, written under a hidden name and renamed into place (the file
    source never sees a half-written file), with a modification time that orders it after earlier ones."""
    os.makedirs(directory, exist_ok=True)
    path = os.path.join(directory, f"batch-{index:05d}.json")
    tmp = os.path.join(directory, f".batch-{index:05d}.json.tmp")
    with open(tmp, "w") as f:
        for rec in batch.to_dict("records"):
            f.write(json.dumps({k: (int(v) if isinstance(v, (np.integer,)) else v) for k, v in rec.items()}))
            f.write("\n")
    mtime = 1_700_000_000 + index
    os.utime(tmp, (mtime, mtime))
    os.replace(tmp, path)
    return path


def write_json_stream(directory: str, batches: Sequence[pd.DataFrame]) -> List[str]:
    return [write_json_batch(directory, i, b) for i, b in enumerate(batches)]


def read_stream(spark, directory: str, files_per_trigger: int = 1):
    """The file stream: one file per micro-batch, plus `ts` (a timestamp, for watermarks)."""
    from pyspark.sql import functions as F

    return (spark.readStream.schema(EVENTS_SCHEMA).option("maxFilesPerTrigger", files_per_trigger)
            .json(directory).withColumn("ts", F.timestamp_millis("ts_ms")))


@contextlib.contextmanager
def spark_conf(spark, conf: Dict[str, str]) -> Iterator[None]:
    """Set SQL confs for the block and put the previous values back (the session is shared)."""
    saved = {k: spark.conf.get(k, None) for k in conf}
    for k, v in conf.items():
        spark.conf.set(k, v)
    try:
        yield
    finally:
        for k, v in saved.items():
            if v is None:
                spark.conf.unset(k)
            else:
                spark.conf.set(k, v)


@dataclass
class NativeRun:
    output: pd.DataFrame                   # every row foreachBatch received, with `batch_id`
    progress: List[dict] = field(default_factory=list)   # the query's progress reports, oldest first


def native_query(spark, source: str, processor, output_schema: str, checkpoint: str, sink, *,
                 time_mode: str = "None", output_mode: str = "Update", watermark_delay: Optional[str] = None,
                 available_now: bool = True, api: str = "pandas", initial_state=None):
    """Start `events.groupBy("user").transformWithStateInPandas(processor, ...)` (api="row":
    `transformWithState`, PySpark 4.1+'s Row API) into foreachBatch(sink). `initial_state`: a
    DataFrame keyed by `user`. Call inside `spark_conf(spark, NATIVE_CONF)`."""
    events = read_stream(spark, source)
    if watermark_delay is not None:
        events = events.withWatermark("ts", watermark_delay)
    grouped = events.groupBy("user")
    op = grouped.transformWithState if api == "row" else grouped.transformWithStateInPandas
    init = None if initial_state is None else initial_state.groupBy("user")
    out = op(processor, output_schema, output_mode, time_mode, initialState=init)
    writer = out.writeStream.foreachBatch(sink).option("checkpointLocation", checkpoint)
    if available_now:
        writer = writer.trigger(availableNow=True)
    return writer.start()


def run_native(spark, source: str, processor, output_schema: str, checkpoint: str, *,
               time_mode: str = "None", output_mode: str = "Update",
               watermark_delay: Optional[str] = None, api: str = "pandas", initial_state=None) -> NativeRun:
    """Run every file under `source` through Spark's native operator (RocksDB state) and return the
    committed output as pandas."""
    collected: List[pd.DataFrame] = []

    def sink(df, batch_id):
        pdf = df.toPandas()
        pdf["batch_id"] = batch_id
        collected.append(pdf)

    with spark_conf(spark, NATIVE_CONF):
        query = native_query(spark, source, processor, output_schema, checkpoint, sink, time_mode=time_mode,
                             output_mode=output_mode, watermark_delay=watermark_delay, api=api,
                             initial_state=initial_state)
        try:
            query.awaitTermination()
        finally:
            query.stop()
        progress = [json.loads(p.json) for p in query.recentProgress]
    columns = [f.split()[0] for f in output_schema.split(",")] + ["batch_id"]
    output = pd.concat(collected, ignore_index=True) if collected else pd.DataFrame(columns=columns)
    return NativeRun(output, progress)


def run_dstl(spark, source: str, processor, output_schema: str, base_path: str, checkpoint: str, *,
             parallelism: int = 2, **stream_options) -> pd.DataFrame:
    """Run every file under `source` through `events.writeStream.foreachBatch(StatefulStream(...))`
    and return what the default sink committed under `<base_path>/output`."""
    from dstl.spark import StatefulStream

    stream = StatefulStream(base_path, processor, output_schema, key="user", parallelism=parallelism,
                            **stream_options)
    query = (read_stream(spark, source).writeStream.foreachBatch(stream)
             .option("checkpointLocation", checkpoint).trigger(availableNow=True).start())
    try:
        query.awaitTermination()
    finally:
        query.stop()
    return read_output(os.path.join(base_path, "output"))


def driver_session(app_name: str):
    """The local[2] session a killed-and-restarted driver script opens (loopback only, quiet)."""
    from pyspark.sql import SparkSession

    return (SparkSession.builder.master("local[2]").appName(app_name)
            .config("spark.driver.host", "127.0.0.1").config("spark.driver.bindAddress", "127.0.0.1")
            .config("spark.ui.enabled", "false").config("spark.ui.showConsoleProgress", "false")
            .config("spark.sql.shuffle.partitions", "2").getOrCreate())


def drain_file_stream(spark, stream, input_schema: str, input_dir: str, checkpoint: str) -> None:
    """Feed every JSON file of `input_dir` (one per trigger) to `foreachBatch(stream)` until none is
    left, then close the stream and stop Spark."""
    from dstl.tools.stream_demo import run_file_stream

    run_file_stream(spark, stream, input_schema, input_dir, checkpoint)
    stream.close()
    spark.stop()


def read_output(path: str) -> pd.DataFrame:
    """The default sink's parquet (`batch_id=N/part-*.parquet`) as pandas, batch_id an int column."""
    if not os.path.isdir(path):
        return pd.DataFrame()
    out = pd.read_parquet(path)
    out["batch_id"] = out["batch_id"].astype(np.int64)
    return out


def normalize(df: pd.DataFrame, columns: Sequence[str]) -> pd.DataFrame:
    """The rows of `columns`, ints as int64, sorted: the form two outputs are compared in."""
    out = df[list(columns)].copy()
    for c in columns:
        if c != "user":
            out[c] = out[c].astype(np.int64)
        else:
            out[c] = out[c].astype(object)
    return out.sort_values(list(columns)).reset_index(drop=True)


# --- pandas references: what each processor must emit, batch by batch ---------------------------

def reference_counts(batches: Sequence[pd.DataFrame]) -> pd.DataFrame:
    """CountingProcessor's (and count_fn's) output."""
    rows = []
    totals: Dict[str, list] = {}
    kinds: Dict[str, Dict[str, int]] = {}
    for b, batch in enumerate(batches):
        for user, g in batch.groupby("user"):
            t = totals.setdefault(user, [0, 0, 0])
            t[0] += len(g)
            t[1] += int(g["value"].sum())
            t[2] += 1
            per_kind = kinds.setdefault(user, {})
            for kind, n in g.groupby("kind").size().items():
                per_kind[kind] = per_kind.get(kind, 0) + int(n)
            rows.append((user, t[0], t[1], t[2], len(per_kind), max(per_kind.values()), b))
    return pd.DataFrame(rows, columns=["user", "events", "value_sum", "batches", "kinds",
                                       "top_kind_events", "batch_id"])


def reference_ttl(batches: Sequence[pd.DataFrame]) -> pd.DataFrame:
    """TtlProcessor's output: a running total; `previous` always expired (-1)."""
    rows = []
    totals: Dict[str, int] = {}
    for b, batch in enumerate(batches):
        for user, n in batch.groupby("user").size().items():
            totals[user] = totals.get(user, 0) + int(n)
            rows.append((user, totals[user], -1, b))
    return pd.DataFrame(rows, columns=["user", "total", "previous", "batch_id"])


def reference_sessions(batches: Sequence[pd.DataFrame], watermark_delay_ms: int, gap_ms: int) -> pd.DataFrame:
    """SessionProcessor's output as Spark runs it: batch b's watermark is the largest event time of
    batches before b minus the delay; a batch first handles its input rows (moving timers), then
    fires the timers the watermark has passed."""
    rows = []
    sessions: Dict[str, list] = {}           # user -> [first, last, events]
    max_seen: Optional[int] = None
    for b, batch in enumerate(batches):
        watermark = max_seen - watermark_delay_ms if max_seen is not None else 0
        for user, g in batch.groupby("user"):
            first, last = int(g["ts_ms"].min()), int(g["ts_ms"].max())
            s = sessions.get(user)
            sessions[user] = ([min(first, s[0]), max(last, s[1]), s[2] + len(g)] if s else [first, last, len(g)])
        for user in [u for u, s in sessions.items() if s[1] + gap_ms <= watermark]:
            first, last, events = sessions.pop(user)
            rows.append((user, first, last, events, last + gap_ms, b))
        batch_max = int(batch["ts_ms"].max())
        max_seen = batch_max if max_seen is None else max(max_seen, batch_max)
    return pd.DataFrame(rows, columns=["user", "first_ms", "last_ms", "events", "fired_at_ms", "batch_id"])
