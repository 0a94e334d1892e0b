"""Prints storage throughput and persist latency, with the plain-write ceiling measured in the same run.

Workloads (public API, local directory, default options, thread mode unless said otherwise):
  * one writer, N x 100-byte changes, append_many in 10,000-row calls (vectorised) and one
    append per change (objects), persist(initial) and wait; then read back (vectorised reader)
  * 8 writers appending and persisting concurrently through the batching scheduler
  * persist latency of small checkpoints (20 changes) with the default 10 ms persist delay
The ceiling is one `open(...).write` of as many bytes as our files hold; "fraction" = ceiling time /
our time (1.0 = as fast as the plain write), measured right after each run (for the single-writer
runs also as a ratio of process CPU time, all threads); dirty pages are
flushed (os.sync) before every timed run. The local disk and page cache dominate, so quote medians.

Usage: .venv/bin/python bench/storage_report.py [--changes N] [--repeat R] [--checkpoints C]
"""
from __future__ import annotations

import argparse
import os
import statistics
import sys

sys.path.insert(0, os.path.dirname(__file__))
import _storage_data as sd  # noqa: E402


def median(values):
    return statistics.median(values)


def pct(values, p):
    ordered = sorted(values)
    return ordered[min(len(ordered) - 1, int(round(p / 100 * (len(ordered) - 1))))]


def main() -> int:
    ap = argparse.ArgumentParser()
    ap.add_argument("--changes", type=int, default=1_000_000)
    ap.add_argument("--repeat", type=int, default=3)
    ap.add_argument("--checkpoints", type=int, default=200)
    args = ap.parse_args()
    from dstl import IMPLEMENTATION

    n = args.changes
    mb = n * sd.VALUE / 1e6
    kgs, data, offs = sd.make_data(n)
    print(f"storage benchmark: {n:,} changes x {sd.VALUE} B ({mb:.0f} MB payload), implementation "
          f"{IMPLEMENTATION}, medians of {args.repeat}")
    root = sd.tmpdir()
    try:
        # Interleave every workload with the ceiling, and flush dirty pages before each timed run, so
        # page-cache write-back left by one run does not land on the next one.
        labels = ["plain open().write (ceiling)", "1 writer, append_many, thread", "1 writer, append_many, direct",
                  "8 writers concurrently, batching", "1 writer, append per change"]
        times = {k: [] for k in labels}
        ratios = {k: [] for k in labels}
        # CPU time (all threads of the process) of the single-writer runs vs the plain write's:
        # less sensitive than wall time to other processes on a loaded machine
        cpu_ratios = {labels[1]: [], labels[2]: []}
        disk, handle, keep = 0, None, None
        for i in range(args.repeat):
            runs = [
                (labels[1], lambda b: sd.write_vectorised(b, kgs, data, offs)),
                (labels[2], lambda b: sd.write_vectorised(b, kgs, data, offs, mode="direct")),
                (labels[3], lambda b: sd.concurrent_writers(b, kgs, data, offs)),
            ]
            if i == 0:
                runs.append((labels[4], lambda b: sd.write_per_change(b, kgs, data)))
            for label, fn in runs:
                base = os.path.join(root, f"run-{i}-{labels.index(label)}")
                os.sync()
                out = fn(base)
                t = out[0]
                cpu = sd.LAST_CPU["seconds"] if label in cpu_ratios else None
                if label == labels[1]:
                    disk = out[2]
                    if keep is None:
                        keep, handle = base, out[1]
                os.sync()
                c = sd.plain_write_ceiling(os.path.join(root, "plain"), disk or int(n * sd.VALUE * 1.04))
                if cpu:
                    cpu_ratios[label].append(sd.LAST_CPU["seconds"] / cpu)
                times[label].append(t)
                times[labels[0]].append(c)
                ratios[label].append(c / t)
                if base != keep:
                    sd.cleanup(base)
        reads = [sd.read_back(keep, handle) for _ in range(args.repeat)]
        assert all(c == n for _, c in reads), "read back a different number of changes"
        print(f"  files on disk: {disk / 1e6:.1f} MB for {mb:.0f} MB payload")
        for label in labels:
            t = median(times[label])
            frac = f"  fraction of ceiling {median(ratios[label]):5.2f}" if ratios[label] else ""
            if cpu_ratios.get(label):
                frac += f" (CPU time {median(cpu_ratios[label]):4.2f})"
            print(f"  {label:36s} {t * 1000:9.1f} ms {mb / t:8.1f} MB/s {n / t / 1e6:6.2f} M changes/s{frac}")
        t_read = median([t for t, _ in reads])
        print(f"  {'read back (reader arrays)':36s} {t_read * 1000:9.1f} ms {mb / t_read:8.1f} MB/s "
              f"{n / t_read / 1e6:6.2f} M changes/s")

        for writers in (1, 4):
            lat = sd.persist_latencies(os.path.join(root, f"lat{writers}"), args.checkpoints, writers)
            ms = [x * 1000 for x in lat]
            print(f"  persist latency, {writers} writer(s), 10 ms delay, {len(ms)} small checkpoints: "
                  f"p50 {pct(ms, 50):.1f} ms  p99 {pct(ms, 99):.1f} ms  max {max(ms):.1f} ms")
    finally:
        sd.cleanup(root)
    return 0


if __name__ == "__main__":
    sys.exit(main())
