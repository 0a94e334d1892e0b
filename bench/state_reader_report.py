"""Prints `read_state` throughput (live values per second) for a changelog of a chosen size, on local
Spark and with the pandas reader in this process.

The job: value state, `--keys` keys updated round after round with 100-byte values until the
changelog holds `--size-mb` MB, at parallelism 4 / max parallelism 128, logged only (no
materialization), so a read replays the whole changelog. Spark reads one task per key-group range
(`--tasks`, default 4) on `local[N]` and the rows are counted on the executors
(`df.count()` after a `mapInPandas` that builds every row); the pandas reader builds the same rows in
one process. Medians of `--repeat` runs after one warm-up.

Usage: .venv/bin/python bench/state_reader_report.py [--size-mb 1024] [--keys 2000000] [--repeat 3]
"""
from __future__ import annotations

import argparse
import os
import shutil
import sys
import tempfile
import time

sys.path.insert(0, os.path.dirname(__file__))
from _timing import median_seconds  # noqa: E402

VALUE = 100
JOB = "be7c4be7c4be7c4be7c4be7c4be7c4be"


def build(base: str, size_mb: int, keys: int, parallelism: int = 4, maxp: int = 128) -> dict:
    """Write the job's checkpoint 1; returns what it holds."""
    import numpy as np

    from dstl.changelog.storage import open_storage
    from dstl.keygroups import assign_key_groups, key_group_ranges, operator_indices_for_key_groups
    from dstl.state import CheckpointMetadata, KeyedStateBackend, SubtaskState, write_checkpoint

    storage = open_storage(base, upload_mode="direct", job_id=JOB)
    ranges = key_group_ranges(maxp, parallelism)
    backends = [KeyedStateBackend(storage, "bench", r, maxp) for r in ranges]
    all_keys = np.arange(keys, dtype=np.int64)
    owner = operator_indices_for_key_groups(assign_key_groups(all_keys, maxp), maxp, parallelism)
    parts = [all_keys[owner == i] for i in range(parallelism)]
    states = [b.value_state("v") for b in backends]
    target = size_mb * 1_000_000
    written = changes = rounds = 0
    chunk = 200_000
    while written < target:
        for i, (st, ks) in enumerate(zip(states, parts)):
            for s in range(0, len(ks), chunk):
                part = ks[s:s + chunk]
                vals = np.full(len(part), (b"%02d" % (rounds % 100)) * (VALUE // 2), dtype=f"S{VALUE}")
                st.update_many(part, vals)
                changes += len(part)
                written += len(part) * (VALUE + 12)
                if written >= target:
                    break
            if written >= target:
                break
        rounds += 1
    snaps = [b.snapshot(1).result() for b in backends]
    meta = CheckpointMetadata(1, maxp, parallelism, [SubtaskState.from_keyed_snapshot(i, s)
                                                     for i, s in enumerate(snaps)], {"batch": 0}, job_id=JOB)
    write_checkpoint(base, meta)
    for b in backends:
        b.confirm(1)
        b.close()
    storage.close()
    files = {f: os.path.getsize(f) for f in meta.files()}
    return {"changes": changes, "bytes": sum(files.values()), "files": len(files),
            "live": min(keys, changes)}


def main() -> int:
    ap = argparse.ArgumentParser()
    ap.add_argument("--size-mb", type=int, default=64, help="changelog size in MB (1024 for the documented figure)")
    ap.add_argument("--keys", type=int, default=None, help="distinct keys = live values (default: size/400 B)")
    ap.add_argument("--tasks", type=int, default=4)
    ap.add_argument("--master", default="local[2]")
    ap.add_argument("--repeat", type=int, default=3)
    ap.add_argument("--skip-pandas", action="store_true")
    args = ap.parse_args()
    keys = args.keys or max(1000, args.size_mb * 1_000_000 // 400)
    from dstl import IMPLEMENTATION

    d = tempfile.mkdtemp(prefix="dstl-bench-read-state-")
    try:
        base = os.path.join(d, "job")
        t0 = time.perf_counter()
        info = build(base, args.size_mb, keys)
        print(f"read_state benchmark ({IMPLEMENTATION}): changelog {info['bytes'] / 1e6:,.0f} MB in {info['files']} "
              f"files, {info['changes']:,} changes, {info['live']:,} live values (written in "
              f"{time.perf_counter() - t0:.0f} s); shared 2-core machine: numbers are noisy")
        os.environ.setdefault("PYSPARK_PYTHON", sys.executable)
        os.environ.setdefault("SPARK_LOCAL_IP", "127.0.0.1")
        from pyspark.sql import SparkSession

        from dstl.spark import read_state
        from dstl.state import read_state_pandas

        spark = (SparkSession.builder.master(args.master).appName("dstl-bench-read-state")
                 .config("spark.ui.enabled", "false").config("spark.driver.host", "127.0.0.1")
                 .config("spark.sql.execution.arrow.pyspark.enabled", "true")
                 .config("spark.driver.memory", "3g").getOrCreate())
        try:
            counted = []
            t_spark = median_seconds(lambda: counted.append(read_state(spark, base, tasks=args.tasks).count()),
                                     args.repeat)
            assert counted[-1] == info["live"], (counted[-1], info["live"])
            print(f"  Spark read_state, {args.tasks} tasks on {args.master}: {t_spark:8.2f} s  "
                  f"{info['live'] / t_spark:12,.0f} live values/s  {info['bytes'] / 1e6 / t_spark:8.1f} MB/s of changelog")
        finally:
            spark.stop()
        if not args.skip_pandas:
            t_pd = median_seconds(lambda: read_state_pandas(base), max(1, args.repeat - 2), warmup=0)
            print(f"  read_state_pandas, one process:      {t_pd:8.2f} s  {info['live'] / t_pd:12,.0f} live values/s  "
                  f"{info['bytes'] / 1e6 / t_pd:8.1f} MB/s of changelog")
            print(f"  Spark / pandas speed-up: {t_pd / t_spark:.2f}x")
    finally:
        shutil.rmtree(d, ignore_errors=True)
    return 0


if __name__ == "__main__":
    sys.exit(main())
