"""Prints the per-call paths a Python user calls one change at a time, medians of a few rounds:

  * per-record append: `writer.append(kg, bytes)` in a Python loop + persist, N x 100 B over 128 key
    groups, default options, local disk (thread and direct upload mode), with the vectorised
    `append_many` + persist of the same data beside it;
  * per-object restore: `for c in reader.get_changes(handle)` (count only, and summing `len(c.data)`)
    and `list(reader.get_changes(handle))`, with the arrays reader beside it;
  * keyed state single-key calls: ValueState.update/get, ListState.add/get, MapState.put/get with int
    and str keys (changelog appends included; the final persist is not timed).

The machine is shared: quote medians, and ratios measured in one run.
Usage: .venv/bin/python bench/hotpath_report.py [--changes N] [--calls N] [--repeat R] [--skip state]
"""
from __future__ import annotations

import argparse
import os
import shutil
import statistics
import sys
import tempfile
import time

sys.path.insert(0, os.path.dirname(__file__))
sys.path.insert(0, os.path.join(os.path.dirname(__file__), ".."))
import _storage_data as sd  # noqa: E402

from dstl.changelog.storage import open_storage  # noqa: E402

STATE_GOAL = 1.5e6  # single-key ValueState.update calls per second (the target)


def _median(values):
    return statistics.median(values)


def _rounds(fn, repeat):
    out = []
    for _ in range(repeat):
        d = sd.tmpdir()
        try:
            os.sync()
            out.append(fn(d))
        finally:
            shutil.rmtree(d, ignore_errors=True)
    return out


def write_benchmarks(n, repeat):
    kgs, data, offs = sd.make_data(n)
    mb = n * sd.VALUE / 1e6
    rows = []
    for label, fn in (("append per change + persist, thread", lambda d: sd.write_per_change(d, kgs, data)[0]),
                      ("append per change + persist, direct",
                       lambda d: sd.write_per_change(d, kgs, data, mode="direct")[0]),
                      ("append_many + persist, thread", lambda d: sd.write_vectorised(d, kgs, data, offs)[0])):
        times = _rounds(fn, repeat)
        rows.append((label, _median(times), mb / _median(times), [round(mb / t) for t in times]))
    return rows


def _timed(fn, repeat):
    times = []
    for _ in range(repeat):
        t0 = time.perf_counter()
        fn()
        times.append(time.perf_counter() - t0)
    return times


def read_benchmarks(n, repeat):
    kgs, data, offs = sd.make_data(n)
    mb = n * sd.VALUE / 1e6
    base = sd.tmpdir()
    rows = []
    try:
        _, handle, _ = sd.write_vectorised(base, kgs, data, offs)
        with open_storage(base, upload_mode="direct") as s:
            reader = s.create_reader()

            def objects():
                count = 0
                for _ in reader.get_changes(handle):
                    count += 1
                assert count == n

            def objects_len():
                total = 0
                for c in reader.get_changes(handle):
                    total += len(c.data)
                assert total == n * sd.VALUE

            def objects_list():
                assert len(list(reader.get_changes(handle))) == n

            def arrays():
                assert sum(len(k) for _, k, _, _ in reader.get_changes_arrays(handle)) == n

            objects()  # warm the page cache
            for label, fn in (("for c in get_changes (count)", objects), ("for c in get_changes: len(c.data)", objects_len),
                              ("list(get_changes)", objects_list), ("get_changes_arrays", arrays)):
                times = _timed(fn, repeat)
                rows.append((label, _median(times), mb / _median(times), [round(mb / t) for t in times]))
    finally:
        shutil.rmtree(base, ignore_errors=True)
    return rows


def state_benchmarks(calls, repeat):
    import numpy as np

    from dstl.state.backend import KeyedStateBackend
    from dstl.types import KeyGroupRange

    rng = np.random.default_rng(3)
    ids = rng.integers(0, 100_000, calls).tolist()
    vals = rng.integers(0, 1_000_000, calls).tolist()
    keysets = {"int": ids, "str": [f"user-{i}" for i in ids]}
    rows = []
    for kind, keys in keysets.items():
        pairs = list(zip(keys, vals))
        res = {}
        for _ in range(repeat):
            base = tempfile.mkdtemp(prefix="dstl-bench-hotpath-")
            try:
                with open_storage(base) as st:
                    b = KeyedStateBackend(st, "bench", KeyGroupRange(0, 127), 128)
                    v, lst, m = b.value_state("v"), b.list_state("l"), b.map_state("m")
                    for label, fn in (
                            ("ValueState.update", lambda: [v.update(k, x) for k, x in pairs]),
                            ("ValueState.get", lambda: [v.get(k) for k in keys]),
                            ("ListState.add", lambda: [lst.add(k, x) for k, x in pairs]),
                            ("ListState.get", lambda: [lst.get(k) for k in keys]),
                            ("MapState.put", lambda: [m.put(k, x & 15, x) for k, x in pairs]),
                            ("MapState.get", lambda: [m.get(k, x & 15) for k, x in pairs])):
                        t0 = time.perf_counter()
                        fn()
                        res.setdefault(label, []).append(calls / (time.perf_counter() - t0))
                    b.close()
            finally:
                shutil.rmtree(base, ignore_errors=True)
        for label, rates in res.items():
            rows.append((f"{label}, {kind} keys", _median(rates), [round(r / 1e6, 2) for r in rates]))
    return rows


def main(argv=None) -> int:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--changes", type=int, default=1_000_000)
    ap.add_argument("--calls", type=int, default=500_000)
    ap.add_argument("--repeat", type=int, default=5)
    ap.add_argument("--skip", action="append", default=[], choices=["write", "read", "state"])
    args = ap.parse_args(argv)
    from dstl import IMPLEMENTATION

    print(f"hot paths: {args.changes:,} changes x {sd.VALUE} B over 128 key groups, implementation "
          f"{IMPLEMENTATION}, medians of {args.repeat} (shared machine: {os.cpu_count()} CPUs, load "
          f"{os.getloadavg()[0]:.1f})")
    if "write" not in args.skip:
        print("\nwrite (local disk, default options)")
        for label, t, rate, all_rates in write_benchmarks(args.changes, args.repeat):
            print(f"  {label:40s} {t * 1000:8.1f} ms  {rate:7.0f} MB/s   rounds {all_rates}")
    if "read" not in args.skip:
        print("\nread (local disk, page cache warm)")
        for label, t, rate, all_rates in read_benchmarks(args.changes, args.repeat):
            print(f"  {label:40s} {t * 1000:8.1f} ms  {rate:7.0f} MB/s   rounds {all_rates}")
    if "state" not in args.skip:
        print(f"\nkeyed state, single-key calls ({args.calls:,} calls over 100,000 keys; appends included)")
        for label, rate, all_rates in state_benchmarks(args.calls, args.repeat):
            mark = ""
            if label.startswith("ValueState.update"):
                mark = f"  ({rate / STATE_GOAL:.2f}x the 1.5 M/s goal)"
            print(f"  {label:40s} {rate / 1e6:6.2f} M calls/s   rounds {all_rates}{mark}")
    return 0


if __name__ == "__main__":
    sys.exit(main())
