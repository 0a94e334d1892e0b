"""A driver for the routing tests: StatefulStream over micro-batches generated on the executors.

    python route_driver.py RESULT_JSON --master M --parallelism P --batches B --base BASE
                           --rows N --keys K --payload BYTES [--eventlog DIR --conf K=V ...
                           --probe-broadcast]

Batch b holds the ids b*N .. (b+1)*N-1 of `spark.range` (4 partitions), built on the executors:
user ``u{id * 7919 % K}``, kind, value ``id % 10`` and a payload of BYTES (rounded up to 128) hex characters per row, so
the driver never holds a batch. Each batch goes through `stream.run` with the vectorised
`count_fn`. With --probe-broadcast the driver first tries to broadcast batch 0 to a placed stage
(the route `StatefulStream` used for every batch before) and records whether Spark refused it.
Writes per batch the route, the placement figures and every task report to RESULT_JSON.
"""
from __future__ import annotations

import argparse
import json
import logging
import os
import sys


def batch_keys(b: int, keys: int, growing: bool) -> int:
    """How many keys batch b spreads its rows over: `keys`, or with `growing` (b + 1) * `keys`."""
    return keys * (b + 1) if growing else keys


def batch_df(spark, b: int, rows: int, keys: int, payload: int, growing: bool = False):
    from pyspark.sql import functions as F

    ids = spark.range(b * rows, (b + 1) * rows, 1, numPartitions=4)
    return ids.select(
        F.concat(F.lit("u"), (F.col("id") * 7919 % batch_keys(b, keys, growing)).cast("string")).alias("user"),
        F.element_at(F.array(F.lit("a"), F.lit("b"), F.lit("c")), (F.col("id") % 3 + 1).cast("int")).alias("kind"),
        (F.col("id") % 10).alias("value"), F.col("id").alias("ts_ms"),
        # distinct hashes: a broadcast's collect compresses what it ships, and repeated text shrinks
        F.concat(*[F.sha2(F.concat(F.col("id").cast("string"), F.lit(f"/{j}")), 512)
                   for j in range(-(-payload // 128))]).alias("payload"))


def probe_broadcast(spark, df, parallelism: int) -> str:
    """'' if Spark broadcast `df` to a placed stage, else the first line of its error."""
    from dstl.spark.routing import SUBTASK_COL
    from dstl.spark.session import SubtaskStage
    from pyspark.sql import functions as F

    def count(batches):  # pragma: no cover - runs in the Python worker
        import pandas as pd

        yield pd.DataFrame({"n": [sum(len(b) for b in batches)]})

    stage = SubtaskStage(spark, parallelism)
    try:
        keyed = df.withColumn(SUBTASK_COL, (F.col("ts_ms") % parallelism).cast("int"))
        stage.run(keyed, SUBTASK_COL, count, "n long", route="broadcast").collect()
        return ""
    except Exception as exc:  # noqa: BLE001 - the point of the probe
        lines = [ln.strip() for ln in str(exc).splitlines() if ln.strip()] or [type(exc).__name__]
        # py4j's first line names only the call; Spark's reason is further down
        return next((ln for ln in lines if "maxResultSize" in ln), lines[0])[:400]
    finally:
        stage.close()


def main(argv) -> int:
    p = argparse.ArgumentParser()
    p.add_argument("result")
    p.add_argument("--master", required=True)
    p.add_argument("--parallelism", type=int, required=True)
    p.add_argument("--batches", type=int, required=True)
    p.add_argument("--base", required=True)
    p.add_argument("--rows", type=int, required=True)
    p.add_argument("--keys", type=int, required=True)
    p.add_argument("--payload", type=int, default=0)
    p.add_argument("--eventlog")
    p.add_argument("--conf", action="append", default=[])
    p.add_argument("--probe-broadcast", action="store_true")
    p.add_argument("--growing", action="store_true", help="batch b spreads over (b + 1) * K keys: the state grows")
    a = p.parse_args(argv)
    os.environ["PYSPARK_PYTHON"] = sys.executable
    logging.basicConfig(stream=sys.stderr, level=logging.WARNING, format="%(name)s %(levelname)s %(message)s")
    logging.getLogger("dstl.spark.placement").setLevel(logging.INFO)

    import processors
    from dstl.spark import StatefulStream
    from driver_util import driver_session

    spark = driver_session(a.master, "dstl-route", a.eventlog, a.conf)
    out = {"probe": None, "batches": []}
    try:
        if a.probe_broadcast:
            out["probe"] = probe_broadcast(spark, batch_df(spark, 0, a.rows, a.keys, a.payload), a.parallelism)
        stream = StatefulStream(a.base, processors.count_fn, processors.COUNT_OUTPUT, key="user",
                                parallelism=a.parallelism)
        for i in range(a.batches):
            res = stream.run(batch_df(spark, i, a.rows, a.keys, a.payload, a.growing))
            out["batches"].append({
                "batch": res.batch_id, "route": res.route, "seconds": res.seconds,
                "placement": res.stats.placement,
                "reports": [{k: getattr(r, k) for k in (
                    "subtask", "attempt", "executor", "pid", "continued", "restored", "rows_in",
                    "rows_out", "restore_ms", "start_ms", "hop_ms", "state_size")} for r in res.reports]})
        stream.close()
    finally:
        with open(a.result, "w") as f:
            json.dump(out, f, indent=1)
        spark.stop()
    return 0


if __name__ == "__main__":
    sys.exit(main(sys.argv[1:]))
