"""A Structured Streaming driver for the SIGKILL tests: a JSON file stream through StatefulStream.

    python stream_driver.py BASE INPUT_DIR SPARK_CHECKPOINT PARALLELISM SINK_LOG

Processes every file in INPUT_DIR (one file per micro-batch, `availableNow`), then exits 0. Faults
come from DSTL_FAULTS (dstl.spark.faults), e.g. ``stream.after_checkpoint@1=kill``. The sink appends
one line per call to SINK_LOG. `Counting` is also the light tests' processor.
"""
from __future__ import annotations

import os
import sys

import pandas as pd
from pyspark.sql.streaming.stateful_processor import StatefulProcessor

OUT = "user string, n long, items long, buckets long, evens long"
INPUT_SCHEMA = "user string, v long"


class Counting(StatefulProcessor):
    """Per user: a count (value), every value seen (list) and a count per parity (map)."""

    def init(self, handle):
        self.count = handle.getValueState("count", "n long")
        self.seen = handle.getListState("seen", "v long")
        self.parity = handle.getMapState("parity", "p string", "c long")

    def handleInputRows(self, key, rows, timerValues):
        n = self.count.get()[0] if self.count.exists() else 0
        for pdf in rows:
            n += len(pdf)
            self.seen.appendList([(v,) for v in pdf["v"].tolist()])
            for v in pdf["v"].tolist():
                p = ("even",) if v % 2 == 0 else ("odd",)
                old = self.parity.getValue(p)
                self.parity.updateValue(p, ((old[0] if old else 0) + 1,))
        self.count.update((n,))
        evens = self.parity.getValue(("even",))
        yield pd.DataFrame({"user": [key[0]], "n": [n], "items": [len(list(self.seen.get()))],
                            "buckets": [len(list(self.parity.keys()))], "evens": [evens[0] if evens else 0]})

    def close(self):
        pass


def main(argv) -> int:
    base, input_dir, ckpt, parallelism, sink_log = argv
    os.environ["PYSPARK_PYTHON"] = sys.executable
    from pyspark.sql import SparkSession

    from dstl.spark import StatefulStream

    spark = (SparkSession.builder.master("local[2]").appName("dstl-stream-driver")
             .config("spark.driver.host", "127.0.0.1").config("spark.driver.bindAddress", "127.0.0.1")
             .config("spark.ui.enabled", "false").config("spark.ui.showConsoleProgress", "false")
             .config("spark.sql.shuffle.partitions", "2").getOrCreate())

    def sink(df, batch_id):
        n = df.count()
        with open(sink_log, "a") as f:
            f.write(f"{batch_id} {n}\n")

    stream = StatefulStream(base, Counting(), OUT, key="user", parallelism=int(parallelism), sink=sink)
    events = spark.readStream.schema(INPUT_SCHEMA).option("maxFilesPerTrigger", 1).json(input_dir)
    query = (events.writeStream.foreachBatch(stream).option("checkpointLocation", ckpt)
             .trigger(availableNow=True).start())
    query.awaitTermination()
    stream.close()
    spark.stop()
    return 0


if __name__ == "__main__":
    sys.exit(main(sys.argv[1:]))
