"""Default (process) mode vs thread mode on one writer's workload, in one run, plus where process
mode's time goes.

Workload: one writer, 1,000,000 random 100-byte changes over 128 key groups, default options, local
disk; (a) `append_many` in 10,000-row calls + persist, (b) one `append` per change + persist (a
quarter of the changes). Each mode's storage is opened once and kept, as a task keeps its storage
(the process-mode service is then warm, as in a running job; its cold start is reported on its own
line); one warm-up round is not counted. Thread and process runs alternate (thread, process,
thread, ...) so that background load hits both alike; medians of --repeat runs. Targets:
(a) process / thread >= 0.5, (b) process / thread >= 0.9.

"where the time goes" (append_many, the run with the median wall time): the appending thread's time (encoding into the change
buffer, handing pre-emptive uploads over), the tail from persist() to the future's result, and in
process mode the CPU-side work of the pipeline's two stages: the client's sender threads (build the
sealed bodies into mapped shared memory: their one copy) and the uploader processes (the file write, from
the attempts' own latencies). Stages overlap each other and the appends, so they do not add up to
the wall time; on 2 cores their sum against 2 x wall says how busy the machine was.

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

T = 600


class _Stages:
    """Per-run sums of the process-mode stages, measured in the client (see the module docstring)."""

    def __init__(self) -> None:
        from dstl.changelog.upload.service import client, shm

        self.copy_s = 0.0
        self.upload_s = 0.0
        self._batches: set = set()
        real_write, real_done = shm.Segment.write, client.ServiceConnection._on_done
        stages = self

        def write(*a, **k):
            t = time.perf_counter()
            try:
                return real_write(*a, **k)
            finally:
                stages.copy_s += time.perf_counter() - t

        def on_done(conn, msg):
            m = msg.metrics or {}
            if m.get("batch_id") not in stages._batches:  # one entry per batch, not per task
                stages._batches.add(m.get("batch_id"))
                stages.upload_s += sum(m.get("latencies", ())) / 1e9
            return real_done(conn, msg)

        shm.Segment.write = write
        client.ServiceConnection._on_done = on_done

    def reset(self) -> None:
        self.copy_s = self.upload_s = 0.0
        self._batches.clear()


def write_vectorised(storage, name: str, kgs, data, offs):
    """-> (wall s, appends s, persist tail s)."""
    w = storage.create_writer(name, sd.KGR)
    n, mv, v = len(kgs), memoryview(data), sd.VALUE
    t0 = time.perf_counter()
    for start in range(0, n, sd.CHUNK):
        end = min(n, start + sd.CHUNK)
        w.append_many(kgs[start:end], mv[start * v:end * v], offs[start:end + 1] - start * v)
    t1 = time.perf_counter()
    w.persist(w.initial_sequence_number(), 1).result(T)
    t2 = time.perf_counter()
    w.close()
    return t2 - t0, t1 - t0, t2 - t1


def write_per_change(storage, name: str, kg_list, values):
    """-> (wall s, appends s, persist tail s)."""
    w = storage.create_writer(name, sd.KGR)
    append = w.append
    t0 = time.perf_counter()
    for kg, value in zip(kg_list, values):
        append(kg, value)
    t1 = time.perf_counter()
    w.persist(0, 1).result(T)
    t2 = time.perf_counter()
    w.close()
    return t2 - t0, t1 - t0, t2 - t1


def cold_start_s() -> float:
    """Opening a storage on a fresh base path until its new service can run an upload."""
    from dstl.changelog.storage import open_storage

    base = sd.tmpdir()
    try:
        t = time.perf_counter()
        with open_storage(base) as s:
            s.scheduler.status()
            return time.perf_counter() - t
    finally:
        sd.cleanup(base)


def main(argv=None) -> int:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--changes", type=int, default=1_000_000)
    ap.add_argument("--repeat", type=int, default=5)
    args = ap.parse_args(argv)
    from dstl import IMPLEMENTATION
    from dstl.changelog.storage import open_storage

    n = args.changes
    mb = n * sd.VALUE / 1e6
    kgs, data, offs = sd.make_data(n)
    quarter = n // 4
    values = [data[i * sd.VALUE:(i + 1) * sd.VALUE] for i in range(quarter)]
    kg_list = kgs[:quarter].tolist()
    stages = _Stages()
    load0 = os.getloadavg()
    cold = cold_start_s()
    bases = {m: sd.tmpdir() for m in ("thread", "process")}
    storages = {m: open_storage(bases[m], upload_mode=m) for m in bases}
    vec = {m: [] for m in bases}
    rec = {m: [] for m in bases}
    split = {m: [] for m in bases}  # (appends, tail, copy, upload) of append_many runs
    try:
        storages["process"].scheduler.status()  # the service is up (not counted: cold_start_s)
        for rnd in range(args.repeat + 1):
            for mode in ("thread", "process"):
                stages.reset()
                t, appends, tail = write_vectorised(storages[mode], f"v{rnd}", kgs, data, offs)
                copy_s, upload_s = stages.copy_s, stages.upload_s
                t2, _, _ = write_per_change(storages[mode], f"r{rnd}", kg_list, values)
                if rnd == 0:
                    continue  # warm-up
                vec[mode].append(mb / t)
                split[mode].append((t, appends, tail, copy_s, upload_s))
                rec[mode].append(quarter / t2 / 1e6)
    finally:
        for s in storages.values():
            s.close()
        for b in bases.values():
            sd.cleanup(b)
    load1 = os.getloadavg()
    med = statistics.median
    print(f"workload: {n:,} x {sd.VALUE}-byte changes ({mb:.0f} MB), implementation {IMPLEMENTATION}, "
          f"medians of {args.repeat} alternating runs after one warm-up (shared 2-core machine: noisy; "
          f"load average {load0[0]:.1f} before, {load1[0]:.1f} after)")
    print(f"{'':38} {'thread':>10} {'process':>10} {'ratio':>7} {'goal':>6}")
    rv = med(vec["process"]) / med(vec["thread"])
    rr = med(rec["process"]) / med(rec["thread"])
    print(f"{'append_many + persist (MB/s)':38} {med(vec['thread']):10.0f} {med(vec['process']):10.0f} "
          f"{rv:7.2f} {'>=0.5':>6}")
    print(f"{'append per change + persist (M/s)':38} {med(rec['thread']):10.2f} {med(rec['process']):10.2f} "
          f"{rr:7.2f} {'>=0.9':>6}")
    print("where the time goes, append_many + persist (ms, the run with the median wall time):")
    for mode in ("thread", "process"):
        runs = sorted(split[mode])
        wall, appends, tail, copy_s, upload_s = (x * 1000 for x in runs[(len(runs) - 1) // 2])
        line = f"  {mode:8} wall {wall:5.0f} = appends {appends:5.0f} + persist tail {tail:5.0f}"
        if mode == "process":
            line += (f"; stages (overlapping): senders building bodies into shared memory {copy_s:.0f}, "
                     f"uploaders' file writes {upload_s:.0f}")
        print(line)
    print(f"process mode cold start (open on a fresh base path until the new service runs uploads): "
          f"{cold * 1000:.0f} ms, paid once per host and option set")
    return 0


if __name__ == "__main__":
    sys.exit(main())
