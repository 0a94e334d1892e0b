"""Workloads of bench/state_report.py (keyed state).

* update: `ValueState.update_many` in batches (pandas/numpy columns), every row one change appended to
  the changelog writer (thread upload mode, so pre-emptive uploads run in the background as in a job).
* restore: a changelog of `size_mb` MB (value changes of ~`value_bytes` bytes over `users` keys), then
  a restore of a quarter of the key groups, from the changelog only or from a materialization + tail.
"""
from __future__ import annotations

import os
import shutil
import tempfile
import time
from dataclasses import dataclass
from typing import Dict, Optional

import numpy as np
import pandas as pd

from dstl.state.backend import KeyedStateBackend
from dstl.changelog.storage import open_storage
from dstl.types import KeyGroupRange

MAXP = 128
FULL = KeyGroupRange(0, MAXP - 1)
QUARTER = KeyGroupRange(0, MAXP // 4 - 1)


def update_workload(n: int = 1_000_000, users: int = 1_000_000, string_keys: bool = False, seed: int = 1):
    rng = np.random.default_rng(seed)
    ids = rng.integers(0, users, n)
    keys = pd.Series([f"user-{i}" for i in ids]) if string_keys else ids.astype(np.int64)
    values = rng.integers(0, 1_000_000, n).astype(np.int64)
    return keys, values


def run_updates(keys, values, batch: int = 100_000, base: Optional[str] = None) -> Dict[str, float]:
    """Seconds for all update_many calls (appends included), then the final persist separately."""
    own = base is None
    base = base or tempfile.mkdtemp(prefix="dstl-bench-state-")
    try:
        with open_storage(base) as st:
            b = KeyedStateBackend(st, "bench", FULL, MAXP)
            v = b.value_state("v")
            n = len(values)
            c0 = time.process_time()
            t0 = time.perf_counter()
            for i in range(0, n, batch):
                v.update_many(keys[i:i + batch], values[i:i + batch])
            t1 = time.perf_counter()
            cpu = time.process_time() - c0
            b.snapshot(1).result(timeout=600)
            t2 = time.perf_counter()
            b.close()
        return {"updates": n, "update_s": t1 - t0, "update_cpu_s": cpu, "persist_s": t2 - t1}
    finally:
        if own:
            shutil.rmtree(base, ignore_errors=True)


@dataclass
class Changelog:
    base: str
    storage: object
    plain: object          # KeyedStateSnapshot: changelog only
    materialized: object   # KeyedStateSnapshot: materialization + short tail
    logical_bytes: int     # logical size of the files the plain snapshot reads
    changes: int


def _files_logical_size(snapshot) -> int:
    seen = {}
    for h in snapshot.handles():
        for sh, _ in h.handles_and_offsets:
            seen[sh.path] = sh.size
    return sum(seen.values())


def build_changelog(size_mb: int = 1024, users: int = 1_000_000, value_bytes: int = 100,
                    batch: int = 200_000, seed: int = 2) -> Changelog:
    """Write about `size_mb` MB of value changes; take a plain snapshot, then materialize and take
    another one after a short tail (1% more changes)."""
    base = tempfile.mkdtemp(prefix="dstl-bench-restore-")
    st = open_storage(base)
    b = KeyedStateBackend(st, "bench", FULL, MAXP)
    v = b.value_state("v")
    rng = np.random.default_rng(seed)
    pool = np.array(["x" * (value_bytes - 8) + f"{i:08d}" for i in range(1000)], dtype=object)
    per_change = value_bytes + 16   # payload (op, array header, id, key, value) + framing, roughly
    target = size_mb * 1024 * 1024
    changes = 0
    while changes * per_change < target:
        ids = rng.integers(0, users, batch).astype(np.int64)
        v.update_many(ids, pd.Series(pool[rng.integers(0, len(pool), batch)]))
        changes += batch
    plain = b.snapshot(1).result(timeout=600)
    b.confirm(1)
    b.materialize()
    tail = max(changes // 100, 1)
    v.update_many(rng.integers(0, users, tail).astype(np.int64), pd.Series(pool[rng.integers(0, len(pool), tail)]))
    mat = b.snapshot(2).result(timeout=600)
    b.close()
    return Changelog(base, st, plain, mat, _files_logical_size(plain), changes)


def run_restore(cl: Changelog, which: str = "plain", key_group_range: KeyGroupRange = QUARTER) -> Dict[str, float]:
    snap = cl.plain if which == "plain" else cl.materialized
    c0 = time.process_time()
    t0 = time.perf_counter()
    r = KeyedStateBackend.restore(cl.storage, "bench", key_group_range, MAXP, [snap])
    dt = time.perf_counter() - t0
    cpu = time.process_time() - c0
    stats = dict(r.restore_stats)
    stats["keys"] = len(r.get_state("v"))
    r.close()
    stats["seconds"] = dt
    stats["cpu_seconds"] = cpu
    stats["files_bytes"] = _files_logical_size(snap)
    return stats


def drop_changelog(cl: Changelog) -> None:
    cl.storage.close()
    shutil.rmtree(cl.base, ignore_errors=True)


def du(path: str) -> int:
    total = 0
    for root, _, files in os.walk(path):
        for f in files:
            total += os.path.getsize(os.path.join(root, f))
    return total
