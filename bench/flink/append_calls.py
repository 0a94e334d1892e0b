"""The per-record append against CPython's floor, in the thread's CPU time: the same loop
(`for kg, v in zip(kgs, values)`) calling `operator.is_(kg, v)` (a C function that does nothing with
the same two arguments), `ChangeBuffer.append` and `writer.append`, interleaved in blocks of 50,000
calls (5 MB; each block's change set is sealed and dropped afterwards, so the memory is warm and
nothing uploads beside the loop). Thread CPU time leaves out the time the OS gives to other jobs.

Usage: .venv/bin/python bench/flink/append_calls.py [--blocks B]
"""
from __future__ import annotations

import argparse
import operator
import os
import statistics
import sys
import tempfile
import time

HERE = os.path.dirname(os.path.abspath(__file__))
sys.path.insert(0, os.path.dirname(HERE))
import _storage_data as sd  # noqa: E402  (puts the repository first on sys.path too)

from dstl import IMPLEMENTATION, KeyGroupRange, open_storage  # noqa: E402
from dstl.format import ChangeBuffer  # noqa: E402

BLOCK = 50_000


def main(argv=None) -> int:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--blocks", type=int, default=100)
    args = ap.parse_args(argv)
    kgs, data, _ = sd.make_data(BLOCK)
    values = [data[i * sd.VALUE:(i + 1) * sd.VALUE] for i in range(BLOCK)]
    kgl = kgs.tolist()
    with tempfile.TemporaryDirectory(prefix="dstl-bench-append-") as base, \
            open_storage(base, upload_mode="thread") as storage:
        writer = storage.create_writer("append-calls", KeyGroupRange(0, 127))
        writer._threshold = 1 << 62  # no pre-emptive persist: nothing runs beside the loop
        buf = ChangeBuffer()
        calls = {"operator.is_ (no-op C call)": operator.is_, "ChangeBuffer.append": buf.append,
                 "writer.append": writer.append}
        ns = {name: [] for name in calls}
        for _ in range(args.blocks):
            for name, fn in calls.items():
                t0 = time.thread_time_ns()
                for kg, v in zip(kgl, values):
                    fn(kg, v)
                ns[name].append((time.thread_time_ns() - t0) / BLOCK)
            buf.seal_body()
            writer._take_active()
        writer.close()
    print(f"per-record append, {args.blocks} blocks of {BLOCK:,} calls x {sd.VALUE} B, {IMPLEMENTATION}, "
          f"thread CPU time (load {os.getloadavg()[0]:.1f}): median (p25-p75)")
    floor = ns["operator.is_ (no-op C call)"]
    for name, xs in ns.items():
        q = statistics.quantiles(xs, n=4)
        r = [x / f for x, f in zip(xs, floor)]
        print(f"  {name:30s} {statistics.median(xs):6.1f} ns ({q[0]:.1f}-{q[2]:.1f})   / no-op call, per block: "
              f"{statistics.median(r):.2f}")
    return 0


if __name__ == "__main__":
    sys.exit(main())
