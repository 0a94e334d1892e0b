"""Default (process) mode vs thread mode on the issue-9 workload, in one run, plus where process
mode's time goes.

Workload: one writer, 1,000,000 random 100-byte changes over 128 key groups, default options, local
disk; (a) `append_many` in 10,000-row calls + persist, (b) one `append` per change + persist (a
quarter of the changes). Thread and process runs alternate (thread, process, thread, ...) so that
background load hits both alike; medians of --repeat runs. Goals (issue 9): (a) process / thread
>= 0.5, (b) process / thread >= 0.9.

"where the time goes" (process mode, the client's side): the time the sender thread spends turning
sealed change sets into bytes in shared memory (encoding + the one copy, including page faults on
fresh segments) against the run's wall time; the rest is the service's batching (persist delay),
the uploader's file write and the round trips (descriptor, registry journal, result).

Usage: .venv/bin/python bench/service_modes_report.py [--changes N] [--repeat R]
"""
from __future__ import annotations

import argparse
import os
import statistics
import sys
import time

sys.path.insert(0, os.path.dirname(os.path.abspath(__file__)))
sys.path.insert(0, os.path.dirname(os.path.dirname(os.path.abspath(__file__))))
import _storage_data as sd  # noqa: E402


def _instrument():
    """Count the time spent in shm.create_segment (sender thread: encode + copy into shared memory)."""
    from dstl.changelog.upload.service import shm

    acc = {"s": 0.0, "n": 0}
    real = shm.create_segment

    def timed(*a, **k):
        t = time.perf_counter()
        try:
            return real(*a, **k)
        finally:
            acc["s"] += time.perf_counter() - t
            acc["n"] += 1

    shm.create_segment = timed
    return acc


def main(argv=None) -> int:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--changes", type=int, default=1_000_000)
    ap.add_argument("--repeat", type=int, default=5)
    args = ap.parse_args(argv)
    from dstl import IMPLEMENTATION

    n = args.changes
    mb = n * sd.VALUE / 1e6
    kgs, data, offs = sd.make_data(n)
    acc = _instrument()
    vec = {"thread": [], "process": []}
    rec = {"thread": [], "process": []}
    copy_share = []
    for _ in range(args.repeat):
        for mode in ("thread", "process"):
            base = sd.tmpdir()
            acc.update(s=0.0, n=0)
            t, _h, _ = sd.write_vectorised(base, kgs, data, offs, mode=mode)
            vec[mode].append(mb / t)
            if mode == "process":
                copy_share.append((acc["s"], t))
            sd.cleanup(base)
            base = sd.tmpdir()
            t, _h, _ = sd.write_per_change(base, kgs[: n // 4], data, mode=mode)
            rec[mode].append(n // 4 / t / 1e6)
            sd.cleanup(base)
    med = statistics.median
    print(f"workload: {n:,} x {sd.VALUE}-byte changes ({mb:.0f} MB), implementation {IMPLEMENTATION}, "
          f"medians of {args.repeat} alternating runs (shared 2-core machine: noisy)")
    print(f"{'':38} {'thread':>10} {'process':>10} {'ratio':>7} {'goal':>6}")
    rv = med(vec["process"]) / med(vec["thread"])
    rr = med(rec["process"]) / med(rec["thread"])
    print(f"{'append_many + persist (MB/s)':38} {med(vec['thread']):10.0f} {med(vec['process']):10.0f} "
          f"{rv:7.2f} {'>=0.5':>6}")
    print(f"{'append per change + persist (M/s)':38} {med(rec['thread']):10.2f} {med(rec['process']):10.2f} "
          f"{rr:7.2f} {'>=0.9':>6}")
    s = med([c for c, _ in copy_share])
    w = med([t for _, t in copy_share])
    print(f"process mode, append_many: wall {w * 1000:.0f} ms, of which the sender thread spent {s * 1000:.0f} ms "
          f"encoding + copying into shared memory ({mb / s:.0f} MB/s, overlapping the appends)")
    return 0


if __name__ == "__main__":
    sys.exit(main())
