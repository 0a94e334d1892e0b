"""A driver for tests/test_pyspark_memory.py: StatefulStream on local[1] under spark.executor.pyspark.memory.

    python pyspark_memory_driver.py BASE MEMORY FIRST LAST KEYS_PER_BATCH [--keys int|str]

Runs batches FIRST..LAST-1 through `stream.run` (a job at BASE is resumed from its last checkpoint).
Batch b holds the keys [b * KEYS_PER_BATCH // 2, b * KEYS_PER_BATCH // 2 + KEYS_PER_BATCH): half of
them seen in batch b-1, half new. `count_keys` counts every key in one value state and emits
(key, count) per row. Prints one JSON line per batch: {"batch": b, "ok": true} or, on failure,
{"batch": b, "ok": false, "type": ..., "first_line": ..., "slots_alive": n} (the slots still running
10 s after the failure, with Spark's workers alive), and exits 3 after a failure.
"""
from __future__ import annotations

import json
import os
import sys


def keys_of(batch: int, per_batch: int, kind: str):
    start = batch * per_batch // 2
    ks = range(start, start + per_batch)
    return list(ks) if kind == "int" else [f"key-{k:012d}" for k in ks]


def count_keys(rows, state):
    import pandas as pd

    counts = state.value_state("count")
    keys = rows["k"]
    total = [c + 1 for c in counts.get_many(keys, 0)]
    counts.update_many(keys, total)
    return pd.DataFrame({"k": keys, "n": total})


def live_slots(wait_s: float) -> int:
    """Slots of this runtime directory still running after up to `wait_s` seconds (a slot removes its
    pid file when it exits)."""
    import time

    from dstl.changelog.upload.service.runtime import pid_alive
    from dstl.spark.slot_client import slots_dir

    deadline = time.monotonic() + wait_s
    while True:
        alive = 0
        for name in os.listdir(slots_dir()):
            if name.endswith(".pid"):
                try:
                    with open(os.path.join(slots_dir(), name)) as f:
                        alive += pid_alive(int(f.read().strip()))
                except (OSError, ValueError):
                    continue
        if not alive or time.monotonic() > deadline:
            return alive
        time.sleep(0.2)


def main(argv) -> int:
    base, memory, first, last, per_batch = argv[0], argv[1], int(argv[2]), int(argv[3]), int(argv[4])
    kind = argv[6] if len(argv) > 6 and argv[5] == "--keys" else "int"
    os.environ["PYSPARK_PYTHON"] = sys.executable
    import pandas as pd

    from driver_util import driver_session
    from dstl.spark import StatefulStream

    spark = driver_session("local[1]", "dstl-pyspark-memory",
                           conf=[f"spark.executor.pyspark.memory={memory}", "spark.sql.shuffle.partitions=1"])
    key_type = "long" if kind == "int" else "string"
    stream = StatefulStream(base, count_keys, f"k {key_type}, n long", key="k", parallelism=1)
    try:
        for b in range(first, last):
            df = spark.createDataFrame(pd.DataFrame({"k": keys_of(b, per_batch, kind)}), f"k {key_type}")
            try:
                result = stream.run(df)
            except Exception as exc:  # noqa: BLE001 - what the driver saw is the test's result
                # Spark's workers still run: a slot gone now left because its state outgrew the limit
                print(json.dumps({"batch": b, "ok": False, "type": type(exc).__name__,
                                  "first_line": str(exc).splitlines()[0] if str(exc) else "",
                                  "slots_alive": live_slots(10.0)}), flush=True)
                return 3
            print(json.dumps({"batch": b, "ok": True, "batch_id": result.batch_id}), flush=True)
    finally:
        spark.stop()
    return 0


if __name__ == "__main__":
    sys.exit(main(sys.argv[1:]))
