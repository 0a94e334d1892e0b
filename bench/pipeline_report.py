"""The pipeline with dstl state vs the same operator keeping state only in memory, in one run.

Usage: .venv/bin/python bench/pipeline_report.py [--events 5000000] [--batches 20] [--parallelism 2]

Prints, from one Spark session (local[2,4]):
* events/s of both (all batches, and after the first batch, which also pays Python worker start-up),
  and the ratio dstl / memory (goal: dstl costs at most 15%);
* checkpoint duration p50/p99 (goal: p99 < 1 s on local disk);
* the restore time of the task retried after `--fail-at` (a separate run that stops after the failure).
The machine is shared with other work, so the two jobs run in the same Spark session with their
batches interleaved (memory, dstl, dstl, memory, ...): background load hits both alike.
"""
from __future__ import annotations

import argparse
import io
import os
import shutil
import statistics
import sys
import tempfile
import time

sys.path.insert(0, os.path.dirname(os.path.dirname(os.path.abspath(__file__))))

from dstl.app import pipeline  # noqa: E402


def _run(spark, argv):
    p = argparse.ArgumentParser()
    pipeline.add_arguments(p)
    opts = pipeline.check_options(p.parse_args(["--quiet", *argv]))
    return pipeline.run_pipeline(opts, spark=spark, stream=io.StringIO())


def _job(spark, mode: str, base: str, source, parallelism: int, materialize_every: int):
    from dstl.config import StorageConfig
    from dstl.keygroups import compute_default_max_parallelism
    from dstl.app.activity import output_ddl, user_activity
    from dstl.spark.coordinator import CheckpointCoordinator, JobSpec
    from dstl.spark.job import StatefulJob

    spec = JobSpec.new(f"user-activity-{mode}", compute_default_max_parallelism(parallelism), f"{base}/output",
                       source.params())
    storage = StorageConfig.from_options(base, upload_mode="thread").to_mapping()
    coord = CheckpointCoordinator.open(base, spec, storage, resume=False, durable=mode == "dstl",
                                       backend_options={"materialize_every_changes": materialize_every})
    return coord, StatefulJob(coord, user_activity, output_ddl(), key="user_id", parallelism=parallelism,
                              order_by=["ts", "event_id"], spark=spark, events_schema=pipeline.EVENTS_DDL.format(
                                  user="long", item="long"))


def main(argv=None) -> int:
    from dstl.app.source import SyntheticSource

    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--events", type=int, default=5_000_000)
    ap.add_argument("--batches", type=int, default=20)
    ap.add_argument("--parallelism", type=int, default=2)
    ap.add_argument("--users", type=int, default=50_000)
    ap.add_argument("--items", type=int, default=5_000)
    ap.add_argument("--materialize-every", type=int, default=200_000)
    ap.add_argument("--no-restore", action="store_true", help="skip the --fail-at run")
    a = ap.parse_args(argv)
    spark = pipeline.spark_session("local[2,4]")
    source = SyntheticSource(a.events, a.batches, a.users, a.items)
    tmp = tempfile.mkdtemp(prefix="dstl-bench-pipeline-")
    seconds = {"memory": [], "dstl": []}
    results = []
    try:
        # start the per-subtask Python worker pools first, so neither job pays that in its first batch
        _run(spark, ["--events", "20000", "--batches", "2", "--parallelism", str(a.parallelism), "--state",
                     "memory", "--base-path", os.path.join(tmp, "warm-up")])
        jobs = {m: _job(spark, m, os.path.join(tmp, m), source, a.parallelism, a.materialize_every)
                for m in ("memory", "dstl")}
        # the two jobs alternate batch by batch, so load from other work on the machine hits both alike
        for b in range(a.batches):
            pdf = source.batch(b)
            for mode in (("memory", "dstl") if b % 2 == 0 else ("dstl", "memory")):
                res = jobs[mode][1].run_batch(pdf)
                seconds[mode].append(res.seconds)
                if mode == "dstl":
                    results.append(res)
            print(f"batch {b:2d}: memory {seconds['memory'][-1]:.2f} s, dstl {seconds['dstl'][-1]:.2f} s "
                  f"(task process {max(r.process_ms for r in results[-1].reports):.0f} ms, snapshot "
                  f"{max(r.snapshot_ms for r in results[-1].reports):.0f} ms)", flush=True)
        jobs["dstl"][0].finish()
        files = jobs["dstl"][0].changelog_files()
        restore = None
        if not a.no_restore:
            fail_at = a.batches // 2
            rep = _run(spark, ["--events", str(a.events), "--batches", str(a.batches), "--users", str(a.users),
                               "--items", str(a.items), "--parallelism", str(a.parallelism),
                               "--base-path", os.path.join(tmp, "restore"), "--fail-at", str(fail_at),
                               "--stop-at", str(fail_at)])
            restore = rep.fail_restore_ms
    finally:
        shutil.rmtree(tmp, ignore_errors=True)
        spark.stop()

    n = a.events
    warm_n = n - len(source.batch(0))
    rate = {m: n / sum(v) for m, v in seconds.items()}
    warm = {m: warm_n / sum(v[1:]) for m, v in seconds.items()}
    cps = [r.checkpoint_ms for r in results]
    hits = sum(r.cache_hits for r in results)
    print()
    print(f"pipeline: {n:,} events, {a.batches} batches, parallelism {a.parallelism}, {a.users:,} users, "
          f"local[2,4], implementation {__import__('dstl').IMPLEMENTATION}; batches of both jobs interleaved")
    print(f"  events/s memory {rate['memory']:,.0f}  dstl {rate['dstl']:,.0f}  ratio "
          f"{rate['dstl'] / rate['memory']:.2f} (cost {100 * (1 - rate['dstl'] / rate['memory']):.0f}%; goal <= 15%)")
    print(f"  after batch 0:  memory {warm['memory']:,.0f}  dstl {warm['dstl']:,.0f}  ratio "
          f"{warm['dstl'] / warm['memory']:.2f} (cost {100 * (1 - warm['dstl'] / warm['memory']):.0f}%)")
    print(f"  median batch    memory {statistics.median(seconds['memory']):.2f} s  dstl "
          f"{statistics.median(seconds['dstl']):.2f} s")
    print(f"  checkpoint      p50 {pipeline._pct(cps, .5):.0f} ms  p99 {pipeline._pct(cps, .99):.0f} ms  "
          f"max {max(cps):.0f} ms (goal p99 < 1000 ms)")
    print(f"  uploaded        {sum(r.stats.new_files for r in results)} files, "
          f"{sum(r.stats.new_bytes for r in results) / 2**20:.1f} MiB; {len(files)} files "
          f"({sum(files.values()) / 2**20:.1f} MiB) retained; worker cache {hits}/{len(results) * a.parallelism}")
    if restore is not None:
        print(f"  restore         {restore:.0f} ms for the task retried at batch {a.batches // 2} (--fail-at)")
    return 0


if __name__ == "__main__":
    sys.exit(main())
