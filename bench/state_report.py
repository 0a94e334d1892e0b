"""Prints keyed-state throughput: ValueState.update_many (changelog appends included) and restore of a
changelog into a quarter of the key groups, with and without materialization. Medians of a few runs.

Usage: .venv/bin/python bench/state_report.py [--updates N] [--repeat R] [--restore-mb MB]
Target: >= 2 M updates/s through ValueState bulk update, appends included.
"""
from __future__ import annotations

import argparse
import os
import statistics
import sys
import time

sys.path.insert(0, os.path.dirname(__file__))
sys.path.insert(0, os.path.join(os.path.dirname(__file__), ".."))
import _state_data as sd  # noqa: E402

import dstl  # noqa: E402

GOAL_UPDATES_PER_S = 2e6


def main(argv=None) -> int:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--updates", type=int, default=2_000_000)
    ap.add_argument("--users", type=int, default=100_000)
    ap.add_argument("--batch", type=int, default=100_000)
    ap.add_argument("--repeat", type=int, default=3)
    ap.add_argument("--restore-mb", type=int, default=1024)
    ap.add_argument("--restore-repeat", type=int, default=2)
    args = ap.parse_args(argv)
    print(f"dstl implementation: {dstl.IMPLEMENTATION}; {os.cpu_count()} CPUs (shared)")
    print()
    print(f"ValueState.update_many: {args.updates:,} updates over {args.users:,} keys, batches of "
          f"{args.batch:,}, thread upload mode; median of {args.repeat}")
    print()
    print("| keys | M updates/s, wall (appends incl.) | M updates/s per CPU-second | final persist (s) | "
          "wall vs goal 2 M/s |")
    print("|---|---|---|---|---|")
    rates = {}
    for label, string_keys in (("int64 (numpy)", False), ("str (pandas object)", True)):
        keys, values = sd.update_workload(args.updates, args.users, string_keys)
        runs = [sd.run_updates(keys, values, args.batch) for _ in range(args.repeat)]
        rate = statistics.median(r["updates"] / r["update_s"] for r in runs)
        cpu_rate = statistics.median(r["updates"] / r["update_cpu_s"] for r in runs)
        persist = statistics.median(r["persist_s"] for r in runs)
        rates[label] = rate
        print(f"| {label} | {rate / 1e6:.2f} | {cpu_rate / 1e6:.2f} | {persist:.2f} | "
              f"{rate / GOAL_UPDATES_PER_S:.2f}x |")
    verdict = "met" if rates["int64 (numpy)"] >= GOAL_UPDATES_PER_S else "NOT met"
    print(f"\ngoal >= 2 M updates/s (int keys): {verdict}")
    if args.restore_mb <= 0:
        return 0
    print()
    t0 = time.perf_counter()
    cl = sd.build_changelog(args.restore_mb, users=args.users)
    build = time.perf_counter() - t0
    print(f"restore: changelog of {cl.logical_bytes / 2**20:,.0f} MB ({cl.changes:,} value changes of ~100 B "
          f"over {args.users:,} keys, written in {build:.0f} s) into a quarter of the key groups "
          f"{sd.QUARTER}; median of {args.restore_repeat}")
    print()
    print("| restore from | files (MB) | wall s | CPU s | MB/s read (wall) | changes read | changes applied | "
          "changes read/s (wall) | keys restored |")
    print("|---|---|---|---|---|---|---|---|---|")
    try:
        for which, label in (("plain", "changelog only"), ("materialized", "materialization + 1% tail")):
            runs = [sd.run_restore(cl, which) for _ in range(args.restore_repeat)]
            s = statistics.median(r["seconds"] for r in runs)
            cpu = statistics.median(r["cpu_seconds"] for r in runs)
            r = runs[0]
            mb = r["files_bytes"] / 2**20
            print(f"| {label} | {mb:,.0f} | {s:.2f} | {cpu:.2f} | {mb / s:,.0f} | {r['changes_read']:,} | "
                  f"{r['changes_applied']:,} | {r['changes_read'] / s / 1e6:.2f} M | {r['keys']:,} |")
    finally:
        sd.drop_changelog(cl)
    return 0


if __name__ == "__main__":
    sys.exit(main())
