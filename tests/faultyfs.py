"""A fault-injecting fsspec filesystem for tests: protocol ``faulty``, backed by a local directory.

URLs are ``faulty://<absolute local path>``; every operation works on that local path, so tests can
inspect the files directly. Faults are queued on the module-level controller ``FAULTS`` and each one
is consumed by the next matching operation, in FIFO order::

    from faultyfs import FAULTS, faulty_url, faulty  # `faulty` is a pytest fixture (resets FAULTS)

    def test_retry(faulty, tmp_path):
        base = faulty_url(tmp_path)              # "faulty:///tmp/.../"
        FAULTS.fail_writes(2)                    # the next 2 write-opens raise OSError at open
        FAULTS.fail_writes(1, at="write")        # ... then one raises at its first write()
        FAULTS.hang(5.0)                         # ... then one blocks up to 5 s in open, then proceeds
        FAULTS.fail_after_bytes(100)             # ... then one writes 100 bytes, then raises
        FAULTS.partial_then_fail_at_close(10)    # ... then one keeps only 10 bytes on disk, close raises
        FAULTS.fail_at_close()                   # ... then one writes everything, close raises
        ...
        assert FAULTS.write_opens == 7 and FAULTS.failed_writes == 5

Write faults apply to opens in a writing mode ("wb", "xb", "ab"; also ``pipe_file``); read faults
(``fail_reads``, ``hang_reads``) to "rb" opens and ``cat_file``. ``hang`` waits on an event, so
``FAULTS.release_hangs()`` (or ``FAULTS.reset()``, which the fixture calls at teardown) wakes every
hanging call at once; a hang is always bounded by its ``seconds``. ``hang(..., then="fail")`` raises
``OSError`` after the wait instead of proceeding. ``fail_deletes(n)`` makes ``rm_file`` raise.

Counters (all reset by ``reset()``): ``write_opens``, ``completed_writes`` (closed without a fault),
``failed_writes`` (an injected write fault fired), ``read_opens``, ``failed_reads``, ``deletes``,
``bytes_written``; ``events`` lists ``(operation, path, fault or None)`` in order.
The filesystem is registered with ``fsspec.register_implementation`` when this module is imported.
"""
from __future__ import annotations

import io
import os
import threading
from collections import deque
from dataclasses import dataclass
from typing import Deque, List, Optional, Tuple

import fsspec
from fsspec.implementations.local import LocalFileSystem

PROTOCOL = "faulty"


@dataclass
class Fault:
    """One injected fault. `kind`: open | write | after_bytes | partial_close | close | hang."""

    kind: str
    nbytes: int = 0          # after_bytes: bytes written before failing; partial_close: bytes kept
    seconds: float = 0.0     # hang: upper bound of the wait
    then: str = "proceed"    # hang: "proceed" or "fail" afterwards
    where: str = "open"      # hang: "open", "write" or "close"


class FaultController:
    """Queued faults and counters shared by every `FaultyFileSystem` instance of this process."""

    def __init__(self) -> None:
        self._lock = threading.Lock()
        self._release = threading.Event()
        self.reset()

    # --- configuring ---------------------------------------------------------------------------
    def reset(self) -> None:
        """Wake hanging calls, drop queued faults and zero the counters."""
        with self._lock:
            self._release.set()
            self._release = threading.Event()
            self.write_faults: Deque[Fault] = deque()
            self.read_faults: Deque[Fault] = deque()
            self.delete_faults = 0
            self.write_opens = 0
            self.completed_writes = 0
            self.failed_writes = 0
            self.read_opens = 0
            self.failed_reads = 0
            self.deletes = 0
            self.bytes_written = 0
            self.events: List[Tuple[str, str, Optional[str]]] = []

    def fail_writes(self, n: int = 1, at: str = "open") -> None:
        """The next `n` write-opens raise OSError at open (`at="open"`) or at the first write."""
        if at not in ("open", "write"):
            raise ValueError(f"at must be 'open' or 'write', got {at!r}")
        self._queue(self.write_faults, [Fault(at) for _ in range(n)])

    def hang(self, seconds: float, n: int = 1, then: str = "proceed", where: str = "open") -> None:
        """The next `n` write-opens block up to `seconds` (at open, first write or close), then
        proceed or fail; `release_hangs()` ends the wait early."""
        if then not in ("proceed", "fail") or where not in ("open", "write", "close"):
            raise ValueError(f"bad hang spec then={then!r} where={where!r}")
        self._queue(self.write_faults, [Fault("hang", seconds=seconds, then=then, where=where) for _ in range(n)])

    def fail_after_bytes(self, k: int, n: int = 1) -> None:
        """The next `n` write streams store `k` bytes, then the write crossing byte `k` raises."""
        self._queue(self.write_faults, [Fault("after_bytes", nbytes=k) for _ in range(n)])

    def partial_then_fail_at_close(self, keep: int, n: int = 1) -> None:
        """The next `n` write streams keep only their first `keep` bytes on disk; close raises."""
        self._queue(self.write_faults, [Fault("partial_close", nbytes=keep) for _ in range(n)])

    def fail_at_close(self, n: int = 1) -> None:
        """The next `n` write streams write everything, then close raises OSError."""
        self._queue(self.write_faults, [Fault("close") for _ in range(n)])

    def succeed(self, n: int = 1) -> None:
        """Queue `n` write-opens without a fault (to place faults later in a sequence)."""
        self._queue(self.write_faults, [Fault("none") for _ in range(n)])

    def fail_reads(self, n: int = 1) -> None:
        """The next `n` read-opens (or cat_file calls) raise OSError."""
        self._queue(self.read_faults, [Fault("open") for _ in range(n)])

    def hang_reads(self, seconds: float, n: int = 1) -> None:
        self._queue(self.read_faults, [Fault("hang", seconds=seconds) for _ in range(n)])

    def fail_deletes(self, n: int = 1) -> None:
        with self._lock:
            self.delete_faults += n

    def release_hangs(self) -> None:
        """Wake every call hanging now (later hangs block again)."""
        with self._lock:
            self._release.set()
            self._release = threading.Event()

    def _queue(self, q: Deque[Fault], faults: List[Fault]) -> None:
        with self._lock:
            q.extend(faults)

    # --- used by the filesystem ----------------------------------------------------------------
    def _next(self, q: Deque[Fault]) -> Optional[Fault]:
        with self._lock:
            return q.popleft() if q else None

    def _count(self, name: str, n: int = 1) -> None:
        with self._lock:
            setattr(self, name, getattr(self, name) + n)

    def _event(self, op: str, path: str, fault: Optional[Fault]) -> None:
        with self._lock:
            self.events.append((op, path, fault.kind if fault else None))

    def _hang(self, fault: Fault, path: str) -> None:
        with self._lock:
            release = self._release
        release.wait(fault.seconds)
        if fault.then == "fail":
            raise OSError(f"faulty: injected failure after hanging on {path}")

    def pending_write_faults(self) -> int:
        with self._lock:
            return len(self.write_faults)


FAULTS = FaultController()


class _FaultyWriter(io.RawIOBase):
    """A binary write stream over a local file that fires one queued fault."""

    def __init__(self, local_path: str, mode: str, fault: Optional[Fault], controller: FaultController):
        super().__init__()
        self._path = local_path
        self._fault = fault
        self._ctl = controller
        self._written = 0
        self._fired = False
        self._file = open(local_path, mode)
        self._buffer_for_partial = bytearray() if fault and fault.kind == "partial_close" else None

    def writable(self) -> bool:
        return True

    def _fire(self, message: str) -> None:
        if not self._fired:
            self._fired = True
            self._ctl._count("failed_writes")
        raise OSError(f"faulty: {message} ({self._path})")

    def _hang(self, f: Fault) -> None:
        try:
            self._ctl._hang(f, self._path)
        except OSError:
            self._fired = True
            self._ctl._count("failed_writes")
            raise

    def write(self, b) -> int:
        if self.closed:
            raise ValueError("write to a closed file")
        data = bytes(b)
        f = self._fault
        if f is not None and not self._fired:
            if f.kind == "write":
                self._fire("injected failure at write")
            if f.kind == "hang" and f.where == "write" and self._written == 0:
                self._hang(f)
            if f.kind == "after_bytes" and self._written + len(data) > f.nbytes:
                keep = f.nbytes - self._written
                self._file.write(data[:keep])
                self._file.flush()
                self._written += keep
                self._ctl._count("bytes_written", keep)
                self._fire(f"injected failure after {f.nbytes} bytes")
        elif self._fired:
            raise OSError(f"faulty: stream already failed ({self._path})")
        if self._buffer_for_partial is not None:
            self._buffer_for_partial += data
        else:
            self._file.write(data)
            self._ctl._count("bytes_written", len(data))
        self._written += len(data)
        return len(data)

    def flush(self) -> None:
        if not self._file.closed and self._buffer_for_partial is None:
            self._file.flush()

    def close(self) -> None:
        if self.closed:
            return
        f = self._fault
        try:
            if f is not None and not self._fired:
                if f.kind == "hang" and f.where == "close":
                    self._hang(f)
                if f.kind == "partial_close":
                    kept = bytes(self._buffer_for_partial[: f.nbytes])
                    self._file.write(kept)
                    self._ctl._count("bytes_written", len(kept))
                    self._file.close()
                    self._fire(f"injected failure at close after keeping {len(kept)} bytes")
                if f.kind == "close":
                    self._file.close()
                    self._fire("injected failure at close")
            self._file.close()
            if not self._fired:
                self._ctl._count("completed_writes")
        finally:
            self._file.close()
            super().close()


class FaultyFileSystem(LocalFileSystem):
    """`LocalFileSystem` under the `faulty` protocol, with the faults queued on `FAULTS`."""

    protocol = PROTOCOL
    controller = FAULTS

    def _open(self, path, mode="rb", block_size=None, **kwargs):
        local = self._strip_protocol(path)
        ctl = self.controller
        if any(c in mode for c in "wxa"):
            ctl._count("write_opens")
            fault = ctl._next(ctl.write_faults)
            ctl._event("open-write", local, fault)
            if fault is not None:
                if fault.kind == "open":
                    ctl._count("failed_writes")
                    raise OSError(f"faulty: injected failure at open for writing ({local})")
                if fault.kind == "hang" and fault.where == "open":
                    try:
                        ctl._hang(fault, local)
                    except OSError:
                        ctl._count("failed_writes")
                        raise
                    fault = None
                elif fault.kind == "none":
                    fault = None
            if self.auto_mkdir:
                self.makedirs(self._parent(local), exist_ok=True)
            raw_mode = mode if "b" in mode else mode + "b"
            return _FaultyWriter(local, raw_mode, fault, ctl)
        ctl._count("read_opens")
        fault = ctl._next(ctl.read_faults)
        ctl._event("open-read", local, fault)
        if fault is not None:
            if fault.kind == "hang":
                ctl._hang(fault, local)
            else:
                ctl._count("failed_reads")
                raise OSError(f"faulty: injected failure at open for reading ({local})")
        return open(local, "rb")

    def cat_file(self, path, start=None, end=None, **kwargs):
        with self._open(path, "rb") as f:
            if start is not None:
                f.seek(start if start >= 0 else max(0, os.path.getsize(self._strip_protocol(path)) + start))
            if end is None:
                return f.read()
            size = os.path.getsize(self._strip_protocol(path))
            end = end if end >= 0 else size + end
            return f.read(max(0, end - f.tell()))

    def pipe_file(self, path, value, mode="overwrite", **kwargs):
        with self._open(path, "xb" if mode == "create" else "wb") as f:
            f.write(value)

    def rm_file(self, path):
        local = self._strip_protocol(path)
        ctl = self.controller
        with ctl._lock:
            fail = ctl.delete_faults > 0
            if fail:
                ctl.delete_faults -= 1
        ctl._event("delete", local, Fault("delete") if fail else None)
        if fail:
            raise OSError(f"faulty: injected failure deleting {local}")
        ctl._count("deletes")
        os.remove(local)

    def rm(self, path, recursive=False, maxdepth=None):
        paths = path if isinstance(path, list) else [path]
        for p in paths:
            if self.isdir(p):
                super().rm(p, recursive=recursive, maxdepth=maxdepth)
            else:
                self.rm_file(p)


fsspec.register_implementation(PROTOCOL, FaultyFileSystem, clobber=True)


def faulty_url(local_dir) -> str:
    """`faulty://<absolute path>` for a local directory (no trailing slash)."""
    return f"{PROTOCOL}://{os.path.abspath(os.fspath(local_dir))}"


try:
    import pytest

    @pytest.fixture
    def faulty():
        """Resets `FAULTS` before and after the test (waking any hang); yields the controller."""
        FAULTS.reset()
        try:
            yield FAULTS
        finally:
            FAULTS.reset()
except ImportError:  # pragma: no cover - usable without pytest too
    pass

__all__ = ["FAULTS", "FaultController", "FaultyFileSystem", "Fault", "faulty_url", "PROTOCOL"]
