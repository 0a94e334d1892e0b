"""The registry process: reference counts of uploaded files for every client of one service (SEMANTICS §9).

Runs `registry_main(conn, journal_dir, discard_threads)` in its own process. Messages from the
service (one pipe):

* `[kind, op_id, ...]` state operations (see `journal.RegistryState.apply`), journaled, then acked
  with `("ack", op_id)`;
* `("count", qid, path)` -> `("reply", qid, count or None)`;
* `("sync", qid)` -> `("reply", qid, None)` once every deletion scheduled so far has run;
* `("shutdown",)` or end of file: finish scheduled deletions, compact the journal, exit.

On start it takes the journal lock (a previous registry may still be finishing), replays the journal,
re-schedules deletions that had not completed, and says `("hello", last_op_id, pid)`.

Orphans (files a dead client held shares of) are settled by a sweeper thread once they are older than
the grace period (`DSTL_ORPHAN_GRACE_MS`, default 10 minutes): a file that a complete checkpoint under
`<base path>/checkpoints` references is kept (untracked, like a confirm); otherwise its outstanding
shares are released. Unreadable checkpoint metadata keeps the file (logged; `dstl gc` is the safety
net); an I/O error while listing postpones the decision to the next sweep.
"""
from __future__ import annotations

import logging
import os
import signal
import threading
import time
from concurrent.futures import ThreadPoolExecutor, wait
from typing import Optional, Set

from dstl.changelog.upload.service.journal import Journal, JournalError
from dstl.changelog.upload.service.protocol import (Ack, Operation, ProtocolError, Query, QueryReply,
                                                     RegistryHello, Shutdown, dispatch)
from dstl.changelog.upload.service.runtime import file_lock

log = logging.getLogger("dstl.changelog.upload.service.registry")

DEFAULT_ORPHAN_GRACE_MS = 600_000
ORPHAN_GRACE_ENV = "DSTL_ORPHAN_GRACE_MS"


def orphan_grace_ms(environ=None) -> int:
    """The grace period before a dead client's files may be deleted, from DSTL_ORPHAN_GRACE_MS."""
    raw = (os.environ if environ is None else environ).get(ORPHAN_GRACE_ENV, "").strip()
    if not raw:
        return DEFAULT_ORPHAN_GRACE_MS
    try:
        value = int(raw)
    except ValueError:
        value = -1
    if value < 0:
        raise ValueError(f"{ORPHAN_GRACE_ENV} must be a whole number of milliseconds >= 0, got {raw!r}")
    return value


class _ListingError(Exception):
    """Checkpoints could not be listed or read for a transient reason: decide at the next sweep."""


def referenced_files(checkpoints_base: str) -> Optional[Set[str]]:
    """Keys of every file the complete checkpoints under `checkpoints_base` reference; None if some
    checkpoint's metadata cannot be decoded (then nothing may be deleted)."""
    from dstl.changelog.checkpoints import UnreadableCheckpointError, files_referenced

    try:
        return files_referenced(checkpoints_base)
    except UnreadableCheckpointError:
        log.warning("a checkpoint under %s cannot be read", checkpoints_base, exc_info=True)
        return None
    except OSError as exc:
        raise _ListingError(str(exc)) from exc


class _Registry:
    def __init__(self, conn, journal_dir: str, discard_threads: int, checkpoints_base: Optional[str] = None,
                 grace_ms: int = DEFAULT_ORPHAN_GRACE_MS):
        self.conn = conn
        self.journal = Journal(journal_dir)
        self.state = self.journal.load()
        self.lock = threading.Lock()  # journal + state, shared with the discard and sweeper threads
        self.pool = ThreadPoolExecutor(max(1, discard_threads), thread_name_prefix="dstl-discard")
        self.futures = set()
        self.checkpoints_base = checkpoints_base
        self.grace_ms = grace_ms
        self.delete_failures = 0  # failed deletion attempts (each retried with backoff)
        self._stop = threading.Event()
        self._table = {Operation: self._operation, Query: self._query, Shutdown: lambda _msg: False}
        self._sweeper = threading.Thread(target=self._sweep_loop, name="dstl-orphan-sweeper", daemon=True)

    def start_sweeper(self) -> None:
        self._sweeper.start()

    def _sweep_loop(self) -> None:
        interval = min(30.0, max(0.05, self.grace_ms / 4000.0))
        while not self._stop.wait(interval):
            try:
                self.sweep()
            except Exception:
                log.warning("orphan sweep failed (retried at the next sweep)", exc_info=True)

    def sweep(self) -> None:
        """Settle the orphans older than the grace period (see the module docstring)."""
        from dstl.changelog.fs import key_of_url

        with self.lock:
            expired = self.state.expired_orphans(int(time.time() * 1000), self.grace_ms)
        if not expired:
            return
        referenced: Optional[Set[str]] = set()
        if self.checkpoints_base:
            try:
                referenced = referenced_files(self.checkpoints_base)
            except _ListingError as exc:
                log.warning("cannot list the checkpoints under %s (%s): %d orphaned changelog file(s) wait "
                            "for the next sweep", self.checkpoints_base, exc, len(expired))
                return
        for path in expired:
            if referenced is None:
                keep = True
                log.warning("keeping orphaned changelog file %s: checkpoint metadata cannot be read "
                            "(`dstl gc` can delete it later)", path)
            else:
                keep = key_of_url(path) in referenced
            with self.lock:
                try:
                    self.journal.append(["orphan", 0, path, keep], sync=True)
                except JournalError as exc:
                    log.error("%s; orphan %s is decided at a later sweep", exc, path)
                    continue
                doomed = self.state.resolve_orphan(path, keep)
            for d in doomed:
                self.schedule_delete(d)

    def schedule_delete(self, path: str, attempt: int = 0) -> None:
        try:
            fut = self.pool.submit(self._delete, path, attempt)
        except RuntimeError:  # shutting down: the journal keeps it pending for the next start
            return
        self.futures.add(fut)
        fut.add_done_callback(self.futures.discard)

    def _delete(self, path: str, attempt: int) -> None:
        from dstl.changelog.handles import StreamStateHandle
        from dstl.changelog.registry import DELETE_RETRY_DELAYS_S

        try:
            StreamStateHandle(path, 0).discard_state()
        except Exception as exc:
            with self.lock:
                self.delete_failures += 1
            if attempt < len(DELETE_RETRY_DELAYS_S) and not self._stop.is_set():
                delay = DELETE_RETRY_DELAYS_S[attempt]
                log.warning("could not delete changelog file %s (%s); retrying in %.1f s", path, exc, delay)
                self._stop.wait(delay)  # keeps `sync` waiting for the retry, as in thread mode
                self._delete(path, attempt + 1)
            else:
                log.warning("could not delete changelog file %s (kept, retried at the next start)", path,
                            exc_info=True)
            return
        with self.lock:
            self.state.pending_delete.discard(path)
            try:
                self.journal.append(["deleted", 0, path])
            except JournalError as exc:  # deleted again after a restart: harmless
                log.warning("%s", exc)

    def handle(self, msg) -> bool:
        """One message from the service; False once it says Shutdown."""
        return dispatch(self._table, msg)

    def _query(self, msg: Query) -> bool:
        if msg.kind == "count":
            with self.lock:
                value = self.state.ref_count(msg.args[0])
        elif msg.kind == "delete_failures":
            with self.lock:
                value = self.delete_failures
        elif msg.kind == "sync":  # every deletion scheduled so far has run
            wait(list(self.futures))
            value = None
        else:
            raise ProtocolError(f"unknown registry query {msg.kind!r}")
        self.conn.send(QueryReply(msg.query_id, value))
        return True

    def _operation(self, msg: Operation) -> bool:
        op = list(msg.record)
        error = None
        with self.lock:
            if op[1] <= self.state.last_id:
                doomed = []  # applied before a restart: re-sent, acknowledged again
            else:
                try:
                    self.journal.append(op)  # whole (and fsynced where it protects a file) first
                except JournalError as exc:
                    error = str(exc)
                    log.error("%s", exc)
                    doomed = []
                else:
                    doomed = self.state.apply(op)
            if error is None and self.journal.needs_compaction():
                try:
                    self.journal.compact(self.state)
                except JournalError as exc:
                    log.error("%s; the journal keeps growing until it can be written", exc)
        for path in doomed:
            self.schedule_delete(path)
        self.conn.send(Ack(op[1], error))
        return True

    def finish(self) -> None:
        self._stop.set()
        if self._sweeper.is_alive():
            self._sweeper.join(60)
        self.pool.shutdown(wait=True)
        with self.lock:
            try:
                self.journal.compact(self.state)
            except JournalError as exc:  # the log still holds every acknowledged operation
                log.error("%s", exc)
            self.journal.close()


def registry_main(conn, journal_dir: str, discard_threads: int, checkpoints_base: Optional[str] = None) -> None:
    """Entry point of the registry process."""
    signal.signal(signal.SIGINT, signal.SIG_IGN)  # stopped by its service, not by a terminal's ^C
    logging.basicConfig(level=logging.WARNING, format="%(asctime)s registry %(levelname)s %(message)s")
    from dstl.changelog.upload.service.worker import _preload_user_modules

    _preload_user_modules()  # file systems registered by user modules must be deletable here too
    os.makedirs(journal_dir, mode=0o700, exist_ok=True)
    with file_lock(os.path.join(journal_dir, "lock"), timeout_s=60):
        try:
            grace = orphan_grace_ms()
        except ValueError:
            log.warning("invalid %s; using the default", ORPHAN_GRACE_ENV, exc_info=True)
            grace = DEFAULT_ORPHAN_GRACE_MS
        reg = _Registry(conn, journal_dir, discard_threads, checkpoints_base, grace)
        for path in sorted(reg.state.pending_delete):
            reg.schedule_delete(path)
        reg.start_sweeper()
        conn.send(RegistryHello(reg.state.last_id, os.getpid()))
        try:
            while True:
                try:
                    msg = conn.recv()
                except (EOFError, OSError):
                    break  # the service is gone
                try:
                    if not reg.handle(msg):
                        break
                except (BrokenPipeError, EOFError):
                    break
        finally:
            reg.finish()


__all__ = ["registry_main"]
