"""The format workload of format_report.py.

1,000,000 changes of 100 bytes over key groups 0..127 (uniformly random, seeded); the operations
are given both implementations side by side (`implementations()`), not through the facade.
"""
from __future__ import annotations

import gc
from types import SimpleNamespace

import numpy as np

N_CHANGES = 1_000_000
PAYLOAD = 100
KEY_GROUPS = 128


def implementations():
    """{"cython": ns, "python": ns}; each ns has ChangeBuffer and the decode functions."""
    from dstl._fast import _buffer_py, _decode_py

    impls = {}
    try:
        from dstl._fast import _buffer, _decode

        impls["cython"] = SimpleNamespace(ChangeBuffer=_buffer.ChangeBuffer, decode=_decode)
    except ImportError:
        pass
    impls["python"] = SimpleNamespace(ChangeBuffer=_buffer_py.ChangeBuffer, decode=_decode_py)
    return impls


class Workload:
    """Inputs in every shape the operations need (built once: ~350 MB)."""

    def __init__(self, n: int = N_CHANGES, payload: int = PAYLOAD, seed: int = 2):
        rng = np.random.default_rng(seed)
        self.n = n
        self.payload_bytes = n * payload
        self.key_groups = rng.integers(0, KEY_GROUPS, n, dtype=np.int32)
        self.data = rng.integers(0, 256, n * payload, dtype=np.uint8).tobytes()
        self.data_mutable = np.frombuffer(bytearray(self.data), dtype=np.uint8)  # forces the copying path
        self.offsets = np.arange(n + 1, dtype=np.int64) * payload
        self.kg_list = self.key_groups.tolist()
        gc.disable()  # a million small objects: do not let the GC rescan them while building
        try:
            self.records = [self.data[i * payload:(i + 1) * payload] for i in range(n)]
        finally:
            gc.enable()
        gc.freeze()  # keep them out of every later collection (they live as long as the benchmark)


def append_and_seal(impl, w: Workload) -> bytes:
    buf = impl.ChangeBuffer()
    append = buf.append
    for kg, record in zip(w.kg_list, w.records):
        append(kg, record)
    return buf.seal()


def append_only(impl, w: Workload):
    buf = impl.ChangeBuffer()
    append = buf.append
    for kg, record in zip(w.kg_list, w.records):
        append(kg, record)
    return buf


def append_many_and_seal(impl, w: Workload) -> bytes:
    buf = impl.ChangeBuffer()
    buf.append_many(w.key_groups, w.data, w.offsets)
    return buf.seal()


def append_many_copy_and_seal(impl, w: Workload) -> bytes:
    buf = impl.ChangeBuffer()
    buf.append_many(w.key_groups, w.data_mutable, w.offsets)
    return buf.seal()


def decode_objects(impl, body):
    changes, end = impl.decode.decode_change_set(body, 0)
    return changes


def decode_arrays(impl, body):
    return impl.decode.decode_change_set_arrays(body, 0)
