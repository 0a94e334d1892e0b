"""The upload-service workload of service_report.py.

`run_mode(mode, writers, changes, every, size)` starts `writers` processes that each append `changes`
changes of `size` bytes (vectorised `append_many`, 100-byte payloads by default) and persist every
`every` changes, all against one base path. Each process measures its own CPU time (user + system,
all threads) and wall time around the append/persist loop; payload is generated before the clock
starts. Returns a dict of totals. Services started are stopped by PID at the end.
"""
from __future__ import annotations

import json
import os
import shutil
import signal
import subprocess
import sys
import tempfile
import time
import uuid

ROOT = os.path.abspath(os.path.join(os.path.dirname(__file__), ".."))

_CHILD = r"""
import json, os, sys, time
import numpy as np
from dstl.changelog.storage import open_storage
from dstl.types import KeyGroupRange
base, mode, job, n, every, size, out, go, compression, payload = sys.argv[1:11]
n, every, size = int(n), int(every), int(size)
s = open_storage(base, upload_mode=mode, job_id=job, compression_enabled=compression == "1")
w = s.create_writer(f"op{os.getpid()}", KeyGroupRange(0, 127))
kgs = (np.arange(every, dtype=np.int32) % 128).astype(np.int32)
if payload == "random":  # incompressible
    data = np.random.default_rng(os.getpid()).integers(0, 256, every * size, dtype=np.uint8).tobytes()
else:  # event records, compressible like real state changes
    rng = np.random.default_rng(os.getpid())
    data = b"".join((b'{"user":%08d,"event":"click","page":"/p/%04d","ts":%013d}' % (
        rng.integers(1e8), rng.integers(1e4), 1700000000000 + i)).ljust(size, b" ")[:size] for i in range(every))
offsets = np.arange(every + 1, dtype=np.int64) * size
service = getattr(s.scheduler, "service_pid", None)
if service is not None:
    s.scheduler.status()  # returns once the uploader pool and the registry are up (a warm service)
open(out + ".ready", "w").close()
while not os.path.exists(go):
    time.sleep(0.001)
import resource
def cpu():  # whole process (every thread), microsecond resolution
    r = resource.getrusage(resource.RUSAGE_SELF)
    return r.ru_utime + r.ru_stime
c0, t0 = cpu(), time.perf_counter()
futures = []
for i in range(n // every):
    first = w.next_sequence_number()
    w.append_many(kgs, data, offsets)
    futures.append(w.persist(first, i + 1))
for f in futures:
    f.result(300)
t1, c1 = time.perf_counter(), cpu()
conn = getattr(s.scheduler, "connection", None)
res = {"wall": t1 - t0, "cpu": c1 - c0, "t0": t0, "t1": t1,
       "service": service, "persists": len(futures),
       "bytes_shared": getattr(conn, "bytes_shared", 0), "bytes_sent": getattr(conn, "bytes_sent", 0)}
if conn is not None:
    st = s.scheduler.status()
    res["service_pids"] = [st["pid"], st["registry_pid"]] + st["uploader_pids"]
    lat = sorted(s.scheduler.ping() for _ in range(500))
    res["ping_p50_us"], res["ping_p99_us"] = lat[250] * 1e6, lat[495] * 1e6
    res["service_cpu"] = sum(__import__("_service_workload").cpu_of(p) for p in res["service_pids"])
w.close()
s.close()
with open(out, "w") as f:
    json.dump(res, f)
"""


def cpu_of(pid: int) -> float:
    """user + system seconds of a live process (from /proc)."""
    try:
        with open(f"/proc/{pid}/stat") as f:
            fields = f.read().rsplit(")", 1)[1].split()
        return (int(fields[11]) + int(fields[12])) / os.sysconf("SC_CLK_TCK")
    except (OSError, ValueError, IndexError):
        return 0.0


def _children(pid: int):
    out = []
    for e in os.listdir("/proc"):
        if e.isdigit():
            try:
                with open(f"/proc/{e}/stat") as f:
                    if int(f.read().rsplit(")", 1)[1].split()[1]) == pid:
                        out.append(int(e))
            except (OSError, ValueError, IndexError):
                pass
    return out + [g for c in out for g in _children(c)]


def run_mode(mode: str, writers: int = 4, changes: int = 1_000_000, every: int = 50_000, size: int = 100,
             compression: bool = False, payload: str = "random") -> dict:
    work = tempfile.mkdtemp(prefix="dqb", dir="/tmp")
    runtime = os.path.join(work, "rt")
    os.makedirs(runtime)
    env = dict(os.environ, DSTL_RUNTIME_DIR=runtime, DSTL_SERVICE_LINGER_MS="200",
               PYTHONPATH=os.pathsep.join([ROOT, os.path.dirname(os.path.abspath(__file__))]))
    base, job = os.path.join(work, "base"), uuid.uuid4().hex
    go = os.path.join(work, "go")
    outs = [os.path.join(work, f"out{i}.json") for i in range(writers)]
    procs = [subprocess.Popen([sys.executable, "-c", _CHILD, base, mode, job, str(changes), str(every), str(size),
                               o, go, "1" if compression else "0", payload], env=env) for o in outs]
    service_pids = set()
    try:
        deadline = time.monotonic() + 120
        while not all(os.path.exists(o + ".ready") for o in outs):
            if time.monotonic() > deadline or any(p.poll() not in (None, 0) for p in procs):
                raise RuntimeError("writer processes did not start")
            time.sleep(0.01)
        open(go, "w").close()
        for p in procs:
            if p.wait(600) != 0:
                raise RuntimeError(f"a writer process failed with exit code {p.returncode}")
        res = [json.load(open(o)) for o in outs]
        for r in res:
            service_pids.update(r.get("service_pids") or ([r["service"]] if r.get("service") else []))
        wall = max(r["t1"] for r in res) - min(r["t0"] for r in res)
        mb = writers * changes * size / 1e6
        files = len(os.listdir(os.path.join(base, job, "dstl")))
        out = {"mode": mode, "compression": compression, "payload": payload, "mb": mb, "wall_s": wall, "mb_per_s": mb / wall,
               "files": files, "persists": sum(r["persists"] for r in res),
               "writer_cpu_s": sum(r["cpu"] for r in res)}
        out["writer_cpu_s_per_mb"] = out["writer_cpu_s"] / mb
        if mode == "process":
            out["copied_mb_per_mb"] = sum(r["bytes_shared"] for r in res) / 1e6 / mb
            out["descriptor_bytes_per_mb"] = sum(r["bytes_sent"] for r in res) / mb
            out["ping_p50_us"] = sorted(r["ping_p50_us"] for r in res)[len(res) // 2]
            out["ping_p99_us"] = max(r["ping_p99_us"] for r in res)
            out["service_cpu_s"] = max(r["service_cpu"] for r in res)
        return out
    finally:
        for p in procs:
            if p.poll() is None:
                p.kill()
        for pid in list(service_pids):
            for q in [pid] + _children(pid):
                try:
                    os.kill(q, signal.SIGTERM)
                except ProcessLookupError:
                    pass
        time.sleep(0.5)
        shutil.rmtree(work, ignore_errors=True)
