"""One run of a job that writes checkpoints, without Spark: the driver's CheckpointCoordinator and the
real task body (dstl.spark.task.run_subtask) in one process. Two of these started at once on one
base path are two concurrent writers (tests/test_fencing.py).

    python writer_race.py BASE BATCHES BARRIER_DIR NAME [RUNS]

Every batch b holds ROWS events (key = (b * 7 + j) % KEYS); the operator keeps a running count per
key and outputs (key, count) after each event's batch. The run waits at the barrier until the other
run has opened too, then processes batches from the job's next batch to BATCHES - 1. It prints
`WON` or `LOST <error>` (exit 3 when another run holds the base path). RUNS (default 2): how many
runs meet at the barrier (1: no other run). Environment: RACE_UPLOAD_MODE (default thread) and
RACE_FS_OPTIONS (JSON: fsspec options for the base path, e.g. credentials and endpoint).
"""
from __future__ import annotations

import os
import sys
import time

KEYS = 50
ROWS = 40
PARALLELISM = 2
MAXP = 16


def batch_rows(b: int):
    import pandas as pd

    return pd.DataFrame({"key": [(b * 7 + j) % KEYS for j in range(ROWS)]}, dtype="int64")


def expected(batches: int):
    """(final count per key, every output row (batch, key, count)) recomputed with pandas."""
    import pandas as pd

    frames = [batch_rows(b).assign(batch=b) for b in range(batches)]
    events = pd.concat(frames, ignore_index=True)
    counts = events.groupby("key").size().to_dict()
    per_batch = events.groupby(["batch", "key"]).size().groupby(level="key").cumsum()
    rows = sorted((int(b), int(k), int(c)) for (b, k), c in per_batch.items())
    return counts, rows


def count_fn(rows, state):
    import pandas as pd

    s = state.value_state("count")
    out = []
    for key, n in rows.groupby("key").size().items():
        c = int(s.get(int(key), 0)) + int(n)
        s.update(int(key), c)
        out.append((int(key), c))
    return pd.DataFrame(out, columns=["key", "count"])


def spec(base: str):
    from dstl.spark.coordinator import JobSpec

    return JobSpec.new("race-op", MAXP, f"{base.rstrip('/')}/output", {"kind": "writer_race"})


def options(base: str):
    """dstl's storage options (`options=`); a generous upload timeout: a loaded 2-core machine
    starts S3 clients slowly."""
    return {"upload.mode": os.environ.get("RACE_UPLOAD_MODE", "thread"), "upload.timeout": "20 s"}


def storage_options():
    """The file system's keyword arguments (`storage_options=`), from RACE_FS_OPTIONS."""
    import json

    return json.loads(os.environ.get("RACE_FS_OPTIONS") or "{}")


def run(base: str, batches: int, barrier: str, name: str, runs: int = 2) -> int:
    import pyarrow as pa

    from dstl.keygroups import assign_key_groups, operator_indices_for_key_groups
    from dstl.spark.coordinator import CheckpointCoordinator
    from dstl.spark.report import TaskReport
    from dstl.spark.task import run_subtask
    from dstl.state.fencing import BasePathInUseError

    schema = pa.schema([("key", pa.int64()), ("count", pa.int64())])
    from dstl.changelog.fs import StoreUnreachableError, probe_base_path, root_of

    from dstl.config import register_storage_options

    register_storage_options(base, storage_options())  # the probe and the job-file check use them
    try:
        probe_base_path(base)
        fs, root = root_of(base)
        coord = CheckpointCoordinator.open(base, spec(base), options(base), storage_options=storage_options(),
                                           resume=fs.exists(f"{root}/_dstl_job.json"))
        open(os.path.join(barrier, name), "w").close()
        deadline = time.monotonic() + 60
        while len(os.listdir(barrier)) < runs and time.monotonic() < deadline:
            time.sleep(0.01)
        for b in range(coord.next_batch, batches):
            plan = coord.plan(b, PARALLELISM)
            rows = batch_rows(b)
            sub = operator_indices_for_key_groups(assign_key_groups(rows["key"], MAXP), MAXP, PARALLELISM)
            reports = [TaskReport(**run_subtask(plan, count_fn, rows[sub == i].reset_index(drop=True), i, 0, schema))
                       for i in range(PARALLELISM)]
            coord.complete(plan, reports)
        coord.finish()
    except BasePathInUseError as exc:
        print(f"LOST {exc}", flush=True)
        return 3
    except StoreUnreachableError as exc:
        print(f"UNREACHABLE {exc}", flush=True)
        return 4
    print("WON", flush=True)
    return 0


if __name__ == "__main__":
    if os.environ.get("RACE_LOG"):  # dstl's own log lines, all of them, to a file
        import logging

        handler = logging.FileHandler(os.environ["RACE_LOG"])
        handler.setFormatter(logging.Formatter("%(asctime)s %(name)s %(levelname)s %(message)s"))
        logging.getLogger("dstl").addHandler(handler)
        logging.getLogger("dstl").setLevel(logging.DEBUG)
    sys.exit(run(sys.argv[1], int(sys.argv[2]), sys.argv[3], sys.argv[4],
                 int(sys.argv[5]) if len(sys.argv) > 5 else 2))
