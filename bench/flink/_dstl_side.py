"""The dstl half of the Flink side-by-side benchmark: the paths a Python user calls, through the public
API, each timed from the first append to the persisted handle (writes) or over the whole iteration
(reads). Storages are opened once per run, outside the timing, as a task manager keeps Flink's."""
from __future__ import annotations

import os
import sys
import time
from typing import List, NamedTuple, Sequence, Tuple

import numpy as np

sys.path.insert(0, os.path.join(os.path.dirname(os.path.abspath(__file__)), ".."))
import _storage_data as sd  # noqa: E402  (puts the repository first on sys.path too)

from dstl import KeyGroupRange  # noqa: E402

PERSIST_TIMEOUT = 600.0
KEY_GROUPS = 128  # sd.make_data spreads changes over key groups 0..127
VALUE = sd.VALUE
# where the last write's appending thread finished: {"appends": s, "tail": s} (persist() to handle), and
# the CPU time it took in all: this process's threads plus the upload service's processes ("cpu": s)
LAST_SPLIT = {"appends": 0.0, "tail": 0.0, "cpu": 0.0}
_CLOCK_TICKS = os.sysconf("SC_CLK_TCK") if hasattr(os, "sysconf") else 100


def _service_pids(storage) -> List[int]:
    """The upload service's processes (service, registry, uploaders) of a process-mode storage."""
    status = getattr(storage.scheduler, "status", None)
    if status is None:
        return []
    st = status()
    return [p for p in [st.get("pid"), st.get("registry_pid"), *st.get("uploader_pids", [])] if p]


def cpu_seconds(pids: Sequence[int]) -> float:
    """CPU time (user + system) of this process and of `pids` so far (Linux /proc; 10 ms ticks)."""
    total = time.process_time()
    for pid in pids:
        try:
            with open(f"/proc/{pid}/stat") as f:
                fields = f.read().rsplit(")", 1)[1].split()
            total += (int(fields[11]) + int(fields[12])) / _CLOCK_TICKS
        except (OSError, IndexError, ValueError):
            pass
    return total


class Workload(NamedTuple):
    """n changes of VALUE bytes; change i goes to key group i % key_groups (as on the Java side)."""
    kgs: np.ndarray          # int32 key groups
    data: bytes              # the payloads back to back
    offsets: np.ndarray      # int64, n + 1 entries
    values: List[bytes]      # the same payloads as one bytes object each (the per-record path)
    kg_list: List[int]
    chunk: int               # rows per append_many call
    key_groups: int

    @property
    def n(self) -> int:
        return len(self.kgs)

    @property
    def key_group_range(self) -> KeyGroupRange:
        return KeyGroupRange(0, self.key_groups - 1)


def make_workload(n: int) -> Workload:
    """The storage benchmarks' workload (bench/_storage_data.py): VALUE-byte random payloads, key
    group i % 128, append_many in CHUNK-row calls; plus the payloads as bytes objects, sliced once."""
    kgs, data, offsets = sd.make_data(n)
    values = [data[i * sd.VALUE:(i + 1) * sd.VALUE] for i in range(n)]
    return Workload(kgs, data, offsets, values, kgs.tolist(), sd.CHUNK, KEY_GROUPS)


def write_vectorised(storage, log_name: str, w: Workload, checkpoint_id: int) -> Tuple[float, object]:
    """append_many in `chunk`-row calls, persist(initial) and wait. -> (seconds, handle)."""
    writer = storage.create_writer(log_name, w.key_group_range)
    mv, kgs, offs, step, n = memoryview(w.data), w.kgs, w.offsets, w.chunk, w.n
    value = VALUE
    pids = _service_pids(storage)
    c0 = cpu_seconds(pids)
    t0 = time.perf_counter()
    for start in range(0, n, step):
        end = min(n, start + step)
        writer.append_many(kgs[start:end], mv[start * value:end * value], offs[start:end + 1] - start * value)
    t1 = time.perf_counter()
    handle = writer.persist(writer.initial_sequence_number(), checkpoint_id).result(PERSIST_TIMEOUT)
    elapsed = time.perf_counter() - t0
    LAST_SPLIT.update(appends=t1 - t0, tail=elapsed - (t1 - t0), cpu=cpu_seconds(pids) - c0)
    writer.close()
    return elapsed, handle.job_manager_owned_snapshot


def write_per_record(storage, log_name: str, w: Workload, checkpoint_id: int) -> Tuple[float, object]:
    """One writer.append(kg, bytes) per change in a Python loop, persist(initial) and wait."""
    writer = storage.create_writer(log_name, w.key_group_range)
    append = writer.append
    pids = _service_pids(storage)
    c0 = cpu_seconds(pids)
    t0 = time.perf_counter()
    for kg, v in zip(w.kg_list, w.values):
        append(kg, v)
    t1 = time.perf_counter()
    handle = writer.persist(writer.initial_sequence_number(), checkpoint_id).result(PERSIST_TIMEOUT)
    elapsed = time.perf_counter() - t0
    LAST_SPLIT.update(appends=t1 - t0, tail=elapsed - (t1 - t0), cpu=cpu_seconds(pids) - c0)
    writer.close()
    return elapsed, handle.job_manager_owned_snapshot


def read_arrays(storage, handle) -> Tuple[float, int]:
    """Every change set as arrays through get_changes_arrays. -> (seconds, changes)."""
    reader = storage.create_reader()
    t0 = time.perf_counter()
    count = 0
    with reader.get_changes_arrays(handle) as it:
        for _, kgs, _, _ in it:
            count += len(kgs)
    return time.perf_counter() - t0, count


def read_objects(storage, handle) -> Tuple[float, int]:
    """`for c in reader.get_changes(handle)`: one StateChange object per change. -> (seconds, changes)."""
    reader = storage.create_reader()
    t0 = time.perf_counter()
    count = 0
    with reader.get_changes(handle) as it:
        for _ in it:
            count += 1
    return time.perf_counter() - t0, count


def payload_bytes(storage, handle) -> int:
    """Sum of the read-back payload lengths (a correctness check, outside any timing)."""
    with storage.create_reader().get_changes_arrays(handle) as it:
        return sum(int(np.asarray(lengths).sum()) for _, _, _, lengths in it)


def handle_shape(handle) -> dict:
    """How a persist came out: change sets, distinct files and their logical size."""
    files = {}
    for stream, _ in handle.handles_and_offsets:
        files[stream.path] = stream.size
    return {"change_sets": len(handle.handles_and_offsets), "files": len(files),
            "file_bytes": sum(files.values())}


def discard(handles: Sequence[object]) -> None:
    """Delete the files of finished rounds (the benchmark's own temporary directory)."""
    for handle in handles:
        for stream, _ in handle.handles_and_offsets:
            try:
                os.remove(stream.path)
            except FileNotFoundError:
                pass
