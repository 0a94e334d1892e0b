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
    from dstl.spark import StatefulStream
    from streaming_util import drain_file_stream, driver_session

    spark = driver_session("dstl-stream-driver")

    def sink(df, batch_id):
        n = df.count()
        with open(sink_log, "a") as f:
            f.write(f"{batch_id} {n}\n")

    stream = StatefulStream(base, Counting(), OUT, key="user", parallelism=int(parallelism), sink=sink)
    drain_file_stream(spark, stream, INPUT_SCHEMA, input_dir, ckpt)
    return 0


if __name__ == "__main__":
    sys.exit(main(sys.argv[1:]))
