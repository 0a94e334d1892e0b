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
"""
from __future__ import annotations

import logging
import os
import signal
import threading
from concurrent.futures import ThreadPoolExecutor, wait

from dstl.upload.service.journal import Journal
from dstl.upload.service.runtime import file_lock

log = logging.getLogger("dstl.upload.service.registry")


class _Registry:
    def __init__(self, conn, journal_dir: str, discard_threads: int):
        self.conn = conn
        self.journal = Journal(journal_dir)
        self.state = self.journal.load()
        self.lock = threading.Lock()  # journal + state, shared with the discard threads
        self.pool = ThreadPoolExecutor(max(1, discard_threads), thread_name_prefix="dstl-discard")
        self.futures = set()

    def schedule_delete(self, path: str) -> None:
        fut = self.pool.submit(self._delete, path)
        self.futures.add(fut)
        fut.add_done_callback(self.futures.discard)

    def _delete(self, path: str) -> None:
        from dstl.handles import StreamStateHandle

        try:
            StreamStateHandle(path, 0).discard_state()
        except Exception:
            log.warning("could not delete changelog file %s (kept for retry at restart)", path, exc_info=True)
            return
        with self.lock:
            op = ["deleted", 0, path]
            self.state.pending_delete.discard(path)
            self.journal.append(op)

    def handle(self, msg) -> bool:
        kind = msg[0]
        if kind == "shutdown":
            return False
        if kind == "count":
            with self.lock:
                value = self.state.ref_count(msg[2])
            self.conn.send(("reply", msg[1], value))
            return True
        if kind == "sync":
            wait(list(self.futures))
            self.conn.send(("reply", msg[1], None))
            return True
        with self.lock:
            doomed = self.state.apply(list(msg))
            self.journal.append(list(msg))
            if self.journal.needs_compaction():
                self.journal.compact(self.state)
        for path in doomed:
            self.schedule_delete(path)
        self.conn.send(("ack", msg[1]))
        return True

    def finish(self) -> None:
        self.pool.shutdown(wait=True)
        with self.lock:
            self.journal.compact(self.state)
            self.journal.close()


def registry_main(conn, journal_dir: str, discard_threads: int) -> None:
    """Entry point of the registry process."""
    signal.signal(signal.SIGINT, signal.SIG_IGN)  # stopped by its service, not by a terminal's ^C
    logging.basicConfig(level=logging.WARNING, format="%(asctime)s registry %(levelname)s %(message)s")
    from dstl.upload.service.worker import _preload_user_modules

    _preload_user_modules()  # file systems registered by user modules must be deletable here too
    os.makedirs(journal_dir, mode=0o700, exist_ok=True)
    with file_lock(os.path.join(journal_dir, "lock"), timeout_s=60):
        reg = _Registry(conn, journal_dir, discard_threads)
        for path in sorted(reg.state.pending_delete):
            reg.schedule_delete(path)
        conn.send(("hello", reg.state.last_id, os.getpid()))
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
