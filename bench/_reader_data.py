"""Shared workload of the reader benchmarks: N changes of 100 bytes over key groups 0..127, written
as change sets of 10,000 changes into one file (raw or snappy), read back through the public reader."""
from __future__ import annotations

import os
import sys
import tempfile

import numpy as np

sys.path.insert(0, os.path.join(os.path.dirname(__file__), ".."))

from dstl import format as fmt  # noqa: E402
from dstl.changelog.handles import ChangelogStateHandleStreamImpl, StreamStateHandle  # noqa: E402
from dstl.changelog.reader import DownloadCache, StateChangelogReader  # noqa: E402
from dstl.types import KeyGroupRange  # noqa: E402

VALUE = 100
PER_SET = 10_000


def write_file(directory: str, n: int, compression=None) -> ChangelogStateHandleStreamImpl:
    """One file of n changes in change sets of PER_SET; returns the handle over all of them."""
    rng = np.random.default_rng(1)
    bodies = []
    for start in range(0, n, PER_SET):
        m = min(PER_SET, n - start)
        buf = fmt.ChangeBuffer()
        data = rng.integers(0, 256, m * VALUE, dtype=np.uint8).tobytes()
        kgs = (np.arange(start, start + m) % 128).astype(np.int32)
        offs = np.arange(0, m * VALUE + 1, VALUE, dtype=np.int64)
        buf.append_many(kgs, data, offs)
        bodies.append(buf.seal())
    path = os.path.join(directory, f"changes-{compression or 'raw'}")
    with open(path, "wb") as f:
        offsets, size = fmt.write_file(f, bodies, compression=compression)
    stream = StreamStateHandle(path, size)
    return ChangelogStateHandleStreamImpl([(stream, o) for o in offsets], KeyGroupRange(0, 127), n * VALUE)


def read_objects(handle, reader=None) -> int:
    reader = reader or StateChangelogReader()
    count = 0
    for _ in reader.get_changes(handle):
        count += 1
    return count


def read_arrays(handle, reader=None) -> int:
    reader = reader or StateChangelogReader()
    return sum(len(kgs) for _, kgs, _, _ in reader.get_changes_arrays(handle))


def load_logical(handle):
    """The file's logical stream, read into memory once (outside any timing)."""
    return fmt.to_logical(open(handle.handles_and_offsets[0][0].path, "rb").read())


def decode_in_memory(handle, logical) -> int:
    """The floor: decode the same change sets from bytes already in memory, no reader around it."""
    return sum(len(fmt.decode_change_set_arrays(logical, o)[0]) for _, o in handle.handles_and_offsets)


def tmpdir() -> str:
    return tempfile.mkdtemp(prefix="dstl-bench-reader-")


__all__ = ["write_file", "read_objects", "read_arrays", "decode_in_memory", "load_logical", "DownloadCache", "tmpdir"]
