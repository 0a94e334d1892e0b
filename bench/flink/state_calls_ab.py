"""ValueState.update/get per key against a plain dict, and optionally against a baseline checkout of
dstl, interleaved in one run, timed in the thread's CPU time (`time.thread_time_ns`), so that time the
OS gives to other jobs on a loaded machine is not counted (`--clock wall`: wall time, as `make
bench-flink` times it).

Each side (this checkout, and the baseline with --baseline-dir) runs in its own Python process; the
parent asks them for one round at a time, in turn, so both sides see the same machine. A round times,
for each key count, `calls` calls of:
  call floor 2   `operator.is_(k, x)`: a C function that does nothing with update's two arguments
  call floor 1   `operator.index(k)`: the same with get's one argument (returns k itself)
  dict set       `d[k] = x` inline (no call: the interpreter's floor for a keyed write)
  dict get       `d.get(k)` (a C method call, the same call shape as `get`)
  update         ValueState.update(k, x): key group, change encoded and appended, table entry set
  get            ValueState.get(k)
  adapter        a StatefulProcessor's ValueState, as the Row and pandas runners give it: per key
                 `get()` then `update((events, total))`, the grouping key set as the runner sets it
The backend has a materialization interval set (as StatefulStream sets one) that is never reached;
`--interval 0` runs without one (a bare KeyedStateBackend's default).

Usage: .venv/bin/python bench/flink/state_calls_ab.py [--calls N] [--keys 1000,100000] [--rounds R]
           [--baseline-dir DIR]
DIR: a built checkout to compare with, e.g. `git worktree add /tmp/base REV && cd /tmp/base &&
.venv/bin/python setup.py build_ext --inplace`.
"""
from __future__ import annotations

import argparse
import json
import operator
import os
import statistics
import subprocess
import sys
import tempfile
import time

CLOCK = time.thread_time_ns  # --clock wall: time.perf_counter_ns (what `make bench-flink` times)
HERE = os.path.dirname(os.path.dirname(os.path.dirname(os.path.abspath(__file__))))
OPS = ("call floor 2", "call floor 1", "dict set", "dict get", "update", "get", "adapter")


def _set_loop(d, ids, vals) -> int:
    t = CLOCK()
    for k, x in zip(ids, vals):
        d[k] = x
    return CLOCK() - t


def _call2_loop(fn, ids, vals) -> int:
    t = CLOCK()
    for k, x in zip(ids, vals):
        fn(k, x)
    return CLOCK() - t


def _call1_loop(fn, ids) -> int:
    t = CLOCK()
    for k in ids:
        fn(k)
    return CLOCK() - t


def _adapter_loop(handle, adapter, ids, vals) -> int:
    t = CLOCK()
    for k, x in zip(ids, vals):
        handle._key = k
        old = adapter.get()
        if old is None:
            adapter.update((1, x))
        else:
            adapter.update((old[0] + 1, old[1] + x))
    return CLOCK() - t


def child(calls: int, keys: list, interval: int) -> int:
    """One side: waits for "round" lines on stdin, answers each with one JSON line of ns per call."""
    import numpy as np

    from dstl import IMPLEMENTATION, open_storage
    from dstl.spark.processor import ProcessorHandle
    from dstl.state.backend import KeyedStateBackend
    from dstl.types import KeyGroupRange

    rng = np.random.default_rng(3)
    work = {}
    with tempfile.TemporaryDirectory(prefix="dstl-bench-state-ab-") as base, \
            open_storage(base, upload_mode="thread") as storage:
        for n in keys:
            ids = rng.integers(0, n, calls).tolist()
            vals = rng.integers(0, 1_000_000, calls).tolist()
            b = KeyedStateBackend(storage, f"ab-{n}", KeyGroupRange(0, 127), 128,
                                  materialize_every_changes=interval or None)
            handle = ProcessorHandle(b)
            work[n] = (ids, vals, b, b.value_state("v"), handle,
                       handle.getValueState("totals", "events long, total long"))
        print(json.dumps({"implementation": IMPLEMENTATION, "dstl": os.path.dirname(sys.modules["dstl"].__file__)}),
              flush=True)
        for line in sys.stdin:
            if line.strip() != "round":
                break
            out = {}
            for n, (ids, vals, b, v, handle, adapter) in work.items():
                d: dict = {}
                out[n] = {"call floor 2": _call2_loop(operator.is_, ids, vals) / calls,
                          "call floor 1": _call1_loop(operator.index, ids) / calls,
                          "dict set": _set_loop(d, ids, vals) / calls,
                          "dict get": _call1_loop(d.get, ids) / calls,
                          "update": _call2_loop(v.update, ids, vals) / calls,
                          "get": _call1_loop(v.get, ids) / calls,
                          "adapter": _adapter_loop(handle, adapter, ids, vals) / calls}
            print(json.dumps(out), flush=True)
        for _, _, b, *_ in work.values():
            b.close()
    return 0


def main(argv=None) -> int:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--calls", type=int, default=200_000)
    ap.add_argument("--keys", default="1000,100000", help="comma-separated key counts")
    ap.add_argument("--rounds", type=int, default=9)
    ap.add_argument("--baseline-dir", help="a built dstl checkout to compare with")
    ap.add_argument("--clock", choices=("thread", "wall"), default="thread")
    ap.add_argument("--interval", type=int, default=10**15, help="materialize_every_changes (0: none)")
    ap.add_argument("--child", action="store_true", help=argparse.SUPPRESS)
    args = ap.parse_args(argv)
    keys = [int(k) for k in args.keys.split(",")]
    if args.child:
        global CLOCK
        CLOCK = time.perf_counter_ns if args.clock == "wall" else time.thread_time_ns
        return child(args.calls, keys, args.interval)

    sides = {"this": HERE}
    if args.baseline_dir:
        sides = {"before": os.path.abspath(args.baseline_dir), "after": HERE}
    procs, info = {}, {}
    for name, root in sides.items():
        env = dict(os.environ, PYTHONPATH=root, OPENBLAS_NUM_THREADS="1")
        procs[name] = subprocess.Popen([sys.executable, os.path.abspath(__file__), "--child", "--calls",
                                        str(args.calls), "--keys", args.keys, "--clock", args.clock,
                                        "--interval", str(args.interval)],
                                       cwd=root, env=env,
                                       stdin=subprocess.PIPE, stdout=subprocess.PIPE, text=True)
        info[name] = json.loads(procs[name].stdout.readline())
    res = {name: {n: {op: [] for op in OPS} for n in keys} for name in sides}
    loads = [os.getloadavg()[0]]
    try:
        for r in range(args.rounds):
            order = list(sides) if r % 2 == 0 else list(sides)[::-1]  # alternate who goes first
            for name in order:
                procs[name].stdin.write("round\n")
                procs[name].stdin.flush()
                got = json.loads(procs[name].stdout.readline())
                for n in keys:
                    for op in OPS:
                        res[name][n][op].append(got[str(n)][op])
            loads.append(os.getloadavg()[0])
    finally:
        for p in procs.values():
            p.stdin.close()
            p.wait(60)

    def med(xs):
        return f"{statistics.median(xs):6.0f} ns ({min(xs):.0f}-{max(xs):.0f})"

    def ratio(a, b):
        r = [x / y for x, y in zip(a, b)]
        return f"{statistics.median(r):.2f} ({min(r):.2f}-{max(r):.2f})"

    clock = "thread CPU time" if args.clock == "thread" else "wall time"
    print(f"ValueState per key, {args.calls:,} calls a round, {args.rounds} interleaved rounds, {clock}, "
          f"load {min(loads):.1f}-{max(loads):.1f}, materialize_every_changes={args.interval or None}")
    for name in sides:
        print(f"  {name}: {info[name]['dstl']} ({info[name]['implementation']})")
    for n in keys:
        print(f"{n:,} int keys: medians (min-max)")
        for op in OPS:
            print(f"  {op:12s} " + "   ".join(f"{name} {med(res[name][n][op])}" for name in sides))
        for name in sides:
            x = res[name][n]
            print(f"  {name}: update / dict set {ratio(x['update'], x['dict set'])}, "
                  f"get / dict get {ratio(x['get'], x['dict get'])}; update / call floor "
                  f"{ratio(x['update'], x['call floor 2'])}, get / call floor {ratio(x['get'], x['call floor 1'])} "
                  f"(per round)")
        if args.baseline_dir:
            for op in ("update", "get", "adapter"):
                print(f"  {op}: before / after, per round: "
                      f"{ratio(res['before'][n][op], res['after'][n][op])}")
    return 0


if __name__ == "__main__":
    sys.exit(main())
