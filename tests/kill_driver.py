"""The Structured Streaming driver of tests/test_kill_steps.py, run in a process of its own so the
test can SIGKILL it at a named step (dstl.spark.faults, ``DSTL_FAULTS="<point>@<batch>=kill"``) and
start it again on the same base path and Spark checkpoint location.

    python kill_driver.py --base DIR --input DIR --checkpoint DIR --parallelism P \
        --progress FILE --sink-log FILE [--master local[2,4]] [--option KEY=VALUE ...]

A JSON file stream (one file per micro-batch, `availableNow`) through a `StatefulStream` running
tests/processors.py's `count_fn` (value and map state; every batch materializes, so every batch
has old checkpoints and changelog files for garbage collection to delete), until the files are
drained; then the stream is closed (its final garbage collection) and Spark stopped. The user sink
appends ``batch_id rows events`` to the sink log, flushed to disk, once per call. The progress file
gets ``{"batch": N, "phase": "start"|"done", ...}`` around each batch.
"""
from __future__ import annotations

import argparse
import json
import os
import sys
import time

HERE = os.path.dirname(os.path.abspath(__file__))
#: changes per subtask before a materialization: below one batch's, so every batch materializes
MATERIALIZE_EVERY = 16


def _append(path: str, line: str) -> None:
    with open(path, "a") as f:
        f.write(line + "\n")
        f.flush()
        os.fsync(f.fileno())


def main(argv=None) -> int:
    p = argparse.ArgumentParser()
    p.add_argument("--base", required=True)
    p.add_argument("--input", required=True)
    p.add_argument("--checkpoint", required=True)
    p.add_argument("--parallelism", type=int, required=True)
    p.add_argument("--progress", required=True)
    p.add_argument("--sink-log", required=True)
    # local[N,F]: local mode retries a failed task only with F > 1 (the Python-worker kill needs it)
    p.add_argument("--master", default="local[2,4]")
    p.add_argument("--option", action="append", default=[], metavar="KEY=VALUE")
    p.add_argument("--conf", action="append", default=[], metavar="KEY=VALUE", help="a Spark setting")
    args = p.parse_args(argv)
    os.environ["PYSPARK_PYTHON"] = sys.executable
    sys.path.insert(0, HERE)
    from pyspark.sql import SparkSession

    from dstl.spark import StatefulStream
    from processors import COUNT_OUTPUT, count_fn
    from streaming_util import read_stream

    builder = (SparkSession.builder.master(args.master).appName(f"dstl-kill-p{args.parallelism}")
               .config("spark.driver.host", "127.0.0.1").config("spark.driver.bindAddress", "127.0.0.1")
               .config("spark.ui.enabled", "false").config("spark.ui.showConsoleProgress", "false")
               .config("spark.sql.shuffle.partitions", "2").config("spark.task.maxFailures", "4")
               .config("spark.sql.execution.arrow.pyspark.enabled", "true"))
    for kv in args.conf:
        k, _, v = kv.partition("=")
        builder = builder.config(k, v)
    spark = builder.getOrCreate()
    spark.sparkContext.setLogLevel("ERROR")
    options = {kv.partition("=")[0]: kv.partition("=")[2] for kv in args.option}

    def sink(df, batch_id):
        row = df.agg({"events": "sum", "*": "count"}).collect()[0]
        _append(args.sink_log, f"{batch_id} {row['count(1)']} {int(row['sum(events)'] or 0)}")

    stream = StatefulStream(args.base, count_fn, COUNT_OUTPUT, key="user", parallelism=args.parallelism,
                            options=options, sink=sink, materialize_every=MATERIALIZE_EVERY)

    def each_batch(df, batch_id):
        _append(args.progress, json.dumps({"batch": batch_id, "phase": "start", "t": time.time(),
                                           "parallelism": args.parallelism}))
        res = stream(df, batch_id)
        _append(args.progress, json.dumps({"batch": batch_id, "phase": "done", "t": time.time(),
                                           "replayed": res.replayed, "restored": res.restored,
                                           "phases_ms": res.phases_ms,
                                           "max_parallelism": stream.max_parallelism_in_use}))

    query = (read_stream(spark, args.input).writeStream.foreachBatch(each_batch)
             .option("checkpointLocation", args.checkpoint).trigger(availableNow=True).start())
    query.awaitTermination()
    stream.close()
    spark.stop()
    return 0


if __name__ == "__main__":
    sys.exit(main())
