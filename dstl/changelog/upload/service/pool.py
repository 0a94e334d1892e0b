"""A pool of uploader processes managed by hand (a ProcessPoolExecutor breaks for good when one worker
dies; here a dead worker fails only its own attempt and is replaced).

Workers are forked from a forkserver that has the upload modules preloaded, so starting or replacing
one is cheap and never forks the multi-threaded service itself.
"""
from __future__ import annotations

import logging
import queue
import threading
from concurrent.futures import CancelledError
from multiprocessing.connection import wait
from typing import List, Optional

from dstl.errors import UploadServiceError

log = logging.getLogger("dstl.changelog.upload.service.pool")

PRELOAD = ["dstl.changelog.upload.service.worker", "dstl.changelog.upload.uploader", "dstl.format", "dstl.changelog.handles", "fsspec"]


def service_context():
    """The multiprocessing context for the service's children (forkserver with upload modules preloaded)."""
    import multiprocessing

    ctx = multiprocessing.get_context("forkserver")
    ctx.set_forkserver_preload(PRELOAD)
    return ctx


class _Worker:
    __slots__ = ("proc", "conn", "pid")

    def __init__(self, proc, conn, pid: int):
        self.proc, self.conn, self.pid = proc, conn, pid


class UploaderPool:
    """`size` uploader processes; `run(job)` uses an idle one and returns its result dict."""

    def __init__(self, ctx, size: int, start_timeout_s: float = 60.0):
        if size < 1:
            raise ValueError(f"upload pool size must be >= 1, got {size}")
        self._ctx = ctx
        self.size = size
        self._start_timeout_s = start_timeout_s
        self._idle: "queue.Queue[Optional[_Worker]]" = queue.Queue()
        self._lock = threading.Lock()
        self._workers: List[_Worker] = []
        self._closed = False

    def start(self) -> None:
        """Start every worker (called on a background thread: the service accepts clients meanwhile)."""
        for _ in range(self.size):
            self._add_worker()

    def _add_worker(self) -> None:
        from dstl.changelog.upload.service.worker import worker_main

        with self._lock:
            if self._closed:
                return
        parent, child = self._ctx.Pipe(duplex=True)
        proc = self._ctx.Process(target=worker_main, args=(child,), name="dstl-uploader", daemon=True)
        proc.start()
        child.close()
        if not parent.poll(self._start_timeout_s):
            proc.kill()
            raise UploadServiceError("an uploader process did not start in time")
        try:
            _, pid = parent.recv()
        except (EOFError, OSError) as exc:
            raise UploadServiceError(f"an uploader process died while starting (exit code {proc.exitcode})") \
                from exc
        w = _Worker(proc, parent, pid)
        with self._lock:
            if self._closed:
                self._stop_worker(w)
                return
            self._workers.append(w)
        self._idle.put(w)

    def pids(self) -> List[int]:
        with self._lock:
            return [w.pid for w in self._workers]

    def run(self, job: dict) -> dict:
        """One attempt on an idle worker. A worker that dies mid-attempt -> UploadServiceError (an OSError,
        so the fixed policy retries it on another worker) and a replacement is started."""
        w = self._idle.get()
        if w is None or self._closed:
            self._idle.put(None)  # wake the next waiter too
            raise CancelledError("the upload service is shutting down")
        intent = None
        try:
            w.conn.send(job)
            while True:
                ready = wait([w.conn, w.proc.sentinel])
                if w.conn in ready:
                    try:
                        msg = w.conn.recv()
                    except (EOFError, OSError):
                        msg = None
                    if msg is not None and msg[0] == "intent":
                        intent = msg[1]
                        continue
                    break
                if w.proc.sentinel in ready:
                    msg = None
                    break
        except (BrokenPipeError, OSError):
            msg = None
        if msg is None:
            self._replace(w)
            w.proc.join(5)
            err = UploadServiceError(
                f"uploader process {w.pid} died during the attempt (exit code {w.proc.exitcode})")
            err.partial_file = intent  # type: ignore[attr-defined]  # may exist half-written
            raise err
        self._idle.put(w)
        if msg[0] == "ok":
            return msg[1]
        exc = msg[1]
        if msg[2] is not None:
            exc.dstl_metrics = msg[2]
        raise exc

    def _replace(self, dead: _Worker) -> None:
        with self._lock:
            if dead in self._workers:
                self._workers.remove(dead)
            closed = self._closed
        try:
            dead.conn.close()
        except OSError:
            pass
        if closed:
            return

        def start_one():
            try:
                self._add_worker()
            except Exception:
                log.exception("could not replace a dead uploader process")

        threading.Thread(target=start_one, name="dstl-pool-replace", daemon=True).start()

    @staticmethod
    def _stop_worker(w: _Worker) -> None:
        try:
            w.conn.send(None)
        except OSError:
            pass
        w.proc.join(10)
        if w.proc.is_alive():
            w.proc.kill()
            w.proc.join(5)
        try:
            w.conn.close()
        except OSError:
            pass

    def close(self) -> None:
        """Stop every worker (call after the attempts finished); waiting callers get CancelledError."""
        with self._lock:
            self._closed = True
            workers = list(self._workers)
            self._workers.clear()
        self._idle.put(None)
        for w in workers:
            self._stop_worker(w)


__all__ = ["UploaderPool", "service_context"]
