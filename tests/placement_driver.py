"""A driver for the placement tests and measurements: StatefulStream over generated batches.

    python placement_driver.py RESULT_JSON --master M --parallelism P --batches B --base BASE
                               [--events N --keys K --eventlog DIR --first-batch F --conf K=V ...]

Runs batches F..B-1 of tests/streaming_util.make_batches through `stream.run` with the vectorised
`count_fn` (one checkpoint each; a job already at BASE is resumed, at any parallelism), then writes
per batch what the driver saw (seconds, placement figures, every task report) to RESULT_JSON. Faults
come from DSTL_FAULTS (dstl.spark.faults). dstl's per-batch INFO line goes to stderr.
"""
from __future__ import annotations

import argparse
import json
import logging
import os
import sys


def main(argv) -> int:
    p = argparse.ArgumentParser()
    p.add_argument("result")
    p.add_argument("--master", required=True)
    p.add_argument("--parallelism", type=int, required=True)
    p.add_argument("--batches", type=int, required=True)
    p.add_argument("--first-batch", type=int, default=0)
    p.add_argument("--base", required=True)
    p.add_argument("--events", type=int, default=400)
    p.add_argument("--keys", type=int, default=60)
    p.add_argument("--eventlog")
    p.add_argument("--conf", action="append", default=[])
    a = p.parse_args(argv)
    os.environ["PYSPARK_PYTHON"] = sys.executable
    logging.basicConfig(stream=sys.stderr, level=logging.WARNING, format="%(name)s %(levelname)s %(message)s")
    logging.getLogger("dstl.spark.placement").setLevel(logging.INFO)

    import processors
    from dstl.spark import StatefulStream
    from driver_util import driver_session
    from streaming_util import EVENTS_SCHEMA, make_batches

    spark = driver_session(a.master, "dstl-placement", a.eventlog, a.conf)
    batches = make_batches(a.batches, a.events, a.keys)
    stream = StatefulStream(a.base, processors.count_fn, processors.COUNT_OUTPUT, key="user",
                            parallelism=a.parallelism)
    out = []
    try:
        for i in range(a.first_batch, a.batches):
            res = stream.run(spark.createDataFrame(batches[i], EVENTS_SCHEMA))
            out.append({"batch": res.batch_id, "route": res.route, "seconds": res.seconds, "phases_ms": res.phases_ms,
                        "placement": res.stats.placement,
                        "reports": [{k: getattr(r, k) for k in (
                            "subtask", "attempt", "executor", "pid", "continued", "restored", "restore_ms",
                            "restore_source", "rows_in", "process_ms", "snapshot_ms", "hop_ms")} for r in res.reports]})
        stream.close()
    finally:
        with open(a.result, "w") as f:
            json.dump(out, f, indent=1)
        spark.stop()
    return 0


if __name__ == "__main__":
    sys.exit(main(sys.argv[1:]))
