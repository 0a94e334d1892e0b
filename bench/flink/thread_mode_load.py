"""Thread mode against process mode under CPU load (issue 21, item 5): the vectorised write of
bench-flink (1M x 100 B, append_many in 10,000-row calls + persist) in both upload modes, rounds
interleaved, with K busy-looping processes started beside it (K = 0 and K = --burners), and thread
mode once more with a 0.5 ms GIL switch interval instead of CPython's 5 ms; then the per-record write
(default mode) with both switch intervals: how long the sender threads wait for the GIL shows in the
persist tail.

Per write it records the wall time, the split at the last append (appends / persist tail), and the
writer process's CPU time (all its threads; the upload service's processes are not in it).

Usage: .venv/bin/python bench/flink/thread_mode_load.py [--changes N] [--rounds R] [--burners K]
"""
from __future__ import annotations

import argparse
import json
import os
import shutil
import statistics
import subprocess
import sys
import tempfile
import time

HERE = os.path.dirname(os.path.abspath(__file__))
sys.path.insert(0, HERE)

import _dstl_side as ds  # noqa: E402

BURN = "import os\nwhile True:\n    os.getpid()\n"


def _cpu() -> float:
    t = os.times()
    return t.user + t.system


def _one(storage, name, workload, cp, switch=None, write=ds.write_vectorised) -> dict:
    old = sys.getswitchinterval()
    if switch is not None:
        sys.setswitchinterval(switch)
    try:
        os.sync()
        c0 = _cpu()
        seconds, handle = write(storage, name, workload, cp)
        cpu = _cpu() - c0
    finally:
        sys.setswitchinterval(old)
    ds.discard([handle])
    return {**ds.LAST_SPLIT, "seconds": seconds, "cpu": cpu}  # this writer process's CPU, not the split's


def main(argv=None) -> int:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--changes", type=int, default=1_000_000)
    ap.add_argument("--rounds", type=int, default=5)
    ap.add_argument("--burners", type=int, default=4)
    ap.add_argument("--out", default="")
    args = ap.parse_args(argv)
    from dstl import open_storage

    workload = ds.make_workload(args.changes)
    root = tempfile.mkdtemp(prefix="dstl-bench-threadload-")
    process = open_storage(os.path.join(root, "process"))
    thread = open_storage(os.path.join(root, "thread"), upload_mode="thread")
    variants = (("process", process, None, ds.write_vectorised), ("thread", thread, None, ds.write_vectorised),
                ("thread, switch 0.5 ms", thread, 0.0005, ds.write_vectorised),
                ("per record, process", process, None, ds.write_per_record),
                ("per record, process, switch 0.5 ms", process, 0.0005, ds.write_per_record))
    results = {}
    try:
        for k in (0, args.burners):
            burners = [subprocess.Popen([sys.executable, "-c", BURN]) for _ in range(k)]
            try:
                time.sleep(0.5 if k else 0)
                runs = {name: [] for name, *_ in variants}
                loads = []
                for rnd in range(args.rounds + 1):
                    for name, storage, switch, write in variants:
                        r = _one(storage, f"{name}-{k}-{rnd}".replace(" ", "_").replace(",", "").replace(".", ""),
                                 workload, rnd + 1, switch, write)
                        if rnd:
                            runs[name].append(r)
                    if rnd:
                        loads.append(os.getloadavg()[0])
            finally:
                for p in burners:  # our own children, by their handles
                    p.kill()
                    p.wait()
            summary = {}
            for name, rs in runs.items():
                summary[name] = {key: statistics.median(r[key] for r in rs) * 1000
                                 for key in ("seconds", "appends", "tail", "cpu")}
            ratios = [p["seconds"] / t["seconds"] for p, t in zip(runs["process"], runs["thread"])]
            summary["thread/process throughput, per round"] = ratios
            summary["loadavg"] = loads
            results[f"{k} burners"] = summary
            print(f"\n{k} busy processes beside the run (load average {', '.join(f'{x:.1f}' for x in loads)})")
            for name in runs:
                s = summary[name]
                print(f"  {name:34s} wall {s['seconds']:6.1f} ms  appends {s['appends']:6.1f}  tail "
                      f"{s['tail']:6.1f}  writer CPU {s['cpu']:6.1f} ms")
            print(f"  thread/process throughput per round: {', '.join(f'{x:.2f}' for x in ratios)} "
                  f"(median {statistics.median(ratios):.2f})")
    finally:
        process.close()
        thread.close()
        shutil.rmtree(root, ignore_errors=True)
    if args.out:
        with open(args.out, "w") as f:
            json.dump(results, f, indent=1)
    return 0


if __name__ == "__main__":
    sys.exit(main())
