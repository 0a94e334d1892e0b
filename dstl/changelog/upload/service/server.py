"""The upload service process: batching, back-pressure and retries for every client on the host.

Run as `python -m dstl.changelog.upload.service.server <service dir>` (clients start it; see `client.py`).
Threads: one accepting connections, one per client reading its messages, the RetryingExecutor's
attempt threads (each drives one attempt in an uploader process, or, for raw local files, makes the
file and has the clients write their change sets into it), timers. Children: the uploader pool
and the registry process (both forked from a forkserver).

The core is thread mode's: one `BatchingStateChangeUploadScheduler` (its `UploadThrottle` and
`RetryingExecutor`) holds every client's tasks, so docs/semantics.md §7.3 holds over all clients:
in-flight bytes count every client, an availability change is pushed to every client, batches are cut
by persist delay / size threshold and grouped by job (one file per job and local-recovery directory
per drain). What is the service's own: an attempt runs in a pool process (`_BatchAction`), a task's
bodies wait in a shared-memory segment or in its client, and settling a task answers its client.
"""
from __future__ import annotations

import itertools
import json
import logging
import os
import secrets
import signal
import sys
import threading
import time
import uuid
from collections import Counter as _Counter
from concurrent.futures import CancelledError, Future
from concurrent.futures import TimeoutError as _FutureTimeout
from multiprocessing.connection import Listener
from typing import Dict, List, Optional

from dstl.errors import UploadServiceError
from dstl.changelog.upload.scheduler import AdmittedTask, BatchingStateChangeUploadScheduler
from dstl.changelog.upload.service import shm
from dstl.changelog.upload.service.protocol import (Availability, Call, Close, Closed, Done, Failed, Hello,
                                                     Notice, ProtocolError, Refused, Release, Reply, Upload,
                                                     Welcome, WriteRegion, Written, dispatch)
from dstl.changelog.upload.service.worker import intended_url, run_attempt
from dstl.changelog.upload.service.runtime import ServicePaths, file_lock, pid_alive
from dstl.changelog.upload.task import UploadTask

log = logging.getLogger("dstl.changelog.upload.service")

LINGER_MS_DEFAULT = 2000
DIRECTORY_CHECK_S = 1.0  # how often the service checks that its runtime directory is still there
_batch_ids = itertools.count(1)
_attempt_ids = itertools.count(1)
_REGION_POLL_S = 0.05  # how often a waiting attempt checks whether its action was decided meanwhile


class _Client:
    __slots__ = ("cid", "pid", "conn", "send_lock", "alive", "closing", "welcomed", "tasks", "prefix",
                 "regions")

    def __init__(self, cid: str, pid: int, conn, prefix: str):
        self.cid, self.pid, self.conn, self.prefix = cid, pid, conn, prefix
        self.send_lock = threading.Lock()
        self.alive = True
        self.closing = False
        self.welcomed = False  # pushes (availability, notices) only after its Welcome
        self.tasks: Dict[int, "_Task"] = {}  # unsettled: queued in the scheduler or in an attempt
        self.regions: Dict[int, tuple] = {}  # attempt id -> (Future, asked at): WriteRegions unanswered

    def stalled(self, timeout_s: float) -> bool:
        """Gone, or a WriteRegion of its unanswered for longer than `timeout_s` (stopped, hung)."""
        if not self.alive:
            return True
        oldest = min((at for _f, at in list(self.regions.values())), default=None)
        return oldest is not None and timeout_s > 0 and time.monotonic() - oldest > timeout_s

    def send(self, msg) -> None:
        if not self.alive:
            return
        try:
            with self.send_lock:
                self.conn.send(msg)
        except (OSError, EOFError):
            pass  # the reader thread sees the connection drop and cleans up


class _Task(UploadTask):
    """One client's upload in the shared scheduler: its bodies wait in shared-memory `segment`, or in
    the client when `segment` is "" (`items` describe them); settling it answers the client with
    Done or Failed."""

    __slots__ = ("service", "client", "task_id", "group", "segment", "items", "action")

    def __init__(self, service: "UploadService", client: _Client, task_id: int, group: tuple, segment: str,
                 items: list, size: int):
        UploadTask.__init__(self, (), None, None, size)
        self.service, self.client, self.task_id, self.group = service, client, task_id, group
        self.segment, self.items = segment, items
        self.action: Optional[_BatchAction] = None  # set once a drain put it in a batch

    def complete(self, outcome) -> None:
        """`outcome` = (the attempt's result, this task's (sqn, offset, local offset, size) list)."""
        if self._finish():
            self.service.task_done(self, *outcome)

    def fail(self, exc: BaseException) -> None:
        if self._finish():
            self.service.task_failed(self, exc)


class _BatchAction:
    """RetriableAction: one attempt = one uploader process writes every task of the batch into one file.

    A batch with tasks that clients hold (raw local files) runs its attempts in the service's own
    thread instead: it creates and sizes the file, asks each client to write its change sets at their
    offsets (WriteRegion) and waits for every answer. A client that is gone, or left an earlier
    WriteRegion unanswered past the attempt timeout, is left out of the next attempt: its tasks fail
    and the rest of the batch does not wait for it."""

    def __init__(self, service: "UploadService", admitted: List[AdmittedTask]):
        self.service = service
        self.admitted = admitted  # settling these gives the bytes back to the throttle first
        self.tasks: List[_Task] = [a.inner for a in admitted]
        for t in self.tasks:
            t.action = self
        self.held = any(not t.segment for t in self.tasks)
        self.lock = threading.Lock()
        self.attempts = 0
        self._worker = threading.local()  # the uploader prepare_attempt took, per attempt thread
        self.settled = False  # set once the executor decided the action (won or failed)
        self.metrics = {"requests": 0, "failures": 0, "sizes": [], "latencies": [],
                        "batch_id": next(_batch_ids), "batch": len(self.tasks)}
        job_id, local_dir = self.tasks[0].group
        cfg = service.config
        self.job = {
            "base_path": cfg.base_path, "job_id": job_id, "local_dir": local_dir,
            "compression": cfg.compression, "buffer_size": cfg.upload_buffer_size,
            "tasks": [(t.task_id, t.segment, t.items) for t in self.tasks],
        }

    def _record(self, m: Optional[dict], exc: Optional[BaseException] = None) -> None:
        with self.lock:
            if m is None:  # the worker died: count the attempt as a failed I/O request
                m = {"requests": 1, "failures": 1 if isinstance(exc, OSError) else 0, "sizes": [], "latencies": []}
            self.metrics["requests"] += m["requests"]
            self.metrics["failures"] += m["failures"]
            self.metrics["sizes"] += m["sizes"]
            self.metrics["latencies"] += m["latencies"]

    def _limit_s(self) -> Optional[float]:
        """The longest an attempt may run: past its own timeout it races its speculative successors
        (as in thread mode) until its action is decided, and at the latest until every attempt of
        the policy has had its timeout. Then its uploader is killed and replaced."""
        policy = self.service.policy
        if policy.timeout_ms <= 0:
            return None
        attempts = getattr(policy, "max_attempts", 1)
        delay = getattr(policy, "delay_ms", 0)
        return (attempts * policy.timeout_ms + (attempts - 1) * delay) / 1000.0

    def prepare_attempt(self) -> None:
        """Take a healthy uploader before the attempt's timeout starts (a dead one costs no attempt)."""
        self._worker.value = None if self.held else self.service.pool.acquire()

    def try_execute(self):
        with self.lock:
            self.attempts += 1
            n = self.attempts
        job = dict(self.job, file_name=str(uuid.uuid4()))
        # journaled before the file exists: if this service dies mid-attempt, the next one knows
        # the file and settles it like a dead client's (after the grace period). Waited for: an
        # intent only queued here (the registry restarting) died with this service while the
        # uploader's file stayed, unknown to anyone (the chaos test found it)
        intent = intended_url(job)
        self.service.registry.apply("intent", intent, int(time.time() * 1000))
        worker, self._worker.value = getattr(self._worker, "value", None), None
        try:
            if self.held:
                res = self._written_by_clients(job)
            else:
                res = self.service.pool.run(job, self._limit_s(), worker, lambda: self.settled)
        except BaseException as exc:
            self._record(getattr(exc, "dstl_metrics", None), exc)
            # a killed uploader cannot clean up after itself; a failed attempt deleted its partial
            # file already, and discarding it again also forgets the intent
            self.service.registry.submit("discard", getattr(exc, "partial_file", None) or intent)
            raise
        self._record(res["metrics"])
        self._track(res)
        return n, res

    def _written_by_clients(self, job: dict) -> dict:
        """One attempt whose held regions the clients write (see the class). Returns run_attempt's
        result with None in `tasks` for each task left out, and `left_out` {position: reason}."""
        timeout_s = self.service.policy.timeout_ms / 1000.0
        included, left_out = [], {}
        for i, t in enumerate(self.tasks):
            if not t.segment and t.client.stalled(timeout_s):  # a segment is there without its client
                left_out[i] = (f"client {t.client.cid} (pid {t.client.pid}) is gone" if not t.client.alive else
                               f"client {t.client.cid} (pid {t.client.pid}) did not write its change sets "
                               f"within the upload timeout ({timeout_s * 1000:.0f} ms)")
            else:
                included.append(i)
        if not included:
            raise UploadServiceError("no client of the batch is there to write its change sets: "
                                     + "; ".join(left_out.values()))
        tasks = [self.tasks[i] for i in included]
        job = dict(job, tasks=[self.job["tasks"][i] for i in included])
        res = run_attempt(job, delegate=lambda paths, held: self.service.fill_regions(
            paths, held, tasks, self._limit_s(), lambda: self.settled))
        by_position = dict(zip(included, res["tasks"]))
        res["tasks"] = [by_position.get(i) for i in range(len(self.tasks))]
        res["left_out"] = left_out
        return res

    def _track(self, res: dict) -> None:
        """Start tracking the attempt's files in the registry, durably, before any client hears of
        them; a journal that cannot record it fails the attempt (its files are deleted)."""
        shares = _Counter()
        for t, results in zip(self.tasks, res["tasks"]):
            if results is not None:  # tasks left out of the file have no share in it
                shares[t.client.cid] += len(t.items)
        try:
            for path, n in res["started"]:
                self.service.registry.apply("start", path, n, dict(shares))
        except OSError:
            for p in (res["path"], res["local_path"]):
                if p:
                    _delete_quietly(p)
                    self.service.registry.submit("discard", p)
            raise

    def complete_with_result(self, result) -> None:
        self.settled = True
        n, res = result
        with self.lock:
            self.metrics["attempts"] = n
            self.metrics["total_attempts"] = self.attempts
        self.service.batch_succeeded(self, res)

    def discard_result(self, result) -> None:
        _, res = result
        for p in (res["path"], res["local_path"]):
            if p:
                self.service.registry.submit("discard", p)

    def handle_failure(self, exc: BaseException) -> None:
        self.settled = True
        self.service.batch_failed(self, exc)


def _delete_quietly(path: str) -> None:
    from dstl.changelog.handles import StreamStateHandle

    try:
        StreamStateHandle(path, 0).discard_state()
    except Exception:
        log.warning("could not delete %s", path, exc_info=True)


class UploadService:
    """One service per host and (base path, options)."""

    def __init__(self, paths: ServicePaths, config, linger_ms: int = LINGER_MS_DEFAULT):
        from dstl.changelog.upload.retry import RetryingExecutor, RetryPolicy

        self.paths = paths
        self.config = config
        self.linger_ms = linger_ms
        self.instance = f"{os.getpid()}x{secrets.token_hex(3)}"
        self.policy = RetryPolicy.from_config(config)
        self.lock = threading.RLock()
        self._welcome_lock = threading.Lock()  # orders a client's Welcome before any push to it
        self.clients: Dict[str, _Client] = {}
        self.linger_timer: Optional[threading.Timer] = None
        self.stopping = False
        self.orphaned = False  # the service directory was removed under us (see _orphan)
        self._dir_id: Optional[tuple] = None
        self.terminated = False  # set by the SIGTERM handler (a plain attribute: no locks there)
        self.stopped = threading.Event()
        self.listener: Optional[Listener] = None
        self.ctx = None
        self.pool = None
        self.registry = None
        # thread mode's core, hosted: queue, timer, back-pressure, sticky error, retries
        self.executor = RetryingExecutor(config.upload_num_threads)
        self.scheduler = BatchingStateChangeUploadScheduler(
            config.persist_delay_ms, config.persist_size_threshold, config.max_in_flight, self.policy,
            None, self.executor, make_action=lambda admitted: _BatchAction(self, admitted),
            group_key=lambda task: task.group)
        self.scheduler.get_availability_provider().add_listener(self._broadcast_availability)
        self._ready = threading.Event()
        self._client_table = {Upload: self._upload, Release: self._on_release, Call: self._call,
                              Written: self._on_written, Close: lambda _msg, client: self._client_closing(client)}

    # ---- lifecycle -------------------------------------------------------------------------
    def serve(self) -> None:
        """Listen, start the children in the background, serve until the linger after the last client."""
        from dstl.changelog.upload.service.forwarder import RegistryForwarder
        from dstl.changelog.upload.service.pool import UploaderPool, service_context

        shm.sweep_orphans(pid_alive)
        try:
            os.unlink(self.paths.socket)
        except FileNotFoundError:
            pass
        self.listener = Listener(self.paths.socket, family="AF_UNIX", authkey=self.paths.authkey())
        _keep_socket_file(self.listener)
        with open(self.paths.pid_file + ".tmp", "w") as f:
            f.write(f"{os.getpid()} {self.instance}\n")
        os.replace(self.paths.pid_file + ".tmp", self.paths.pid_file)
        st = os.stat(self.paths.directory)
        self._dir_id = (st.st_dev, st.st_ino)
        self.ctx = service_context(self.paths.socket_tmp_dir)
        self.pool = UploaderPool(self.ctx, self.config.upload_num_threads)
        self.registry = RegistryForwarder(self.ctx, self.paths.journal_dir, self.config.discard_num_threads,
                                          self.config.base_path)
        threading.Thread(target=self._start_children, name="dstl-start-children", daemon=True).start()
        threading.Thread(target=self._accept_loop, name="dstl-accept", daemon=True).start()
        self._arm_linger()
        # polled, not a bare wait(): the SIGTERM handler must not take the Event's lock (it may
        # interrupt this very thread while it holds it)
        checked = time.monotonic()
        while not self.stopped.wait(0.2) and not self.terminated:
            if not self.orphaned and time.monotonic() - checked >= DIRECTORY_CHECK_S:
                checked = time.monotonic()
                if not self._directory_is_ours():
                    self._orphan()
        self._shutdown()

    def _directory_is_ours(self) -> bool:
        """Whether the service directory is still the one this service started in (a temp cleaner
        may have removed it, and a client made a new one for a fresh service since)."""
        try:
            st = os.stat(self.paths.directory)
        except FileNotFoundError:
            return False
        return (st.st_dev, st.st_ino) == self._dir_id

    def _orphan(self) -> None:
        """Our directory is gone: no client can find us any more (the next one starts a fresh
        service), so take no new connections, finish what the connected clients send, and exit
        once idle without touching any file of that path (it may be a fresh service's now)."""
        with self.lock:
            if self.orphaned:
                return
            self.orphaned = True
        log.warning("the runtime directory %s was removed or replaced: this service takes no new clients, "
                    "finishes the work it holds and exits when idle", self.paths.directory)
        try:
            self.listener.close()
        except OSError:
            pass
        self._arm_linger()

    def _start_children(self) -> None:
        try:
            self.registry.start()
            # every client (and attempt) of an earlier service is gone: their shares become orphans
            self.registry.submit("drop_client", "*", int(time.time() * 1000))
            self.pool.start()
        except Exception as exc:
            log.exception("the upload service could not start its processes")
            self.scheduler.fail_later_uploads(OSError(f"the upload service could not start its processes: "
                                                      f"{type(exc).__name__}: {exc}"))
        self._ready.set()

    def _accept_loop(self) -> None:
        while not self.stopping:
            try:
                conn = self.listener.accept()
            except Exception:
                if self.stopping or self.orphaned:
                    return
                log.warning("rejected a connection", exc_info=True)
                continue
            threading.Thread(target=self._serve_client, args=(conn,), name="dstl-client", daemon=True).start()

    def _busy(self) -> bool:
        return bool(self.scheduler.in_flight_bytes() or self.scheduler.queue_size())

    def _arm_linger(self) -> None:
        with self.lock:
            if self.stopping or self.clients or self._busy():
                return
            if self.linger_timer is None:
                self.linger_timer = threading.Timer(self.linger_ms / 1000.0, self._linger_expired)
                self.linger_timer.daemon = True
                self.linger_timer.start()

    def _linger_expired(self) -> None:
        if not self.orphaned and self._directory_is_ours():
            try:
                # the file lock orders this against clients connecting (they hold it while saying hello)
                with file_lock(self.paths.lock):
                    if self._directory_is_ours():
                        self._stop_if_idle(own_files=True)
                        return
            except FileNotFoundError:  # removed while we waited for its lock
                pass
        self._orphan()
        self._stop_if_idle(own_files=False)

    def _stop_if_idle(self, own_files: bool) -> None:
        with self.lock:
            self.linger_timer = None
            if self.clients or self._busy() or self.stopping:
                return
            self.stopping = True
        if own_files:
            for p in (self.paths.socket, self.paths.pid_file):
                try:
                    os.unlink(p)
                except FileNotFoundError:
                    pass
        try:
            self.listener.close()
        except OSError:
            pass
        self.stopped.set()

    def _shutdown(self) -> None:
        with self.lock:
            self.stopping = True
        try:
            self.listener.close()
        except OSError:
            pass
        own = not self.orphaned and self._directory_is_ours()
        if own and self.paths.read_pid() == os.getpid():  # SIGTERM: the linger path removed them already
            for p in (self.paths.socket, self.paths.pid_file):
                try:
                    os.unlink(p)
                except FileNotFoundError:
                    pass
        self._ready.wait(120)
        # SIGTERM with tasks still waiting for their batch: they fail; running attempts finish
        self.scheduler.close("the upload service is stopping")
        self.pool.close()
        self.registry.stop()
        n = shm.sweep(f"{shm.PREFIX}{self.instance}_")
        if n:
            log.warning("unlinked %d shared memory segments left by clients", n)
        from dstl.changelog.upload.service.runtime import remove_if_idle

        if own:
            remove_if_idle(self.paths, own_pid=os.getpid())  # nothing left to replay: nothing left behind

    # ---- clients ---------------------------------------------------------------------------
    def _serve_client(self, conn) -> None:
        client: Optional[_Client] = None
        try:
            while True:
                try:
                    msg = conn.recv()
                except (EOFError, OSError):
                    break
                if client is None:  # the first message must be Hello
                    if type(msg) is not Hello:
                        log.warning("a connection opened with %s instead of Hello", type(msg).__name__)
                        break
                    client = self._hello(conn, msg)
                    if client is None:
                        break
                    continue
                try:
                    dispatch(self._client_table, msg, client)
                except ProtocolError as exc:
                    log.warning("client %s: %s", client.cid, exc)
        finally:
            if client is not None:
                self._client_gone(client)
            try:
                conn.close()
            except OSError:
                pass

    def _hello(self, conn, msg: Hello) -> Optional[_Client]:
        cid, pid = msg.client_id, msg.pid
        # welcomed once the uploaders and the registry run: a first attempt must not spend its
        # timeout waiting for the pool to start
        self._ready.wait(60)
        prefix = shm.segment_prefix(self.instance, pid, cid)
        client = _Client(cid, pid, conn, prefix)
        with self._welcome_lock:  # an availability push waits for this Welcome, so it cannot pass it
            with self.lock:
                refused = self.stopping
                if not refused:
                    self.clients[cid] = client
                if self.linger_timer is not None:
                    self.linger_timer.cancel()
                    self.linger_timer = None
            in_flight, _queued, available = self._gauges()
            if refused:
                client.send(Refused("the service is stopping"))
                return None
            client.send(Welcome(self.instance, os.getpid(), self.scheduler.max_in_flight, bool(available),
                                in_flight))
            client.welcomed = True
        return client

    def _upload(self, msg: Upload, client: _Client) -> None:
        """Queue a client's task in the shared scheduler; never blocks (the client waited for the
        availability the service pushed, so one task per client may overshoot, later ones wait)."""
        task = _Task(self, client, msg.task_id, (msg.job_id, msg.local_dir), msg.segment, msg.items, msg.size)
        with self.lock:
            refused = client.closing or self.stopping
            if not refused:
                client.tasks[task.task_id] = task
        if refused:
            client.send(Failed(task.task_id, CancelledError("the upload scheduler is closed"), None, self._gauges()))
            return
        # a sticky error or a closed scheduler fails it at once; the persist delay runs from when the
        # client's writer handed it over (its copy into shared memory does not add to the wait)
        self.scheduler.upload_nowait(task, msg.queued_at, msg.more)

    # ---- outcomes --------------------------------------------------------------------------
    def _gauges(self) -> tuple:
        """(in-flight bytes, queued tasks, available) of every client, from the scheduler."""
        s = self.scheduler
        return s.in_flight_bytes(), s.queue_size(), int(s.get_availability_provider().is_available())

    def _broadcast_availability(self, available: bool) -> None:
        """The throttle's listener: push every back-pressure change to every welcomed client."""
        with self._welcome_lock:
            with self.lock:
                clients = [c for c in self.clients.values() if c.alive and c.welcomed]
            gauges = self._gauges()
            for c in clients:
                c.send(Availability(available, gauges))

    def batch_succeeded(self, action: _BatchAction, res: dict) -> None:
        dead = set()
        left_out = res.get("left_out") or {}
        for i, (a, results) in enumerate(zip(action.admitted, res["tasks"])):
            client = a.inner.client
            if results is None:  # its client was gone or stalled: not in the file
                a.fail(UploadServiceError(left_out.get(i, "left out of the batch's file")))
                continue
            if not client.alive:
                dead.add(client)
            try:
                a.complete((res, results))  # capacity back to the throttle, then Done to the client
            except Exception:  # one task's trouble must not keep the rest of the batch waiting
                log.exception("settling task %s of client %s failed", a.inner.task_id, client.cid)
        for c in dead:  # the file's start of tracking gave them shares after they were dropped
            if not c.closing:
                self.registry.submit("drop_client", c.cid, int(time.time() * 1000))

    def batch_failed(self, action: _BatchAction, exc: BaseException) -> None:
        for a in action.admitted:
            try:
                a.fail(exc)
            except Exception:
                log.exception("failing task %s of client %s failed", a.inner.task_id, a.inner.client.cid)

    def task_done(self, t: _Task, res: dict, results: list) -> None:
        self._finish_task(t)
        t.client.send(Done(t.task_id, res["path"], res["local_path"], res["logical_size"], results,
                           t.action.metrics, self._gauges()))
        self._after_finish(t.client)

    def task_failed(self, t: _Task, exc: BaseException) -> None:
        self._finish_task(t)
        metrics = t.action.metrics if t.action is not None else None
        t.client.send(Failed(t.task_id, exc, metrics, self._gauges()))
        self._after_finish(t.client)

    def _finish_task(self, t: _Task) -> None:
        with self.lock:
            t.client.tasks.pop(t.task_id, None)
        if not t.client.alive and t.segment:
            shm.unlink(t.segment)  # the owner is gone: the service inherits its segments

    def _after_finish(self, c: _Client) -> None:
        with self.lock:
            idle = not c.tasks
        if idle and c.closing and c.alive:
            c.send(Closed())
        if idle and not c.alive:
            shm.sweep(c.prefix)
        self._arm_linger()

    def _client_closing(self, client: _Client) -> None:
        with self.lock:
            client.closing = True
            idle = not client.tasks
        if idle:
            client.send(Closed())
            return
        # its queued tasks fail now; the last of its tasks to settle answers Closed (_after_finish)
        self.scheduler.cancel(lambda t: t.client is client, CancelledError("the upload scheduler was closed"))

    def _client_gone(self, client: _Client) -> None:
        with self.lock:
            client.alive = False
            self.clients.pop(client.cid, None)
        for fut, _at in list(client.regions.values()):  # attempts waiting for it fail now
            if not fut.done():
                fut.set_exception(UploadServiceError(f"client {client.cid} (pid {client.pid}) disconnected "
                                                     "before writing its change sets"))
        # its queued tasks are dropped (nobody hears of them); their segments are unlinked
        self.scheduler.cancel(lambda t: t.client is client, CancelledError("the client is gone"))
        with self.lock:
            in_use = {t.segment for t in client.tasks.values() if t.segment}  # in a running attempt
        if not client.closing:
            log.warning("client %s (pid %s) disconnected without closing: reclaiming its memory; its "
                        "unconfirmed files become orphans (deleted after the grace period unless a "
                        "checkpoint references them)",
                        client.cid, client.pid)
            self.registry.submit("drop_client", client.cid, int(time.time() * 1000))
        for name in shm.list_segments(client.prefix):
            if name not in in_use:
                shm.unlink(name)
        self._arm_linger()

    # ---- change sets the clients write -----------------------------------------------------
    def fill_regions(self, paths: List[str], held: list, tasks: List[_Task], limit_s: Optional[float],
                     settled) -> None:
        """Have each client write its `held` [(file offset, HeldSpan)] into `paths` and wait for all
        of them. Raises (an OSError, so the policy retries) if one fails, disconnects, or is still
        writing at `limit_s` or once the action was decided without this attempt."""
        per_client: Dict[_Client, list] = {}
        for off, span in held:
            t = tasks[span.owner]
            per_client.setdefault(t.client, []).append((t.task_id, span.ref, off))
        attempt_id = next(_attempt_ids)
        waits = []
        try:
            for client, writes in per_client.items():
                fut: Future = Future()
                client.regions[attempt_id] = (fut, time.monotonic())
                if not client.alive:  # _client_gone may have run before the entry existed
                    raise UploadServiceError(f"client {client.cid} (pid {client.pid}) is gone")
                client.send(WriteRegion(attempt_id, paths, writes))
                waits.append((client, fut))
            deadline = None if not limit_s else time.monotonic() + limit_s
            for client, fut in waits:
                while True:
                    try:
                        error = fut.result(_REGION_POLL_S)
                        break
                    except _FutureTimeout:
                        if (deadline is not None and time.monotonic() >= deadline) or settled():
                            raise TimeoutError(f"client {client.cid} (pid {client.pid}) did not write its "
                                               "change sets before the attempt was given up") from None
                if error is not None:
                    raise error
        finally:
            # an unanswered request stays until its answer comes, however late: until then the
            # client counts as stalled (`_Client.stalled`) and later attempts leave it out
            for client in per_client:
                entry = client.regions.get(attempt_id)
                if entry is not None and entry[0].done():
                    client.regions.pop(attempt_id, None)

    def _on_written(self, msg: Written, client: _Client) -> None:
        entry = client.regions.pop(msg.attempt_id, None)
        if entry is not None and not entry[0].done():
            entry[0].set_result(msg.error)

    # ---- registry and calls ----------------------------------------------------------------
    def _on_release(self, msg: Release, client: _Client) -> None:
        self.registry.submit("release", msg.path, client.cid)

    def _call(self, msg: Call, client: _Client) -> None:
        call_id, name, args = msg.call_id, msg.name, msg.args

        def answer():
            try:
                if name == "ping":
                    value = args
                elif name == "status":
                    self._ready.wait(60)
                    value = self.status()
                elif name == "count":
                    value = self.registry.query("count", args)
                elif name == "delete_failures":
                    value = self.registry.query("delete_failures")
                elif name == "gauges":
                    value = self._gauges()
                elif name == "flush":
                    self.scheduler.flush()
                    value = None
                elif name == "sync":
                    value = self.registry.query("sync", timeout=120)
                elif name == "reg":  # start / stop tracking: answered once durable in the journal
                    kind, path, n = args
                    try:
                        if kind == "start":
                            self.registry.apply("start", path, int(n), {client.cid: int(n)})
                        elif kind == "stop":
                            self.registry.apply("stop", path)
                        else:
                            raise ValueError(f"unknown registry call {kind!r}")
                    except OSError as exc:  # logged (and so pushed to every client) as well as answered
                        log.error("%s", exc)
                        raise
                    value = None
                else:
                    raise ValueError(f"unknown call {name!r}")
                client.send(Reply(call_id, True, value))
            except BaseException as exc:
                client.send(Reply(call_id, False, exc))

        if name == "ping":
            answer()  # on the reader thread: this is what the latency benchmark measures
        else:
            threading.Thread(target=answer, daemon=True).start()

    def status(self) -> dict:
        in_flight, queued, available = self._gauges()
        with self.lock:
            return {
                "pid": os.getpid(), "instance": self.instance,
                "registry_pid": self.registry.pid if self.registry else None,
                "registry_restarts": self.registry.restarts if self.registry else 0,
                "uploader_pids": self.pool.pids() if self.pool else [],
                "clients": sorted(self.clients), "in_flight": in_flight, "queued": queued,
                "available": bool(available), "scheduler": type(self.scheduler).__name__,
            }


class _ClientNotices(logging.Handler):
    """Pushes the service's errors to its clients (Notice): visible in their logs even when the
    service's log file is on a full file system."""

    def __init__(self, service: "UploadService"):
        super().__init__(logging.ERROR)
        self.service = service

    def emit(self, record: logging.LogRecord) -> None:
        try:
            text = record.getMessage()
            with self.service.lock:
                clients = [c for c in self.service.clients.values() if c.alive and c.welcomed]
            for c in clients:
                c.send(Notice(text[:2000]))
        except Exception:  # a log handler must never raise
            pass

def _keep_socket_file(listener) -> None:
    """multiprocessing unlinks a Unix listener's path when the listener closes and at exit. After
    a temp cleaner removed this service's directory, that path may be a fresh service's socket: the
    service removes its socket itself, and only while the path is still its own."""
    inner = getattr(listener, "_listener", None)
    unlink = getattr(inner, "_unlink", None)
    if unlink is not None:
        unlink.cancel()
        inner._unlink = None


def main(argv=None) -> int:
    argv = sys.argv[1:] if argv is None else argv
    paths = ServicePaths(argv[0])
    from dstl.config import StorageConfig

    logging.basicConfig(level=logging.WARNING, format="%(asctime)s service %(levelname)s %(message)s")
    signal.signal(signal.SIGINT, signal.SIG_IGN)
    import faulthandler

    faulthandler.register(signal.SIGUSR1, all_threads=True)  # operators: `kill -USR1 <pid>` dumps stacks to the log
    with open(paths.config_file) as f:
        config = StorageConfig.from_mapping(json.load(f))
    linger = int(os.environ.get("DSTL_SERVICE_LINGER_MS", LINGER_MS_DEFAULT))
    from dstl.changelog.upload.service.worker import _preload_user_modules

    _preload_user_modules()
    service = UploadService(paths, config, linger)
    logging.getLogger().addHandler(_ClientNotices(service))

    def on_term(_signo, _frame):  # stop accepting, finish what runs, clean up, exit
        service.terminated = True

    signal.signal(signal.SIGTERM, on_term)
    service.serve()
    return 0


if __name__ == "__main__":
    sys.exit(main())

