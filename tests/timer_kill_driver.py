"""The Structured Streaming driver of tests/test_timer_kills.py: a StatefulStream with timer rounds
(tests/idle_processors.py's QuickTimeout, ProcessingTime, a 1 s trigger and timer_interval), run in
a process of its own so the test can SIGKILL it at a step of a timer round
(``DSTL_FAULTS="timers.<step>@<batch>=kill"``) and start it again on the same paths.

    python timer_kill_driver.py --base DIR --input DIR --checkpoint DIR --parallelism P \
        --sink-log FILE --until-rows N

The user sink appends ``batch_id user message`` per row (``batch_id -`` for an empty call),
flushed to disk. Without a kill, the driver stops its query once the sink log holds N rows.
"""
from __future__ import annotations

import argparse
import os
import sys
import time

HERE = os.path.dirname(os.path.abspath(__file__))


def _append(path: str, lines) -> None:
    with open(path, "a") as f:
        f.write("".join(line + "\n" for line in lines))
        f.flush()
        os.fsync(f.fileno())


def _rows(path: str) -> int:
    if not os.path.exists(path):
        return 0
    with open(path) as f:
        return sum(1 for line in f if not line.rstrip().endswith(" -"))


def main(argv=None) -> int:
    p = argparse.ArgumentParser()
    for name in ("--base", "--input", "--checkpoint", "--sink-log"):
        p.add_argument(name, required=True)
    p.add_argument("--parallelism", type=int, required=True)
    p.add_argument("--until-rows", type=int, required=True)
    args = p.parse_args(argv)
    os.environ["PYSPARK_PYTHON"] = sys.executable
    sys.path.insert(0, HERE)
    from pyspark.sql import SparkSession

    from dstl.spark import StatefulStream
    from idle_processors import IDLE_OUTPUT, QuickTimeout
    from streaming_util import read_stream

    spark = (SparkSession.builder.master("local[2]").appName(f"dstl-timer-kill-p{args.parallelism}")
             .config("spark.driver.host", "127.0.0.1").config("spark.driver.bindAddress", "127.0.0.1")
             .config("spark.ui.enabled", "false").config("spark.ui.showConsoleProgress", "false")
             .config("spark.sql.shuffle.partitions", "2").config("spark.sql.codegen.wholeStage", "false")
             .config("spark.sql.adaptive.enabled", "false").getOrCreate())
    spark.sparkContext.setLogLevel("ERROR")

    def sink(df, batch_id):
        rows = df.collect()
        _append(args.sink_log, [f"{batch_id} {r['user']} {r['message'].replace(' ', '_')}" for r in rows]
                or [f"{batch_id} -"])

    stream = StatefulStream(args.base, QuickTimeout(), IDLE_OUTPUT, key="user", parallelism=args.parallelism,
                            time_mode="ProcessingTime", timer_interval="1 second", sink=sink,
                            options={"upload.mode": "thread"})
    query = (read_stream(spark, args.input).writeStream.foreachBatch(stream)
             .option("checkpointLocation", args.checkpoint).trigger(processingTime="1 second").start())
    deadline = time.monotonic() + 300
    while _rows(args.sink_log) < args.until_rows and time.monotonic() < deadline:
        time.sleep(0.5)
    query.stop()
    stream.close()
    spark.stop()
    return 0 if _rows(args.sink_log) >= args.until_rows else 1


if __name__ == "__main__":
    sys.exit(main())
