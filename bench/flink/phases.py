"""The parts of the Flink side-by-side run that are not Flink: floors measured in the same rounds and
the phases of one vectorised write, each timed on its own over the same 1M x 100 B workload.

Phases of a vectorised write (what `append_many` + `persist` is made of, docs/benchmarks.md):
  pack         ChangeBuffer.append_many in 10,000-row calls, seal_body at the pre-emptive threshold:
               framing only (record arrays); the immutable payload is referenced, not copied
  body copy    the one user-space copy of the payload, the body's canonical (key-group ordered)
               layout: thread mode's, in 512 KiB pieces (write_bodies to /dev/null, which takes the
               bytes without copying them); process mode's, SealedBody.write_into a shared-memory file
  file write   os.write of each laid-out body from that buffer into one new file: the page-cache copy
  thread upload  write_bodies of the bodies into one new file: what a thread-mode upload does, the
               layout made one L2-sized piece at a time and each piece written while in the cache
  shm -> file  the same bodies from a shared-memory file with FileSpan.send_to from a kept mapping:
               the upload service's copy (process mode)
The end-to-end write of each mode is split where the appending thread finishes: `appends` (every
append_many call, the pre-emptive hand-offs and whatever the upload threads take from the appending
thread) and `tail` (persist() until the handle: the 10 ms batching delay, the last upload, metadata
and the acknowledgement).

Floors:
  plain write  the payload, one buffer, one write() to a new file
  plain read   that file read back with one readinto() into a reused buffer (page cache warm)
  call floor   `for kg, v in zip(...): operator.is_(kg, v)`: the same loop calling a C function that
               does nothing with the same two arguments (vectorcall, METH_FASTCALL): the interpreter's
               floor for any per-record append
  append call  `for kg, v in zip(...): writer.append(kg, v)` in the same 50,000-call blocks, sealed
               and dropped in between, nothing uploading beside it: the call itself
  dict floor   `d[k] = v` and `d.get(k)` per key, beside ValueState.update/get per key
"""
from __future__ import annotations

import mmap
import operator
import os
import tempfile
import time
from typing import Dict, List

import numpy as np

from dstl.format import ChangeBuffer

STATE_CALLS = 500_000
STATE_KEYS = 100_000
THRESHOLD = 5 << 20  # the default pre-emptive persist threshold: the bodies a write cuts


class Phases:
    """Warm buffers kept across rounds (as the writer's spare buffers and the service's segment pool
    are), in the run's temporary directory; `close()` removes them."""

    def __init__(self, root: str, workload):
        self.root = root
        self.w = workload
        total = len(workload.data) + 4 * workload.n + (1 << 20)  # the bodies: payload, 4 B per change, headers
        self._out = bytearray(16 << 20)
        fd, self._shm_path = tempfile.mkstemp(prefix="dstl-bench-phases-", dir=_shm_dir())
        self._shm_fd = fd
        os.ftruncate(fd, total)
        self._shm = mmap.mmap(fd, total)
        self._read_buf = bytearray(len(workload.data))
        rng = np.random.default_rng(3)
        self.ids = rng.integers(0, STATE_KEYS, STATE_CALLS).tolist()
        self.vals = rng.integers(0, 1_000_000, STATE_CALLS).tolist()

    def close(self) -> None:
        self._shm.close()
        os.close(self._shm_fd)
        os.unlink(self._shm_path)

    # -- phases of one vectorised write ------------------------------------------------------
    def write_phases(self) -> Dict[str, float]:
        w = self.w
        mv, kgs, offs, step, n, value = memoryview(w.data), w.kgs, w.offsets, w.chunk, w.n, len(w.values[0])
        buf = ChangeBuffer()
        bodies = []
        t0 = time.perf_counter()
        for start in range(0, n, step):
            end = min(n, start + step)
            buf.append_many(kgs[start:end], mv[start * value:end * value], offs[start:end + 1] - start * value)
            if buf.size >= THRESHOLD:
                bodies.append(buf.seal_body())
        if len(buf):
            bodies.append(buf.seal_body())
        pack = time.perf_counter() - t0

        from dstl.changelog.upload.uploader import FileSpan
        from dstl.format import write_bodies

        null = os.open(os.devnull, os.O_WRONLY)
        t0 = time.perf_counter()
        try:
            write_bodies([null], bodies)  # the layout alone: /dev/null takes the pieces without a copy
        finally:
            os.close(null)
        copy = time.perf_counter() - t0
        out = self._out
        path = os.path.join(self.root, "phases-thread")
        write = 0.0
        fd = os.open(path, os.O_WRONLY | os.O_CREAT | os.O_TRUNC, 0o644)
        try:
            for body in bodies:
                size = body.write_into(out, 0)
                t1 = time.perf_counter()
                _write_all(fd, memoryview(out)[:size])
                write += time.perf_counter() - t1
        finally:
            os.close(fd)
        os.remove(path)

        path = os.path.join(self.root, "phases-thread-upload")
        fd = os.open(path, os.O_WRONLY | os.O_CREAT | os.O_TRUNC, 0o644)
        t0 = time.perf_counter()
        try:
            write_bodies([fd], bodies)
        finally:
            os.close(fd)
        thread_upload = time.perf_counter() - t0
        os.remove(path)

        spans, pos = [], 0
        t0 = time.perf_counter()
        for body in bodies:
            size = body.write_into(self._shm, pos)
            spans.append(FileSpan(self._shm_fd, pos, size, self._shm))  # kept mapped, as the uploaders do
            pos += size
        shm_copy = time.perf_counter() - t0
        path = os.path.join(self.root, "phases-process")
        fd = os.open(path, os.O_WRONLY | os.O_CREAT | os.O_TRUNC, 0o644)
        t0 = time.perf_counter()
        try:
            for span in spans:
                span.send_to(fd)
        finally:
            os.close(fd)
        shm_to_file = time.perf_counter() - t0
        os.remove(path)
        return {"pack": pack, "body_copy": copy, "file_write": write, "thread_upload": thread_upload,
                "body_copy_shm": shm_copy, "shm_to_file": shm_to_file, "bodies": len(bodies)}

    # -- floors ------------------------------------------------------------------------------
    def plain_write_read(self, name: str) -> Dict[str, float]:
        """One write() of the payload to a new file, then one readinto() of it (page cache warm)."""
        path = os.path.join(self.root, name)
        c0 = time.process_time()
        t0 = time.perf_counter()
        with open(path, "wb") as f:
            f.write(self.w.data)
        write = time.perf_counter() - t0
        write_cpu = time.process_time() - c0
        t0 = time.perf_counter()
        with open(path, "rb", buffering=0) as f:
            got = f.readinto(self._read_buf)
        read = time.perf_counter() - t0
        os.remove(path)
        if got != len(self.w.data):
            raise RuntimeError(f"plain read got {got} bytes, expected {len(self.w.data)}")
        return {"plain_write": write, "plain_read": read, "plain_write_cpu": write_cpu}

    def append_calls(self, storage) -> Dict[str, float]:
        """The per-record `writer.append` loop on its own beside the no-op call loop, alternating in
        50,000-call blocks (5 MB: about the change set a pre-emptive persist cuts) so that both see the
        same machine. Each append block is sealed and dropped afterwards, as an upload does: the memory
        is warm and nothing uploads beside the loop. -> seconds of each, summed over the 1M calls."""
        from dstl.types import KeyGroupRange

        noop, kgl, values, n = operator.is_, self.w.kg_list, self.w.values, self.w.n
        writer = storage.create_writer(f"phases-append-{time.monotonic_ns()}", KeyGroupRange(0, 127))
        out = {"append_calls": 0.0, "call_floor": 0.0}
        try:
            writer._threshold = 1 << 62  # no pre-emptive persist: nothing runs beside the loop
            append = writer.append
            for start in range(0, n, 50_000):
                ks, vs = kgl[start:start + 50_000], values[start:start + 50_000]
                t0 = time.perf_counter()
                for kg, v in zip(ks, vs):
                    noop(kg, v)
                t1 = time.perf_counter()
                for kg, v in zip(ks, vs):
                    append(kg, v)
                t2 = time.perf_counter()
                out["call_floor"] += t1 - t0
                out["append_calls"] += t2 - t1
                writer._take_active()  # the body is dropped: its memory goes back to the spares
        finally:
            writer.close()
        return out

    def keyed_state(self, storage) -> Dict[str, float]:
        """ns per call: ValueState.update/get per key (changelog appends included) and a dict's."""
        from dstl.state.backend import KeyedStateBackend
        from dstl.types import KeyGroupRange

        ids, vals = self.ids, self.vals
        out = {}
        d: dict = {}
        t0 = time.perf_counter()
        for k, x in zip(ids, vals):
            d[k] = x
        out["dict_set"] = time.perf_counter() - t0
        get = d.get
        t0 = time.perf_counter()
        for k in ids:
            get(k)
        out["dict_get"] = time.perf_counter() - t0
        backend = KeyedStateBackend(storage, f"phases-{time.monotonic_ns()}", KeyGroupRange(0, 127), 128)
        try:
            v = backend.value_state("v")
            update, vget = v.update, v.get
            t0 = time.perf_counter()
            for k, x in zip(ids, vals):
                update(k, x)
            out["value_update"] = time.perf_counter() - t0
            t0 = time.perf_counter()
            for k in ids:
                vget(k)
            out["value_get"] = time.perf_counter() - t0
        finally:
            backend.close()
        return {key: s / len(ids) * 1e9 for key, s in out.items()}


def _shm_dir() -> str:
    return "/dev/shm" if os.path.isdir("/dev/shm") and os.access("/dev/shm", os.W_OK) else tempfile.gettempdir()


def _write_all(fd: int, view) -> None:
    while view:
        view = view[os.write(fd, view):]


def summarise_rounds(rounds: List[Dict[str, float]]) -> Dict[str, dict]:
    """Per key: every round's value, median, min, max."""
    import statistics

    keys = rounds[0].keys() if rounds else []
    return {k: {"per_round": [r[k] for r in rounds], "median": statistics.median(r[k] for r in rounds),
                "min": min(r[k] for r in rounds), "max": max(r[k] for r in rounds)} for k in keys}
