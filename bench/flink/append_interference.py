"""What the uploads beside it cost a per-record `append` loop: 1M appends of bench-flink's workload
in thread mode, alternating round by round between (a) the loop calling a no-op C function,
(b) `writer.append` with the uploads' file writes replaced by a no-op (layout and page-cache copy
gone, everything else real) and (c) `writer.append` with the real uploads. `--pin` puts the
appending thread on CPU 0 and every other thread of the process on CPU 1 (is it a fight for the
cores?). `--mode process` times (a) and (c) with the upload service instead (bench-flink's
per-record write; the stub applies to thread mode only). Prints ns a change, medians of the rounds,
and for the appends the appending thread's CPU time, its page faults and the times it blocked
(voluntary context switches: waits for the GIL) a round.

Usage: .venv/bin/python bench/flink/append_interference.py [--rounds R] [--pin] [--mode thread|process]
"""
from __future__ import annotations

import argparse
import operator
import os
import resource
import shutil
import statistics
import sys
import tempfile
import threading
import time

HERE = os.path.dirname(os.path.abspath(__file__))
sys.path.insert(0, HERE)
import _dstl_side as ds  # noqa: E402  (puts the repository first on sys.path too)
from write_bound import _no_write, _no_write_at  # noqa: E402

from dstl import IMPLEMENTATION, open_storage  # noqa: E402
from dstl.changelog.upload import uploader as _uploader  # noqa: E402


def _loop(kgs, values, fn) -> None:
    for kg, v in zip(kgs, values):
        fn(kg, v)


def _pin() -> None:
    me = threading.get_native_id()
    for tid in os.listdir("/proc/self/task"):
        os.sched_setaffinity(int(tid), {0} if int(tid) == me else {1})


def _appends(storage, name: str, w, pin: bool, cpu: list, faults: list, waits: list) -> float:
    writer = storage.create_writer(name, w.key_group_range)
    if pin:
        _pin()
    u0, c0 = resource.getrusage(resource.RUSAGE_THREAD), time.thread_time()
    t0 = time.perf_counter()
    _loop(w.kg_list, w.values, writer.append)
    took = time.perf_counter() - t0
    cpu.append(time.thread_time() - c0)
    u1 = resource.getrusage(resource.RUSAGE_THREAD)
    faults.append(u1.ru_minflt - u0.ru_minflt)
    waits.append(u1.ru_nvcsw - u0.ru_nvcsw)  # the thread blocked: mostly waiting for the GIL
    handle = writer.persist(writer.initial_sequence_number(), 1).result(ds.PERSIST_TIMEOUT)
    writer.close()
    ds.discard([handle.job_manager_owned_snapshot])
    return took


def main(argv=None) -> int:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--rounds", type=int, default=5)
    ap.add_argument("--changes", type=int, default=1_000_000)
    ap.add_argument("--pin", action="store_true")
    ap.add_argument("--mode", choices=("thread", "process"), default="thread")
    args = ap.parse_args(argv)
    if args.pin and len(os.sched_getaffinity(0)) < 2:
        ap.error("--pin needs two CPUs")
    w = ds.make_workload(args.changes)
    root = tempfile.mkdtemp(prefix="dstl-bench-interference-")
    storage = open_storage(os.path.join(root, "t"), upload_mode=args.mode)
    real = (_uploader.write_bodies, _uploader.write_bodies_at)
    times = {"no-op C call": [], "append, file writes stubbed": [], "append, real uploads": []}
    if args.mode == "process":
        del times["append, file writes stubbed"]
    cpu = {name: [] for name in times}
    faults = {name: [] for name in times}
    waits = {name: [] for name in times}
    try:
        for r in range(args.rounds):
            t0 = time.perf_counter()
            _loop(w.kg_list, w.values, operator.is_)
            times["no-op C call"].append(time.perf_counter() - t0)
            if args.mode == "thread":
                stubbed = "append, file writes stubbed"
                _uploader.write_bodies, _uploader.write_bodies_at = _no_write, _no_write_at
                try:
                    times[stubbed].append(_appends(storage, f"s{r}", w, args.pin, cpu[stubbed], faults[stubbed],
                                                   waits[stubbed]))
                finally:
                    _uploader.write_bodies, _uploader.write_bodies_at = real
            name = "append, real uploads"
            times[name].append(_appends(storage, f"r{r}", w, args.pin, cpu[name], faults[name], waits[name]))
            if args.pin:
                os.sched_setaffinity(0, {0, 1})
    finally:
        storage.close()
        shutil.rmtree(root, ignore_errors=True)
    print(f"{args.changes:,} appends, {IMPLEMENTATION}, {args.mode} mode, {args.rounds} rounds, pinned: {args.pin}, "
          f"load {os.getloadavg()[0]:.1f}; ns a change, median (min-max)")
    for name, ts in times.items():
        ns = [t * 1e9 / args.changes for t in ts]
        line = f"  {name:30s} {statistics.median(ns):6.1f} ({min(ns):.1f}-{max(ns):.1f})"
        if cpu[name]:
            line += (f"   thread CPU {statistics.median(cpu[name]) * 1e9 / args.changes:.1f} ns,"
                     f" page faults a round {statistics.median(faults[name]):.0f},"
                     f" waits (voluntary switches) {statistics.median(waits[name]):.0f}")
        print(line)
    return 0


if __name__ == "__main__":
    sys.exit(main())
