"""The service's side of the registry process: numbered operations, acknowledgements, restarts.

Every operation gets an id larger than any earlier one (also across service restarts: ids start at the
wall clock in ns). Unacknowledged operations are kept; when the registry process dies, a new one is
started, replays its journal, says which id it applied last, and only the later operations are sent
again. A release is therefore applied exactly once even if the registry died right after applying it.
"""
from __future__ import annotations

import itertools
import logging
import threading
import time
from collections import OrderedDict
from concurrent.futures import Future
from typing import Dict, Optional

from dstl.errors import UploadServiceError

log = logging.getLogger("dstl.changelog.upload.service.forwarder")


class RegistryForwarder:
    """Owns the registry process; `submit(kind, *args)` is asynchronous, `query(...)` waits for a reply."""

    def __init__(self, ctx, journal_dir: str, discard_threads: int, checkpoints_base: Optional[str] = None):
        self._ctx = ctx
        self._checkpoints_base = checkpoints_base
        self._journal_dir = journal_dir
        self._discard_threads = discard_threads
        self._lock = threading.Lock()
        self._ids = itertools.count(time.time_ns())
        self._unacked: "OrderedDict[int, list]" = OrderedDict()
        self._queries: Dict[int, tuple] = {}
        self._replies: Dict[int, Future] = {}
        self._conn = None
        self._proc = None
        self._stopping = False
        self.restarts = 0
        self._last_restart = 0.0
        self._thread: Optional[threading.Thread] = None

    @property
    def pid(self) -> Optional[int]:
        p = self._proc
        return p.pid if p is not None else None

    def start(self) -> None:
        """Start the registry process and the thread that reads its acks and restarts it when it dies."""
        self._spawn()
        self._thread = threading.Thread(target=self._read_loop, name="dstl-registry-forwarder", daemon=True)
        self._thread.start()

    def _spawn(self) -> None:
        from dstl.changelog.upload.service.registry_proc import registry_main

        parent, child = self._ctx.Pipe(duplex=True)
        proc = self._ctx.Process(target=registry_main, args=(child, self._journal_dir, self._discard_threads,
                                                               self._checkpoints_base),
                                 name="dstl-registry", daemon=False)
        proc.start()
        child.close()
        if not parent.poll(90):
            proc.kill()
            raise UploadServiceError("the registry process did not start in time")
        kind, last_id, _pid = parent.recv()
        assert kind == "hello", kind
        with self._lock:
            self._conn, self._proc = parent, proc
            for op_id in [i for i in self._unacked if i <= last_id]:
                del self._unacked[op_id]
            try:
                for op in self._unacked.values():
                    parent.send(op)
                for q in self._queries.values():
                    parent.send(q)
            except OSError:
                pass  # died again: the read loop notices

    def submit(self, kind: str, *args) -> int:
        """Queue an operation (journaled by the registry); returns its id."""
        with self._lock:
            op_id = next(self._ids)
            op = [kind, op_id, *args]
            self._unacked[op_id] = op
            if self._conn is not None:
                try:
                    self._conn.send(op)
                except OSError:
                    pass  # re-sent after the restart
        return op_id

    def query(self, kind: str, *args, timeout: float = 30.0):
        """`count` or `sync`: wait for the registry's reply."""
        fut: Future = Future()
        with self._lock:
            qid = next(self._ids)
            msg = (kind, qid, *args)
            self._queries[qid] = msg
            self._replies[qid] = fut
            if self._conn is not None:
                try:
                    self._conn.send(msg)
                except OSError:
                    pass
        try:
            return fut.result(timeout)
        finally:
            with self._lock:
                self._queries.pop(qid, None)
                self._replies.pop(qid, None)

    def pending(self) -> int:
        with self._lock:
            return len(self._unacked)

    def _read_loop(self) -> None:
        while True:
            conn = self._conn
            try:
                msg = conn.recv()
            except (EOFError, OSError):
                if self._stopping:
                    return
                self._restart()
                continue
            if msg[0] == "ack":
                with self._lock:
                    self._unacked.pop(msg[1], None)
            elif msg[0] == "reply":
                with self._lock:
                    fut = self._replies.get(msg[1])
                    self._queries.pop(msg[1], None)
                if fut is not None and not fut.done():
                    fut.set_result(msg[2])

    def _restart(self) -> None:
        proc = self._proc
        if proc is not None:
            proc.join(5)
            log.warning("registry process %s exited (code %s); restarting it from its journal",
                        proc.pid, proc.exitcode)
        with self._lock:
            self._conn = None
        now = time.monotonic()
        if now - self._last_restart < 1.0:  # dying at once again: do not spin
            time.sleep(1.0)
        self._last_restart = now
        while not self._stopping:
            try:
                self._spawn()
                self.restarts += 1
                return
            except Exception:
                log.exception("could not restart the registry process; retrying")
                time.sleep(0.5)

    def stop(self, timeout_s: float = 60.0) -> None:
        """Let the registry apply what is queued and finish its deletions, then stop it."""
        deadline = time.monotonic() + timeout_s
        while self.pending() and time.monotonic() < deadline and self._proc is not None:
            time.sleep(0.01)
        self._stopping = True
        with self._lock:
            conn, proc = self._conn, self._proc
        if conn is not None:
            try:
                conn.send(("shutdown",))
            except OSError:
                pass
        if proc is not None:
            proc.join(max(1.0, deadline - time.monotonic()))
            if proc.is_alive():
                proc.kill()
                proc.join(5)


__all__ = ["RegistryForwarder"]
