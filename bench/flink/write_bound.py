"""What bounds a vectorised write on this machine: the bench-flink write (1M x 100 B, append_many in
10,000-row calls + persist) in variants that each take one cost away, interleaved round by round,
with its wall time and its CPU time (every thread, and in process mode the upload service's
processes) beside a plain `write()` of the payload, plus the machine's memory-copy rate.

  thread / process        the default options, upload.mode thread / process (the bench-flink paths)
  process, shared memory  DSTL_CLIENT_WRITES=0: raw bodies through shared memory and the uploader
                          processes instead of written by the client (the path before it)
  thread, delay 0         batch.persist-delay=0: the last batch does not wait for company
  thread, no file write   the upload's layout and page-cache copy replaced by a no-op (the files are
                          made, empty): what the pipeline costs around the bytes

Every figure is a median over the rounds. Usage: .venv/bin/python bench/flink/write_bound.py [--rounds R]
"""
from __future__ import annotations

import argparse
import os
import shutil
import statistics
import sys
import tempfile
import threading
import time
from unittest import mock

import numpy as np

HERE = os.path.dirname(os.path.abspath(__file__))
sys.path.insert(0, HERE)
import _dstl_side as ds  # noqa: E402  (puts the repository first on sys.path too)

from dstl import IMPLEMENTATION, open_storage  # noqa: E402
from dstl.changelog.upload import uploader as _uploader  # noqa: E402
from dstl.changelog.upload.service.client import CLIENT_WRITES_ENV  # noqa: E402

VARIANTS = {  # name -> (options, file writes stubbed)
    "thread": ({"upload_mode": "thread"}, False),
    "process": ({}, False),
    "process, shared memory": ({"_client_writes": "0"}, False),
    "thread, delay 0": ({"upload_mode": "thread", "batch_persist_delay": "0 ms"}, False),
    "thread, no file write": ({"upload_mode": "thread"}, True),
}


def _no_write(fds, bodies) -> int:
    return sum(len(b) for b in bodies)


def _no_write_at(paths, offset, bodies, create=False, size=-1) -> int:
    """write_bodies_at without the bytes: the files are made (empty), nothing is laid out or copied."""
    for p in paths:
        if create:
            os.close(os.open(p, os.O_WRONLY | os.O_CREAT | os.O_EXCL, 0o666))
    return sum(len(b) for b in bodies)


def copy_rate(nbytes: int = 200 << 20) -> dict:
    """GB/s of one large memcpy (numpy.copyto, which releases the GIL) on 1 and on 2 threads at once."""
    src = [np.ones(nbytes, np.uint8) for _ in range(2)]
    dst = [np.zeros(nbytes, np.uint8) for _ in range(2)]
    out = {}
    for threads in (1, 2):
        times = []
        for _ in range(5):
            ts = [threading.Thread(target=np.copyto, args=(dst[i], src[i])) for i in range(threads)]
            t0 = time.perf_counter()
            for t in ts:
                t.start()
            for t in ts:
                t.join()
            times.append(time.perf_counter() - t0)
        out[threads] = threads * nbytes / statistics.median(times) / 1e9
    return out


def main(argv=None) -> int:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--rounds", type=int, default=9)
    ap.add_argument("--changes", type=int, default=1_000_000)
    args = ap.parse_args(argv)
    w = ds.make_workload(args.changes)
    root = tempfile.mkdtemp(prefix="dstl-bench-bound-")
    storages = {}
    wall = {k: [] for k in ["plain write", *VARIANTS]}
    cpu = {k: [] for k in wall}
    real_write, real_write_at = _uploader.write_bodies, _uploader.write_bodies_at
    try:
        for name, (options, _) in VARIANTS.items():
            options = dict(options)
            client_writes = options.pop("_client_writes", None)
            # read by the client when it connects
            with mock.patch.dict(os.environ, {CLIENT_WRITES_ENV: client_writes} if client_writes else {}):
                storages[name] = open_storage(os.path.join(root, name.replace(" ", "_").replace(",", "")), **options)
        for rnd in range(args.rounds + 1):
            path = os.path.join(root, "plain")
            c0, t0 = time.process_time(), time.perf_counter()
            with open(path, "wb") as f:
                f.write(w.data)
            t, c = time.perf_counter() - t0, time.process_time() - c0
            os.remove(path)
            if rnd:
                wall["plain write"].append(t)
                cpu["plain write"].append(c)
            for name, (_, stub) in VARIANTS.items():
                _uploader.write_bodies = _no_write if stub else real_write
                _uploader.write_bodies_at = _no_write_at if stub else real_write_at
                try:
                    t, handle = ds.write_vectorised(storages[name], f"bound-{rnd}", w, rnd + 1)
                finally:
                    _uploader.write_bodies, _uploader.write_bodies_at = real_write, real_write_at
                ds.discard([handle])
                if rnd:
                    wall[name].append(t)
                    cpu[name].append(ds.LAST_SPLIT["cpu"])
    finally:
        for s in storages.values():
            s.close()
        shutil.rmtree(root, ignore_errors=True)
    rate = copy_rate()
    plain = statistics.median(wall["plain write"])
    print(f"vectorised write of {args.changes:,} x {ds.VALUE} B, {IMPLEMENTATION}, {os.cpu_count()} cores, "
          f"{args.rounds} rounds (load {os.getloadavg()[0]:.1f}); medians")
    print(f"  {'':26s} {'wall ms':>8s} {'CPU ms':>8s} {'plain/wall':>10s} {'CPU/2 ms':>9s}")
    for name in wall:
        t, c = statistics.median(wall[name]) * 1e3, statistics.median(cpu[name]) * 1e3
        print(f"  {name:26s} {t:8.1f} {c:8.1f} {plain * 1e3 / t:10.2f} {c / 2:9.1f}")
    print(f"  memory copy: {rate[1]:.1f} GB/s on one thread, {rate[2]:.1f} GB/s on two at once")
    return 0


if __name__ == "__main__":
    sys.exit(main())
