"""The pipeline with dstl state vs the same operator keeping state only in memory, in one run.

Usage: .venv/bin/python bench/pipeline_report.py [--events 5000000] [--batches 20] [--parallelism 2]

Prints, from one Spark session (local[2,4]):
* events/s of both (all batches, and after the first batch, which also pays Python worker start-up),
  and the ratio dstl / memory (goal: dstl costs at most 15%);
* checkpoint duration p50/p99 (goal: p99 < 1 s on local disk);
* the restore time of the task retried after `--fail-at` (a separate run that stops after the failure).
The machine is shared with other work, so the rounds alternate memory/dstl and medians are quoted.
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

from dstl.spark import pipeline  # noqa: E402


def _run(spark, argv):
    p = argparse.ArgumentParser()
    pipeline.add_arguments(p)
    opts = pipeline.check_options(p.parse_args(["--quiet", *argv]))
    return pipeline.run_pipeline(opts, spark=spark, stream=io.StringIO())


def main(argv=None) -> int:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--events", type=int, default=5_000_000)
    ap.add_argument("--batches", type=int, default=20)
    ap.add_argument("--parallelism", type=int, default=2)
    ap.add_argument("--users", type=int, default=50_000)
    ap.add_argument("--items", type=int, default=5_000)
    ap.add_argument("--rounds", type=int, default=1, help="memory/dstl pairs (default 1)")
    ap.add_argument("--no-restore", action="store_true", help="skip the --fail-at run")
    a = ap.parse_args(argv)
    spark = pipeline.spark_session("local[2,4]")
    common = ["--events", str(a.events), "--batches", str(a.batches), "--users", str(a.users),
              "--items", str(a.items), "--parallelism", str(a.parallelism)]
    tmp = tempfile.mkdtemp(prefix="dstl-bench-pipeline-")
    results = {"memory": [], "dstl": []}
    try:
        # warm the Python worker pools once so neither mode pays their start-up in the first round
        _run(spark, ["--events", "20000", "--batches", "2", "--parallelism", str(a.parallelism), "--state",
                     "memory", "--base-path", os.path.join(tmp, "warm")])
        for r in range(a.rounds):
            for mode in ("memory", "dstl"):
                base = os.path.join(tmp, f"{mode}-{r}")
                t0 = time.perf_counter()
                rep = _run(spark, common + ["--state", mode, "--base-path", base])
                results[mode].append(rep)
                print(f"round {r} {mode:6s}: {rep.events_per_s:9,.0f} ev/s all batches, "
                      f"{rep.warm_events / rep.warm_seconds:9,.0f} ev/s after the first "
                      f"({time.perf_counter() - t0:.0f} s)", flush=True)
                shutil.rmtree(base, ignore_errors=True)
        restore = None
        if not a.no_restore:
            fail_at = a.batches // 2
            rep = _run(spark, common + ["--base-path", os.path.join(tmp, "restore"), "--fail-at", str(fail_at),
                                        "--stop-at", str(fail_at)])
            restore = rep.fail_restore_ms
    finally:
        shutil.rmtree(tmp, ignore_errors=True)
        spark.stop()

    def med(mode, f):
        return statistics.median(f(r) for r in results[mode])

    all_mem, all_dstl = med("memory", lambda r: r.events_per_s), med("dstl", lambda r: r.events_per_s)
    warm_mem = med("memory", lambda r: r.warm_events / r.warm_seconds)
    warm_dstl = med("dstl", lambda r: r.warm_events / r.warm_seconds)
    cps = [ms for r in results["dstl"] for ms in r.checkpoint_ms]
    print()
    print(f"pipeline: {a.events:,} events, {a.batches} batches, parallelism {a.parallelism}, "
          f"{a.users:,} users, {a.rounds} round(s), local[2,4], implementation {__import__('dstl').IMPLEMENTATION}")
    print(f"  events/s memory {all_mem:,.0f}  dstl {all_dstl:,.0f}  ratio {all_dstl / all_mem:.2f} "
          f"(cost {100 * (1 - all_dstl / all_mem):.0f}%; goal <= 15%)")
    print(f"  after batch 0:  memory {warm_mem:,.0f}  dstl {warm_dstl:,.0f}  ratio {warm_dstl / warm_mem:.2f} "
          f"(cost {100 * (1 - warm_dstl / warm_mem):.0f}%)")
    print(f"  checkpoint      p50 {pipeline._pct(cps, .5):.0f} ms  p99 {pipeline._pct(cps, .99):.0f} ms  "
          f"max {max(cps):.0f} ms (goal p99 < 1000 ms)")
    d = results["dstl"][-1]
    print(f"  uploaded        {d.uploaded_files} files, {d.uploaded_bytes / 2**20:.1f} MiB; state "
          f"{d.state_size / 2**20:.1f} MiB; worker cache {d.cache_hits}/{d.subtask_batches}")
    if restore is not None:
        print(f"  restore         {restore:.0f} ms for the task retried at batch {a.batches // 2} (--fail-at)")
    return 0


if __name__ == "__main__":
    sys.exit(main())
