"""A StatefulStream on S3 whose only credentials and endpoint are its `storage_options` (the
environment has none), for tests/test_fs_options.py:

    python fs_options_driver.py BASE EVENT_LOG_DIR

FS_OPTIONS (JSON) holds the file system's keyword arguments; DRIVER_LOG receives dstl's log lines
at DEBUG. Two batches go through `run` (the Python workers and the host's upload service open the
bucket), then the state is read back with `read_state_pandas` and with the Spark `read_state`. The
last stdout line is JSON: the output rows, both reads, and the reprs of the objects that hold the
options.
"""
from __future__ import annotations

import json
import logging
import os
import sys

import pandas as pd

OUTPUT = "user string, n long"


def count(rows: pd.DataFrame, state) -> pd.DataFrame:
    """Events per user so far."""
    n = state.value_state("n")
    per_user = rows.groupby("user").size()
    totals = [(old or 0) + int(c) for old, c in zip(n.get_many(per_user.index, None), per_user.tolist())]
    n.update_many(per_user.index, totals)
    return pd.DataFrame({"user": per_user.index, "n": totals})


def main(base: str, event_log: str) -> None:
    from pyspark.sql import SparkSession

    from dstl.spark import StatefulStream
    from dstl.spark.state_reader import read_state
    from dstl.state.reader import read_state_pandas

    handler = logging.FileHandler(os.environ["DRIVER_LOG"])
    logging.getLogger("dstl").addHandler(handler)
    logging.getLogger("dstl").setLevel(logging.DEBUG)
    fs_options = json.loads(os.environ["FS_OPTIONS"])
    spark = (SparkSession.builder.master("local[2]").appName("dstl-fs-options")
             .config("spark.driver.host", "127.0.0.1").config("spark.driver.bindAddress", "127.0.0.1")
             .config("spark.ui.enabled", "false").config("spark.sql.shuffle.partitions", "2")
             .config("spark.eventLog.enabled", "true").config("spark.eventLog.dir", "file://" + event_log)
             .getOrCreate())
    spark.sparkContext.setLogLevel("ERROR")
    stream = StatefulStream(base, count, OUTPUT, key="user", parallelism=2, storage_options=fs_options,
                            options={"upload.timeout": "20 s"})
    out = []
    for users in (["a", "b", "a", "c"], ["a", "c", "d"]):
        stream.run(spark.createDataFrame(pd.DataFrame({"user": users})))
    for b in (0, 1):
        # the same dict pandas takes: storage_options means what it means there
        df = pd.read_parquet(f"{base}/output/batch_id={b}", storage_options=fs_options)
        out.extend(sorted(zip(df["user"], df["n"].astype(int).tolist())))
    plan = stream.coordinator.plan(stream.coordinator.next_batch, 2)
    state = read_state_pandas(base, "n", storage_options=fs_options)
    spark_state = read_state(spark, base, "n", storage_options=fs_options).toPandas()
    reprs = [repr(stream.storage_config), repr(stream.coordinator.storage_config), repr(plan), repr(vars(stream))]
    stream.close()
    spark.stop()
    print(json.dumps({"output": out, "reprs": reprs,
                      "state": sorted((k, v) for k, v in zip(state["key"], state["value"])),
                      "spark_state": sorted((k, v) for k, v in zip(spark_state["key"], spark_state["value"]))}))


if __name__ == "__main__":
    main(sys.argv[1], sys.argv[2])
