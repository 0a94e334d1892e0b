"""ValueState.update/get per key: the bound kernel path (`StateAppender.bind_value`, what a plain
ValueState with the native serializer uses) against the class's own methods, interleaved in one
run, timed in the thread's CPU time (`time.thread_time_ns`), so that time the OS gives to other jobs
on a loaded machine is not counted.

Usage: .venv/bin/python bench/flink/state_calls_ab.py [--calls N] [--keys K] [--rounds R]
"""
from __future__ import annotations

import argparse
import os
import statistics
import sys
import tempfile
import time

sys.path.insert(0, os.path.dirname(os.path.dirname(os.path.dirname(os.path.abspath(__file__)))))

import numpy as np  # noqa: E402

from dstl import IMPLEMENTATION, open_storage  # noqa: E402
from dstl.state.backend import KeyedStateBackend  # noqa: E402
from dstl.state.value import ValueState  # noqa: E402
from dstl.types import KeyGroupRange  # noqa: E402


def main(argv=None) -> int:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--calls", type=int, default=200_000)
    ap.add_argument("--keys", type=int, default=100_000)
    ap.add_argument("--rounds", type=int, default=9)
    args = ap.parse_args(argv)
    rng = np.random.default_rng(3)
    ids = rng.integers(0, args.keys, args.calls).tolist()
    vals = rng.integers(0, 1_000_000, args.calls).tolist()
    with tempfile.TemporaryDirectory(prefix="dstl-bench-state-ab-") as base, \
            open_storage(base, upload_mode="thread") as storage:
        backend = KeyedStateBackend(storage, "ab", KeyGroupRange(0, 127), 128)
        v = backend.value_state("v")
        calls = {"update, class method": (ValueState.update.__get__(v), True),
                 "update, bound kernel": (v.update, True),
                 "get, class method": (ValueState.get.__get__(v), False),
                 "get, bound kernel": (v.get, False)}
        ns = {name: [] for name in calls}
        for _ in range(args.rounds):
            for name, (fn, two) in calls.items():
                t0 = time.thread_time_ns()
                if two:
                    for k, x in zip(ids, vals):
                        fn(k, x)
                else:
                    for k in ids:
                        fn(k)
                ns[name].append((time.thread_time_ns() - t0) / args.calls)
        backend.close()
    print(f"ValueState per key, {args.calls:,} calls over {args.keys:,} int keys, {IMPLEMENTATION}, "
          f"medians of {args.rounds} interleaved rounds (thread CPU time; load {os.getloadavg()[0]:.1f})")
    for name, xs in ns.items():
        print(f"  {name:22s} {statistics.median(xs):6.0f} ns  ({min(xs):.0f}-{max(xs):.0f})")
    for op in ("update", "get"):
        r = [a / b for a, b in zip(ns[f"{op}, class method"], ns[f"{op}, bound kernel"])]
        print(f"  {op}: class method / bound kernel, per round: median {statistics.median(r):.2f} "
              f"({min(r):.2f}-{max(r):.2f})")
    return 0


if __name__ == "__main__":
    sys.exit(main())
