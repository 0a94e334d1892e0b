"""A pool of uploader processes managed by hand (a ProcessPoolExecutor breaks for good when one worker
dies; here a dead worker fails only its own attempt and is replaced).

Workers are forked from a forkserver that has the upload modules preloaded, so starting or replacing
one is cheap and never forks the multi-threaded service itself.
"""
from __future__ import annotations

import logging
import os
import queue
import signal
import threading
import time
from concurrent.futures import CancelledError
from typing import Callable, List, Optional

from dstl.changelog.upload.service.protocol import AttemptDone, Intent, Job, Stop
from dstl.errors import UploadServiceError
from dstl.changelog.upload.retry import AttemptTimeoutError

log = logging.getLogger("dstl.changelog.upload.service.pool")

_SETTLED_POLL_S = 0.05  # how often a running attempt checks whether its action was decided
WORKER_WAIT_S = 30.0  # longest wait for a healthy uploader before an attempt fails
PRELOAD = ["dstl.changelog.upload.service.worker", "dstl.changelog.upload.uploader", "dstl.format", "dstl.changelog.handles", "fsspec"]


def service_context(socket_tmp_dir: Optional[str] = None):
    """The multiprocessing context for the service's children (forkserver with upload modules
    preloaded); with `socket_tmp_dir`, multiprocessing's temporary directory, where the forkserver's
    listener socket goes, is made below it (a short spelling of the service's `tmp/`)."""
    import multiprocessing

    if socket_tmp_dir is not None:
        _mp_temp_dir_below(socket_tmp_dir)

    from dstl.changelog.upload.service.worker import user_modules

    ctx = multiprocessing.get_context("forkserver")
    # user modules too (DSTL_SERVICE_IMPORTS): a replacement worker is then a bare fork
    ctx.set_forkserver_preload(PRELOAD + user_modules())
    return ctx


def _mp_temp_dir_below(directory: str) -> str:
    """Have multiprocessing make its per-process temporary directory below `directory`.

    It makes that directory once per process, on first use, below tempfile's directory (TMPDIR, the
    service's long `tmp/`), and binds the forkserver's listener in it; with the short spelling of
    the same directory the socket path fits. Raises OSError naming the path if it does not."""
    import tempfile
    from multiprocessing import util

    from dstl.changelog.upload.service.runtime import SUN_PATH_MAX

    os.makedirs(directory, mode=0o700, exist_ok=True)
    saved = tempfile.tempdir
    tempfile.tempdir = directory
    try:
        made = util.get_temp_dir()
    finally:
        tempfile.tempdir = saved
    listener = os.path.join(made, "listener-12345678")
    if len(os.fsencode(listener)) >= SUN_PATH_MAX:
        raise OSError(f"the forkserver's socket {listener} would be {len(os.fsencode(listener))} bytes long, "
                      f"over the {SUN_PATH_MAX - 1}-byte limit of a Unix socket path; set DSTL_RUNTIME_DIR "
                      "to a shorter directory")
    return made


class _Worker:
    __slots__ = ("proc", "conn", "pid")

    def __init__(self, proc, conn, pid: int):
        self.proc, self.conn, self.pid = proc, conn, pid


def process_state(pid: int) -> Optional[str]:
    """The kernel's one-letter state of `pid` (R, S, D, T, t, Z, X...), or None if it is gone."""
    try:
        with open(f"/proc/{pid}/stat") as f:
            return f.read().rsplit(")", 1)[1].split()[0]
    except (OSError, IndexError):
        return None


def _usable(w: _Worker) -> bool:
    """An idle worker that can take an attempt: alive, not stopped, its pipe quiet (an idle worker
    that says anything has died: end of file)."""
    state = process_state(w.pid)
    if state is None or state in "ZXxTt":
        return False
    try:
        return not w.conn.poll(0)
    except (OSError, EOFError, ValueError):
        return False


START_DELAYS_S = (0.0, 0.2, 0.5, 1.0, 2.0)  # pauses before each try to start an uploader process


class UploaderPool:
    """`size` uploader processes; `run(job)` uses an idle one and returns its result dict.

    Liveness is judged from the worker's own pipe and pid, never from the multiprocessing sentinel:
    that one is served by the forkserver, and reports every worker dead once the forkserver dies.
    """

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
        self.replaced = 0  # workers killed or found dead and replaced (status, tests)

    def start(self) -> None:
        """Start every worker (called on a background thread: the service accepts clients meanwhile)."""
        for _ in range(self.size):
            self._add_worker_retrying()

    def _add_worker_retrying(self) -> None:
        """`_add_worker`, tried again after a pause while the new process dies or hangs before it is
        ready (someone killed it); raises the last error."""
        for i, delay in enumerate(START_DELAYS_S):
            time.sleep(delay)
            try:
                self._add_worker()
                return
            except Exception:
                if i == len(START_DELAYS_S) - 1:
                    raise
                log.warning("could not start an uploader process; retrying", exc_info=True)

    def _add_worker(self) -> None:
        from dstl.changelog.upload.service.worker import worker_main

        with self._lock:
            if self._closed:
                return
        parent, child = self._ctx.Pipe(duplex=True)
        # Process.start() asks the forkserver for the fork; a dead forkserver is restarted by it
        proc = self._ctx.Process(target=worker_main, args=(child,), name="dstl-uploader", daemon=True)
        proc.start()
        child.close()
        if not parent.poll(self._start_timeout_s):
            _kill(proc.pid)
            parent.close()
            raise UploadServiceError("an uploader process did not start in time")
        try:
            pid = parent.recv().pid  # WorkerReady
        except (EOFError, OSError) as exc:
            raise UploadServiceError("an uploader process died while starting") from exc
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

    def _take(self, deadline: Optional[float]) -> _Worker:
        """An idle, usable worker; dead or stopped ones met on the way are killed and replaced (so a
        dead idle worker costs no attempt)."""
        while True:
            timeout = None if deadline is None else max(0.0, deadline - time.monotonic())
            try:
                w = self._idle.get(timeout=timeout)
            except queue.Empty:
                raise AttemptTimeoutError("no uploader process became free before the attempt timed out") \
                    from None
            if w is None or self._closed:
                self._idle.put(None)  # wake the next waiter too
                raise CancelledError("the upload service is shutting down")
            if _usable(w):
                return w
            log.warning("uploader process %s is %s; replacing it", w.pid,
                        {None: "gone", "T": "stopped", "t": "stopped"}.get(process_state(w.pid), "dead"))
            self._replace(w)

    def acquire(self, wait_s: float = WORKER_WAIT_S) -> _Worker:
        """A healthy idle worker for one attempt (dead or stopped ones are replaced on the way);
        UploadServiceError if none is ready within `wait_s` (the pool cannot start processes)."""
        try:
            return self._take(time.monotonic() + wait_s)
        except AttemptTimeoutError:
            raise UploadServiceError(f"no uploader process was ready within {wait_s:.0f} s") from None

    def run(self, job: dict, timeout_s: Optional[float] = None, worker: Optional[_Worker] = None,
            settled: Optional[Callable[[], bool]] = None) -> dict:
        """One attempt on `worker` (from `acquire`) or an idle one. It may run past its timeout (a
        speculative successor races it, as in thread mode) until `settled()` says its action is
        decided (another attempt won, or every attempt failed), or at the latest `timeout_s` (None:
        no limit): then its worker is killed and replaced -> AttemptTimeoutError. A worker that dies
        mid-attempt -> UploadServiceError (both OSErrors: the policy retries them)."""
        deadline = None if not timeout_s or timeout_s <= 0 else time.monotonic() + timeout_s
        w = worker if worker is not None else self._take(deadline)
        intent = None
        msg = None
        timed_out = False
        try:
            w.conn.send(Job(job))
            while True:
                remaining = None if deadline is None else max(0.0, deadline - time.monotonic())
                if settled is not None:
                    remaining = _SETTLED_POLL_S if remaining is None else min(remaining, _SETTLED_POLL_S)
                if not w.conn.poll(remaining):
                    expired = deadline is not None and time.monotonic() >= deadline
                    if expired or (settled is not None and settled()):
                        timed_out = True
                        break
                    continue
                try:
                    msg = w.conn.recv()
                except (EOFError, OSError):
                    msg = None
                    break
                if type(msg) is Intent:
                    intent = msg.url
                    continue
                break
        except (BrokenPipeError, OSError):
            msg = None
        if timed_out or msg is None:
            state = process_state(w.pid)
            self._replace(w)
            if timed_out:
                err: OSError = AttemptTimeoutError(
                    f"upload attempt outlived its action (limit {timeout_s * 1000 if timeout_s else 0:.0f} ms); "
                    f"uploader process {w.pid} ({'stopped' if state in ('T', 't') else 'busy'}) was killed "
                    "and is being replaced")
            else:
                err = UploadServiceError(f"uploader process {w.pid} died during the attempt")
            err.partial_file = intent  # type: ignore[attr-defined]  # may exist, whole or in part
            raise err
        self._idle.put(w)
        if type(msg) is AttemptDone:
            return msg.result
        exc = msg.error  # AttemptFailed
        if msg.metrics is not None:
            exc.dstl_metrics = msg.metrics
        raise exc

    def _replace(self, dead: _Worker) -> None:
        """Kill `dead` (it may only be stopped or hung) and start a replacement in the background."""
        with self._lock:
            if dead in self._workers:
                self._workers.remove(dead)
            closed = self._closed
            self.replaced += 1
        _kill(dead.pid)
        try:
            dead.conn.close()
        except OSError:
            pass
        if closed:
            return

        def start_one():
            try:
                self._add_worker_retrying()
            except Exception:
                log.error("gave up starting a replacement uploader process", exc_info=True)

        threading.Thread(target=start_one, name="dstl-pool-replace", daemon=True).start()

    @staticmethod
    def _stop_worker(w: _Worker) -> None:
        try:
            w.conn.send(Stop())
        except OSError:
            pass
        deadline = time.monotonic() + 10
        while process_state(w.pid) not in (None, "Z", "X") and time.monotonic() < deadline:
            time.sleep(0.01)
        if process_state(w.pid) not in (None, "Z", "X"):
            _kill(w.pid)
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


def _kill(pid: Optional[int]) -> None:
    """SIGKILL by pid (works on a stopped process too); a pid that is gone is fine."""
    if not pid:
        return
    try:
        os.kill(pid, signal.SIGKILL)
    except (ProcessLookupError, PermissionError):
        pass


__all__ = ["UploaderPool", "process_state", "service_context"]
