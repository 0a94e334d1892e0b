"""The service's side of the registry process: numbered operations, acknowledgements, restarts.

Every operation gets an id larger than any earlier one (also across service restarts: ids start at the
wall clock in ns). Unacknowledged operations are kept; when the registry process dies, a new one is
started, replays its journal, says which id it applied last, and only the later operations are sent
again. A release is therefore applied exactly once even if the registry died right after applying it.
"""
from __future__ import annotations

import errno
import itertools
import logging
import threading
import time
from collections import OrderedDict
from concurrent.futures import Future, TimeoutError as FutureTimeout
from typing import Dict, Optional

from dstl.errors import UploadServiceError
from dstl.changelog.upload.service.journal import JournalError
from dstl.changelog.upload.service.protocol import (Ack, Operation, ProtocolError, Query, QueryReply,
                                                     RegistryHello, Shutdown, dispatch)

log = logging.getLogger("dstl.changelog.upload.service.forwarder")

START_TRIES = 5  # registry processes that may die before their hello at start-up


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
        self._acks: Dict[int, Future] = {}
        self._table = {Ack: self._on_ack, QueryReply: self._on_reply}
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
        """Start the registry process and the thread that reads its acks and restarts it when it dies.
        One that dies before its hello (killed) is started again: without a registry every attempt
        would wait out its journal timeout."""
        for n in range(START_TRIES):
            try:
                self._spawn()
                break
            except (EOFError, ConnectionError) as exc:
                if n == START_TRIES - 1:
                    raise UploadServiceError(f"the registry process died {START_TRIES} times while starting") from exc
                log.warning("the registry process died while starting (%r); starting another", exc)
                time.sleep(0.1)
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
        try:
            hello = parent.recv()
        except EOFError:
            proc.join(5)  # died before its hello
            raise
        if type(hello) is not RegistryHello:
            raise ProtocolError(f"the registry process said {hello!r:.200} first")
        last_id = hello.last_id
        with self._lock:
            self._conn, self._proc = parent, proc
            # journaled and applied by the registry that died before acknowledging them: done.
            # (An operation the journal refused was acknowledged before anything later was applied.)
            applied = []
            for op_id in [i for i in self._unacked if i <= last_id]:
                del self._unacked[op_id]
                applied.append(self._acks.pop(op_id, None))
            try:
                for op in self._unacked.values():
                    parent.send(Operation(op))
                for q in self._queries.values():
                    parent.send(q)
            except OSError:
                pass  # died again: the read loop notices
        for fut in applied:
            if fut is not None and not fut.done():
                fut.set_result(None)

    def submit(self, kind: str, *args) -> Future:
        """Queue an operation; the future completes once the registry journaled and applied it, or
        fails with JournalError when the journal could not record it (then it was not applied)."""
        fut: Future = Future()
        with self._lock:
            op_id = next(self._ids)
            op = [kind, op_id, *args]
            self._unacked[op_id] = op
            self._acks[op_id] = fut
            if self._conn is not None:
                try:
                    self._conn.send(Operation(op))
                except OSError:
                    pass  # re-sent after the restart
        return fut

    def apply(self, kind: str, *args, timeout: float = 60.0) -> None:
        """`submit` and wait: raises JournalError (not recorded) or TimeoutError (no answer)."""
        fut = self.submit(kind, *args)
        try:
            fut.result(timeout)
        except FutureTimeout:
            raise UploadServiceError(f"the registry did not record a {kind!r} operation within "
                                     f"{timeout:.0f} s") from None

    def query(self, kind: str, *args, timeout: float = 30.0):
        """`count` or `sync`: wait for the registry's reply."""
        fut: Future = Future()
        with self._lock:
            qid = next(self._ids)
            msg = Query(qid, kind, args)
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
            dispatch(self._table, msg)

    def _on_ack(self, msg: Ack) -> None:
        with self._lock:
            op = self._unacked.pop(msg.op_id, None)
            fut = self._acks.pop(msg.op_id, None)
        if fut is not None and not fut.done():
            if msg.error is None:
                fut.set_result(None)
            else:
                fut.set_exception(JournalError(errno.EIO, msg.error))
        elif msg.error is not None and op is not None:
            log.error("registry operation %s failed: %s", op[0], msg.error)

    def _on_reply(self, msg: QueryReply) -> None:
        with self._lock:
            fut = self._replies.get(msg.query_id)
            self._queries.pop(msg.query_id, None)
        if fut is not None and not fut.done():
            fut.set_result(msg.value)

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
                conn.send(Shutdown())
            except OSError:
                pass
        if proc is not None:
            proc.join(max(1.0, deadline - time.monotonic()))
            if proc.is_alive():
                proc.kill()
                proc.join(5)


__all__ = ["RegistryForwarder"]
