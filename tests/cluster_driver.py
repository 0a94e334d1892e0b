"""A Structured Streaming driver for a real cluster: a JSON file stream through StatefulStream
(tests/processors.py's CountingProcessor), one file per micro-batch, until the files are drained.

    python cluster_driver.py --base URL --input DIR --checkpoint DIR --parallelism P --progress FILE \
        [--conf KEY=VALUE ...] [--option KEY=VALUE ...]

`--conf` goes to the SparkSession builder (the cluster's master, event log, executorEnv...). Before a
batch it appends `{"batch": N, "phase": "start"}` to the progress file, after it one line with the
batch's result and each subtask's report (without the snapshot bytes), so a test can act mid-run
(kill a worker) and measure afterwards (warm continuations, restore times).
"""
from __future__ import annotations

import argparse
import dataclasses
import json
import os
import sys
import time

HERE = os.path.dirname(os.path.abspath(__file__))


def _report(r) -> dict:
    d = {f.name: getattr(r, f.name) for f in dataclasses.fields(r) if f.name != "snapshot"}
    return {k: v for k, v in d.items() if isinstance(v, (int, float, str, bool)) or v is None}


def main(argv=None) -> int:
    p = argparse.ArgumentParser()
    p.add_argument("--base", required=True)
    p.add_argument("--input", required=True)
    p.add_argument("--checkpoint", required=True)
    p.add_argument("--parallelism", type=int, required=True)
    p.add_argument("--progress", required=True)
    p.add_argument("--conf", action="append", default=[], metavar="KEY=VALUE")
    p.add_argument("--fn", action="store_true",
                   help="the vectorised count_fn instead of the CountingProcessor class (same output)")
    p.add_argument("--option", action="append", default=[], metavar="KEY=VALUE",
                   help="a dstl option of the changelog storage (dstl.dfs.KEY or the bare suffix)")
    args = p.parse_args(argv)
    sys.path.insert(0, HERE)
    from pyspark.sql import SparkSession

    from dstl.spark import StatefulStream
    from processors import COUNT_OUTPUT, CountingProcessor, count_fn
    from streaming_util import read_stream

    builder = SparkSession.builder.appName(f"dstl-cluster-p{args.parallelism}")
    for kv in args.conf:
        k, _, v = kv.partition("=")
        builder = builder.config(k, v)
    spark = builder.getOrCreate()
    spark.sparkContext.setLogLevel("ERROR")
    options = {kv.partition("=")[0]: kv.partition("=")[2] for kv in args.option}
    processor = count_fn if args.fn else CountingProcessor()
    stream = StatefulStream(args.base, processor, COUNT_OUTPUT, key="user", parallelism=args.parallelism,
                            options=options)

    def log(entry: dict) -> None:
        with open(args.progress, "a") as f:
            f.write(json.dumps(entry) + "\n")

    def each_batch(df, batch_id):
        log({"batch": batch_id, "phase": "start", "t": time.time()})
        res = stream(df, batch_id)
        log({"batch": batch_id, "phase": "done", "t": time.time(), "parallelism": args.parallelism,
             "seconds": res.seconds, "replayed": res.replayed, "rows_in": res.rows_in,
             "restored": res.restored, "restore_ms": res.restore_ms, "phases_ms": res.phases_ms,
             "reports": [_report(r) for r in res.reports]})

    query = (read_stream(spark, args.input).writeStream.foreachBatch(each_batch)
             .option("checkpointLocation", args.checkpoint).trigger(availableNow=True).start())
    query.awaitTermination()
    stream.close()
    spark.stop()
    return 0


if __name__ == "__main__":
    sys.exit(main())
