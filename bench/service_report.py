"""Upload service benchmark: `process` vs `thread` mode on one workload, in one run.

Default workload: 4 writer processes x 1,000,000 changes of 100 bytes, persist every 50,000.
Prints, per configuration (payload kind x compression): total MB/s, files written, writer-process CPU
time per MB (user + system, every thread of the writer processes), the ratio process/thread of that
CPU (goal <= 0.5), and for process mode the hand-off cost: descriptor round-trip latency and bytes
copied into shared memory per MB uploaded (goal: one copy, ~1.04 MB/MB including framing).

Usage: .venv/bin/python bench/service_report.py [--writers 4] [--changes 1000000] [--every 50000]
       [--repeat 1] [--configs random:off,random:snappy,records:snappy]
"""
from __future__ import annotations

import argparse
import os
import statistics
import sys

sys.path.insert(0, os.path.dirname(os.path.abspath(__file__)))
from _service_workload import run_mode  # noqa: E402


def _median(runs, key):
    return statistics.median(r[key] for r in runs)


def main(argv=None) -> int:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--writers", type=int, default=4)
    ap.add_argument("--changes", type=int, default=1_000_000)
    ap.add_argument("--every", type=int, default=50_000)
    ap.add_argument("--size", type=int, default=100)
    ap.add_argument("--repeat", type=int, default=1)
    ap.add_argument("--configs", default="random:off,random:snappy,records:snappy")
    args = ap.parse_args(argv)
    print(f"workload: {args.writers} writer processes x {args.changes:,} x {args.size}-byte changes, "
          f"persist every {args.every:,}; medians of {args.repeat} run(s)")
    header = (f"{'payload':8} {'codec':6} {'mode':8} {'MB/s':>7} {'files':>6} {'persists':>8} "
              f"{'writer CPU s':>12} {'ms CPU/MB':>9} {'svc CPU s':>9}")
    print(header)
    for cfg in args.configs.split(","):
        payload, codec = cfg.split(":")
        res = {}
        for mode in ("thread", "process"):
            runs = [run_mode(mode, args.writers, args.changes, args.every, args.size, codec != "off", payload)
                    for _ in range(args.repeat)]
            res[mode] = runs
            svc = f"{_median(runs, 'service_cpu_s'):9.2f}" if mode == "process" else f"{'-':>9}"
            print(f"{payload:8} {codec:6} {mode:8} {_median(runs, 'mb_per_s'):7.0f} {_median(runs, 'files'):6.0f} "
                  f"{_median(runs, 'persists'):8.0f} {_median(runs, 'writer_cpu_s'):12.2f} "
                  f"{_median(runs, 'writer_cpu_s_per_mb') * 1000:9.3f} {svc}")
        ratio = _median(res["process"], "writer_cpu_s_per_mb") / max(1e-9, _median(res["thread"], "writer_cpu_s_per_mb"))
        p = res["process"]
        print(f"  -> writer CPU per MB, process / thread = {ratio:.2f} (goal <= 0.50: "
              f"{'met' if ratio <= 0.5 else 'NOT met'}); throughput process / thread = "
              f"{_median(p, 'mb_per_s') / _median(res['thread'], 'mb_per_s'):.2f}")
        print(f"  -> hand-off: descriptor round trip p50 {_median(p, 'ping_p50_us'):.0f} us "
              f"(p99 {_median(p, 'ping_p99_us'):.0f} us, measured right after the load); "
              f"{_median(p, 'copied_mb_per_mb'):.3f} MB copied into shared memory per MB uploaded; "
              f"{_median(p, 'descriptor_bytes_per_mb'):.0f} socket bytes per MB")
    return 0


if __name__ == "__main__":
    sys.exit(main())
