"""Shared workloads of the storage benchmarks (storage_report.py, hotpath_report.py,
service_modes_report.py, flink/_dstl_side.py), all through the public API to a local directory:
writer -> (pre-emptive) uploads -> persist -> read back."""
from __future__ import annotations

import os
import shutil
import sys
import tempfile
import threading
import time
from typing import Dict, List, Tuple

import numpy as np

sys.path.insert(0, os.path.join(os.path.dirname(__file__), ".."))

from dstl.changelog.storage import open_storage  # noqa: E402
from dstl.types import KeyGroupRange  # noqa: E402

VALUE = 100
CHUNK = 10_000  # rows per append_many call (one Arrow record batch)
KGR = KeyGroupRange(0, 127)
T = 600
LAST_CPU = {"seconds": 0.0}  # process CPU time (all threads) of the last timed region, for the report


def tmpdir() -> str:
    return tempfile.mkdtemp(prefix="dstl-bench-storage-")


def make_data(n: int, seed: int = 1) -> Tuple[np.ndarray, bytes, np.ndarray]:
    """n changes of VALUE bytes over key groups 0..127 in Arrow binary layout."""
    rng = np.random.default_rng(seed)
    data = rng.integers(0, 256, n * VALUE, dtype=np.uint8).tobytes()
    kgs = (np.arange(n) % 128).astype(np.int32)
    offs = np.arange(0, n * VALUE + 1, VALUE, dtype=np.int64)
    return kgs, data, offs


def _dir_bytes(path: str) -> int:
    total = 0
    for root, _, files in os.walk(path):
        total += sum(os.path.getsize(os.path.join(root, f)) for f in files)
    return total


def write_vectorised(base: str, kgs, data, offs, mode: str = "thread") -> Tuple[float, object, int]:
    """append_many in CHUNK-row calls, persist(initial) and wait. -> (seconds, handle, bytes on disk)."""
    n = len(kgs)
    mv = memoryview(data)
    with open_storage(base, upload_mode=mode) as s:
        w = s.create_writer("bench", KGR)
        c0, t0 = time.process_time(), time.perf_counter()
        for start in range(0, n, CHUNK):
            end = min(n, start + CHUNK)
            w.append_many(kgs[start:end], mv[start * VALUE:end * VALUE], offs[start:end + 1] - start * VALUE)
        h = w.persist(w.initial_sequence_number(), 1).result(T).job_manager_owned_snapshot
        elapsed = time.perf_counter() - t0
        LAST_CPU["seconds"] = time.process_time() - c0
        w.close()
    return elapsed, h, _dir_bytes(base)


def write_per_change(base: str, kgs, data, mode: str = "thread") -> Tuple[float, object, int]:
    """One append(kg, bytes) call per change (the object path)."""
    values = [data[i * VALUE:(i + 1) * VALUE] for i in range(len(kgs))]
    kg_list = kgs.tolist()
    with open_storage(base, upload_mode=mode) as s:
        w = s.create_writer("bench", KGR)
        append = w.append
        t0 = time.perf_counter()
        for kg, v in zip(kg_list, values):
            append(kg, v)
        h = w.persist(0, 1).result(T).job_manager_owned_snapshot
        elapsed = time.perf_counter() - t0
        w.close()
    return elapsed, h, _dir_bytes(base)


_BLOBS: Dict[int, bytes] = {}


def _blob(nbytes: int) -> bytes:
    """Random bytes, allocated and touched once: a fresh `bytes(n)` would page-fault during the write."""
    b = _BLOBS.get(nbytes)
    if b is None:
        _BLOBS.clear()
        b = _BLOBS[nbytes] = np.random.default_rng(2).integers(0, 256, nbytes, dtype=np.uint8).tobytes()
    return b


def plain_write_ceiling(path: str, nbytes: int) -> float:
    """The same number of bytes written with one open(...).write of a buffer already in memory."""
    blob = _blob(nbytes)
    c0, t0 = time.process_time(), time.perf_counter()
    with open(path, "wb") as f:
        f.write(blob)
    elapsed = time.perf_counter() - t0
    LAST_CPU["seconds"] = time.process_time() - c0
    os.remove(path)
    return elapsed


def read_back(base: str, handle) -> Tuple[float, int]:
    """Vectorised read of every change of `handle` through a storage reader. -> (seconds, changes)."""
    with open_storage(base, upload_mode="direct") as s:
        reader = s.create_reader()
        t0 = time.perf_counter()
        count = sum(len(kg) for _, kg, _, _ in reader.get_changes_arrays(handle))
        return time.perf_counter() - t0, count


def concurrent_writers(base: str, kgs, data, offs, writers: int = 8) -> Tuple[float, List[object], Dict]:
    """`writers` threads, each appending its share vectorised and persisting, through one batching scheduler."""
    n = len(kgs)
    share = n // writers
    mv = memoryview(data)
    results: List[object] = [None] * writers
    with open_storage(base, upload_mode="thread") as s:
        ws = [s.create_writer(f"op{i}", KGR) for i in range(writers)]
        barrier = threading.Barrier(writers + 1)

        def run(i):
            w = ws[i]
            barrier.wait()
            lo = i * share
            for start in range(lo, lo + share, CHUNK):
                end = min(lo + share, start + CHUNK)
                w.append_many(kgs[start:end], mv[start * VALUE:end * VALUE], offs[start:end + 1] - start * VALUE)
            results[i] = w.persist(0, 1).result(T).job_manager_owned_snapshot

        threads = [threading.Thread(target=run, args=(i,)) for i in range(writers)]
        for t in threads:
            t.start()
        barrier.wait()
        t0 = time.perf_counter()
        for t in threads:
            t.join()
        elapsed = time.perf_counter() - t0
        metrics = s.metrics
        for w in ws:
            w.close()
    return elapsed, results, metrics


def persist_latencies(base: str, checkpoints: int = 200, writers: int = 1, changes: int = 20) -> List[float]:
    """Small checkpoints with the default 10 ms persist delay: seconds from persist() to the result."""
    lat: List[float] = []
    lock = threading.Lock()
    payload = b"v" * VALUE
    with open_storage(base, upload_mode="thread") as s:
        ws = [s.create_writer(f"op{i}", KGR) for i in range(writers)]

        def run(w):
            mine = []
            for cp in range(1, checkpoints + 1):
                for j in range(changes):
                    w.append(j % 128, payload)
                t0 = time.perf_counter()
                w.persist(0, cp).result(T)
                mine.append(time.perf_counter() - t0)
            with lock:
                lat.extend(mine)

        threads = [threading.Thread(target=run, args=(w,)) for w in ws]
        for t in threads:
            t.start()
        for t in threads:
            t.join()
        for w in ws:
            w.close()
    return lat


def cleanup(path: str) -> None:
    shutil.rmtree(path, ignore_errors=True)
