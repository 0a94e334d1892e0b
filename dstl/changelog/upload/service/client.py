"""The writer-process side of the upload service: connection, scheduler and registry proxies.

`open_service_client(config, job_id, metrics)` connects to the host's service for `config` (starting
it under the file lock if none runs) and returns `(scheduler, registry)`:

* `ProcessUploadScheduler` (a `StateChangeUploadScheduler`): `upload(task)` waits while the service
  reports back-pressure, builds the task's sealed bodies straight into a mapped shared-memory
  segment (a kept segment of a finished task when one is free: its pages are mapped already) and
  sends a descriptor; results and failures come back on a reader thread and are delivered to the
  task on a callback thread (so a callback that uploads again never blocks the reader). Where files
  are raw and local, the bodies stay here instead: the descriptor says so, and when the service's
  attempt has made the file it asks for them (WriteRegion), and a region writer thread writes them
  at their offsets (one copy, as in thread mode, and none through shared memory).
* `ServiceRegistryProxy` (the `TaskChangelogRegistry` interface): every call is a message to the
  service's registry process.

If the service dies, every pending task fails at once with `UploadServiceError`, later uploads fail
the same way, and handles already returned stay readable (they are plain files).
"""
from __future__ import annotations

import atexit
import errno
import itertools
import logging
import os
import queue
import secrets
import subprocess
import sys
import threading
import time
import weakref
from concurrent.futures import CancelledError, Future
from multiprocessing.connection import Client
from multiprocessing.reduction import ForkingPickler
from typing import Dict, Optional, Tuple

from dstl.errors import UploadServiceError
from dstl.changelog.upload.scheduler import StateChangeUploadScheduler
from dstl.changelog.upload.service import shm
from dstl.changelog.upload.service.protocol import (Availability, Call, Close, Closed, Done, Failed, Hello,
                                                     Notice, ProtocolError, Release, Reply, Upload, Welcome,
                                                     WriteRegion, Written, dispatch)
from dstl.changelog.upload.service.runtime import ServicePaths, file_lock, pid_alive
from dstl.changelog.upload.service.worker import portable_error
from dstl.changelog.upload.throttle import AvailabilityProvider

log = logging.getLogger("dstl.changelog.upload.service.client")

START_TIMEOUT_S = 60.0
LIVENESS_S = 5.0  # silence (with uploads pending) after which the service is pinged, and the ping's timeout
OUTBOX = 2  # tasks waiting for a sender thread (build into shared memory, descriptor)
SENDERS = 2  # sender threads: two sealed bodies are built into shared memory at once (both cores)
FREE_SEGMENTS = 64  # finished tasks' segments kept (mapped) for reuse: their pages are allocated and mapped
# already, so building a body into one is a plain memcpy (a fresh one costs page allocation and zeroing)
FREE_IDLE_S = 5.0  # a kept segment not reused for this long is unlinked (the memory goes back when idle)
CLIENT_WRITES_ENV = "DSTL_CLIENT_WRITES"  # "0": raw local files go through shared memory too


def holds_bodies(config) -> bool:
    """Whether this client keeps its bodies and writes them into the service's files itself: raw
    (uncompressed) files on the local disk, unless DSTL_CLIENT_WRITES=0 (docs/service.md)."""
    from dstl.changelog import fs as dfs

    value = os.environ.get(CLIENT_WRITES_ENV, "").strip()
    if value not in ("", "0", "1"):
        raise ValueError(f"{CLIENT_WRITES_ENV}={value!r}: expected 1 (the default: clients write raw local "
                         "files) or 0 (through shared memory and the uploader processes)")
    if value == "0" or config.compression is not None:
        return False
    try:
        return dfs.is_local(dfs.changelog_dir(config.base_path, "x")[0])
    except Exception:
        return False


def _drop(seg) -> None:
    if seg is not None:  # None: the task's bodies were held here, not in a segment
        seg.unlink()
_LAUNCHER = (
    "import subprocess, sys\n"
    "log = open(sys.argv[1], 'ab')\n"
    "p = subprocess.Popen(sys.argv[2:], stdin=subprocess.DEVNULL, stdout=log, stderr=log, close_fds=True,"
    " start_new_session=True)\n"
    "print(p.pid)\n"
)


def _package_root() -> str:
    import dstl

    return os.path.dirname(os.path.dirname(os.path.abspath(dstl.__file__)))


def _start_service(paths: ServicePaths, config) -> int:
    """Launch the service detached (through a short-lived launcher, so it is nobody's zombie); its pid."""
    import json

    tmp = paths.config_file + f".{os.getpid()}.tmp"
    with open(tmp, "w") as f:  # never the fsspec options: they may hold credentials
        json.dump(config.replace(upload_mode="thread").to_mapping(as_strings=True, with_fs_options=False), f)
    os.replace(tmp, paths.config_file)
    paths.authkey(create=True)
    env = dict(os.environ)
    from dstl.changelog.fs import options_env

    env.update(options_env(config.base_path, config.fs_options))  # in the service's memory only
    # the service's temporary files (multiprocessing's pymp-* directory) live and go with its directory
    os.makedirs(paths.tmp_dir, mode=0o700, exist_ok=True)
    env["TMPDIR"] = paths.tmp_dir
    root = _package_root()
    env["PYTHONPATH"] = root + (os.pathsep + env["PYTHONPATH"] if env.get("PYTHONPATH") else "")
    out = subprocess.run([sys.executable, "-S", "-c", _LAUNCHER, paths.log_file, sys.executable, "-m",
                          "dstl.changelog.upload.service.server", paths.directory], env=env, check=True, timeout=60,
                         stdout=subprocess.PIPE, text=True)
    return int(out.stdout.strip())


def _log_tail(paths: ServicePaths, n: int = 2000) -> str:
    try:
        with open(paths.log_file, "rb") as f:
            f.seek(0, os.SEEK_END)
            f.seek(max(0, f.tell() - n))
            return f.read().decode(errors="replace").strip()
    except OSError:
        return ""


def _try_connect(paths: ServicePaths):
    if not os.path.exists(paths.socket):
        return None
    try:
        return Client(paths.socket, family="AF_UNIX", authkey=paths.authkey())
    except (ConnectionRefusedError, FileNotFoundError):
        return None
    except OSError as exc:
        log.warning("could not connect to the upload service at %s: %s", paths.socket, exc)
        return None


def _connect(paths: ServicePaths, config, tries: int = 3):
    """Connect to the running service or start one; a service that dies (or stops) during the
    hand-shake is tried again, up to `tries` times: the next try starts a fresh one."""
    for n in range(tries):
        try:
            return _connect_once(paths, config)
        except (EOFError, ConnectionError, _Refused, FileNotFoundError) as exc:
            # FileNotFoundError: an idle service removed its directory while we were about to use it
            if n == tries - 1:
                raise UploadServiceError(f"the upload service went away while connecting: {exc!r}") from exc
            time.sleep(0.05 * (n + 1))
    raise AssertionError("unreachable")


class _Refused(Exception):
    """The service is stopping (its linger ended): connect to (or start) the next one."""


def _connect_once(paths: ServicePaths, config):
    """Connect to the running service or start one; the flock makes racing writers start only one."""
    os.makedirs(paths.directory, mode=0o700, exist_ok=True)
    with file_lock(paths.lock, timeout_s=START_TIMEOUT_S):
        conn = _try_connect(paths)
        if conn is None:
            try:
                os.unlink(paths.socket)  # a dead service's socket
            except FileNotFoundError:
                pass
            pid = _start_service(paths, config)
            deadline = time.monotonic() + START_TIMEOUT_S
            while conn is None:
                if not pid_alive(pid):
                    raise UploadServiceError(f"the upload service (pid {pid}) exited during start-up; "
                                             f"{paths.log_file} ends with:\n{_log_tail(paths)}")
                if time.monotonic() > deadline:
                    raise UploadServiceError(
                        f"the upload service did not start within {START_TIMEOUT_S:.0f} s; see {paths.log_file}")
                time.sleep(0.005)
                conn = _try_connect(paths)
        cid = secrets.token_hex(4)
        try:
            conn.send(Hello(cid, os.getpid()))
        except OSError as exc:
            conn.close()
            raise ConnectionError(str(exc)) from exc
        if not conn.poll(START_TIMEOUT_S):
            conn.close()
            raise UploadServiceError("the upload service did not answer")
        try:
            welcome = conn.recv()
        except BaseException:
            conn.close()
            raise
        if type(welcome) is not Welcome:
            conn.close()
            raise _Refused(f"the upload service refused the connection: {welcome!r:.200}")
    return conn, cid, welcome


class ServiceConnection:
    """One client's connection: sends requests, reads results, pushes back-pressure changes."""

    def __init__(self, paths: ServicePaths, config, metrics=None):
        self.paths = paths
        self.config = config
        self.metrics = metrics
        self.holds = holds_bodies(config)  # first: a bad DSTL_CLIENT_WRITES connects to nothing
        self.conn, self.cid, welcome = _connect(paths, config)
        self.instance, self.service_pid = welcome.instance, welcome.pid
        self.max_in_flight, available, in_flight = welcome.max_in_flight, welcome.available, welcome.in_flight
        self.prefix = shm.segment_prefix(self.instance, os.getpid(), self.cid)
        self._send_lock = threading.Lock()
        self._lock = threading.Condition()
        self._pending: Dict[int, Tuple[object, shm.Segment]] = {}
        self._calls: Dict[int, Future] = {}
        self._ids = itertools.count(1)
        self._seen_batches: Dict[int, None] = {}
        self.broken: Optional[BaseException] = None
        self.closing = False
        self._closed_event = threading.Event()
        self.availability = AvailabilityProvider()
        self.available = bool(available)
        if not self.available:
            self.availability._set_unavailable()
        self.gauges = (in_flight, 0, int(self.available))
        self._users = 2  # the scheduler and the registry proxy
        # (Segment, freed at) of finished tasks' segments, at most FREE_SEGMENTS of them and
        # max_in_flight bytes (what uploads in flight may hold anyway)
        self._free: list = []
        self._free_bytes = 0
        self._free_budget = int(config.max_in_flight)
        self.bytes_shared = 0  # payload bytes copied into shared memory (the one copy)
        self.bytes_written = 0  # payload bytes this client wrote into the service's files itself
        self.bytes_sent = 0  # bytes written to the socket (descriptors, registry calls)
        self._outbox: "queue.Queue" = queue.Queue(maxsize=OUTBOX)
        self._unsent = 0  # tasks handed to `submit` whose descriptor is not sent yet
        self._order_lock = threading.Lock()  # orders the senders' descriptors (see _submit_now)
        for i in range(SENDERS):
            threading.Thread(target=self._send_loop, name=f"dstl-service-sender-{i}", daemon=True).start()
        self._callbacks: "queue.Queue" = queue.Queue()
        self._regions: "queue.Queue" = queue.Queue()
        # one region writer per attempt the service runs at once (upload.num-threads), as thread mode
        # has upload threads: with two, the last file of a persist queued behind earlier ones (the
        # persist's tail: 33-42 ms against 20-31 with five, alternating A/B under load 2)
        self._region_writers = int(config.upload_num_threads) if self.holds else 0
        for i in range(self._region_writers):
            threading.Thread(target=self._region_loop, name=f"dstl-service-region-writer-{i}", daemon=True).start()
        self._table = {Done: self._on_done, Failed: self._on_failed, Availability: self._on_avail,
                       Reply: self._on_reply, WriteRegion: self._regions.put,
                       Closed: lambda _msg: self._closed_event.set(),
                       Notice: lambda msg: log.error("upload service (pid %s): %s", self.service_pid, msg.text)}
        threading.Thread(target=self._callback_loop, name="dstl-service-callbacks", daemon=True).start()
        self._reader = threading.Thread(target=self._read_loop, name="dstl-service-reader", daemon=True)
        self._reader.start()
        self.last_heard = time.monotonic()
        liveness = float(os.environ.get("DSTL_SERVICE_LIVENESS_MS", LIVENESS_S * 1000)) / 1000.0
        self.liveness_s = max(liveness, config.upload_timeout_ms / 1000.0)
        threading.Thread(target=self._watchdog, name="dstl-service-watchdog", daemon=True).start()
        _open_connections.add(self)

    # ---- sending ---------------------------------------------------------------------------
    def send(self, msg) -> None:
        if self.broken is not None:
            raise self._error()
        buf = ForkingPickler.dumps(msg)  # what Connection.send does, but we count the bytes
        try:
            with self._send_lock:
                self.conn.send_bytes(buf)
                self.bytes_sent += len(buf)
        except (OSError, EOFError, ValueError) as exc:
            self._break(exc)
            raise self._error() from exc

    def _error(self) -> UploadServiceError:
        err = UploadServiceError(f"the upload service (pid {self.service_pid}) is gone: {self.broken}")
        return err

    def call(self, name: str, args=None, timeout: float = 60.0):
        """A request with a reply (ping, status, count, sync)."""
        fut: Future = Future()
        call_id = next(self._ids)
        with self._lock:
            self._calls[call_id] = fut
        try:
            self.send(Call(call_id, name, args))
            return fut.result(timeout)
        finally:
            with self._lock:
                self._calls.pop(call_id, None)

    # ---- uploads ---------------------------------------------------------------------------
    def wait_available(self) -> None:
        with self._lock:
            while not self.available and self.broken is None and not self.closing:
                self._lock.wait()

    def submit(self, task, job_id: str, local_dir: Optional[str]) -> None:
        """Hand `task` to the sender thread (caller checked state): the copy into shared memory then
        overlaps the writer's next appends, as the upload itself does in thread mode. At most
        OUTBOX tasks wait for it (their bodies are held until copied)."""
        with self._lock:
            self._unsent += 1
        self._outbox.put((task, job_id, local_dir, time.monotonic()))

    def _send_loop(self) -> None:
        while True:
            item = self._outbox.get()
            try:
                if item is None:
                    return
                task = item[0]
                counted = [False]  # set once _submit_now took the task off `_unsent`
                try:
                    if self.broken is not None:
                        raise self._error()
                    self._submit_now(*item, counted)
                except Exception as exc:  # e.g. /dev/shm full: the task fails, nothing is lost silently
                    self._callbacks.put((task.fail, (exc,)))
                finally:
                    if not counted[0]:
                        with self._lock:
                            self._unsent -= 1
            finally:
                self._outbox.task_done()

    def _drain_outbox(self, timeout_s: float) -> None:
        """Wait until the sender thread handed over every task given to `submit`."""
        deadline = time.monotonic() + timeout_s
        while self._outbox.unfinished_tasks and time.monotonic() < deadline:
            time.sleep(0.001)

    def _submit_now(self, task, job_id: str, local_dir: Optional[str], queued_at: float, counted: list) -> None:
        """Build the bodies into a kept or new segment and send the descriptor.

        The descriptor carries `queued_at`, when the writer handed the task over: the service's
        persist delay runs from there, as in thread mode, so the copy does not add to a persist's
        wait. Its `more` says other tasks handed over are still being copied: the batch waits for
        them rather than drain early without them. `counted[0]` is set once the task is off
        `_unsent` (the sender loop counts it off otherwise)."""
        task_id = next(self._ids)
        sets = task.change_sets
        bodies = [cs.body for cs in sets]
        if self.holds:
            items = [(-1, len(b), cs.log_id.bytes, int(cs.sequence_number), cs.size, cs.num_changes)
                     for b, cs in zip(bodies, sets)]
            self._send_upload(task, task_id, None, job_id, local_dir, items, queued_at, counted)
            return
        need = sum(len(b) for b in bodies)
        seg = self._take_free(need)
        try:
            if seg is not None:
                try:
                    _, spans = seg.write(bodies)
                except FileNotFoundError:  # swept meanwhile: make a new one
                    seg.close()
                    seg = None
            if seg is None:
                seg = shm.Segment(f"{self.prefix}{task_id}", need)
                _, spans = seg.write(bodies)
        except BaseException:
            if seg is not None:  # a failed write leaves nothing worth keeping
                seg.unlink()
            raise
        self.bytes_shared += sum(n for _, n in spans)
        items = [(off, n, cs.log_id.bytes, int(cs.sequence_number), cs.size, cs.num_changes)
                 for (off, n), cs in zip(spans, sets)]
        self._send_upload(task, task_id, seg, job_id, local_dir, items, queued_at, counted)

    def _send_upload(self, task, task_id: int, seg: Optional[shm.Segment], job_id: str,
                     local_dir: Optional[str], items: list, queued_at: float, counted: list) -> None:
        """Make the task pending and send its descriptor (`seg` None: its bodies stay here)."""
        # counted down and sent in one step: the last task counted down is the last one sent, and
        # the service knows nothing more is coming once it has arrived
        with self._order_lock:
            with self._lock:
                self._pending[task_id] = (task, seg)
                self._unsent -= 1
                counted[0] = True
                more = self._unsent > 0
            failed: Optional[UploadServiceError] = None
            try:
                self.send(Upload(task_id, job_id, local_dir, seg.name if seg is not None else "", items,
                                 task.size, queued_at, more))
            except UploadServiceError as exc:
                failed = exc
        if failed is not None:
            with self._lock:  # _break may have run before the task was pending: whoever pops it fails it
                entry = self._pending.pop(task_id, None)
            if entry is not None:
                _drop(seg)
                self._callbacks.put((task.fail, (failed,)))

    def _region_loop(self) -> None:
        while True:
            msg = self._regions.get()
            if msg is None:
                return
            error: Optional[BaseException] = None
            try:
                self._write_regions(msg)
            except BaseException as exc:  # the attempt fails (and is retried); this client goes on
                error = portable_error(exc)
            if self.broken is None:
                try:
                    self.send(Written(msg.attempt_id, error))
                except UploadServiceError:
                    pass

    def _write_regions(self, msg: WriteRegion) -> None:
        """Write the asked change sets of pending tasks into the attempt's files (made and sized by
        the service: never created here), each run of adjacent ones with one `write_bodies_at`
        call, which opens, writes and closes in one GIL release."""
        from dstl.format import write_bodies_at

        with self._lock:
            entries = [(self._pending.get(task_id), index, off) for task_id, index, off in msg.writes]
        spans = []
        for (entry, index, off), (task_id, _i, _o) in zip(entries, msg.writes):
            if entry is None:
                raise UploadServiceError(f"task {task_id} is no longer pending in this client")
            spans.append((off, entry[0].change_sets[index].body))
        spans.sort(key=lambda e: e[0])
        i = 0
        while i < len(spans):
            start, end, run = spans[i][0], spans[i][0], []
            while i < len(spans) and spans[i][0] == end:
                run.append(spans[i][1])
                end += len(spans[i][1])
                i += 1
            write_bodies_at(msg.paths, start, run)
            self.bytes_written += end - start

    def _take_free(self, need: int) -> Optional[shm.Segment]:
        """The kept segment that fits `need` bytes best (the smallest big enough, else the largest,
        which then grows), or None."""
        with self._lock:
            if not self._free:
                return None
            fits = [e for e in self._free if e[0].size >= need]
            best = (min(fits, key=lambda e: e[0].size) if fits
                    else max(self._free, key=lambda e: e[0].size))
            self._free.remove(best)
            self._free_bytes -= best[0].size
            return best[0]

    def _keep_free(self, seg: shm.Segment) -> bool:
        """Keep a finished task's segment for reuse if the budget allows (caller holds the lock)."""
        if (len(self._free) >= FREE_SEGMENTS or self._free_bytes + seg.size > self._free_budget
                or self.broken is not None or self.closing):
            return False
        self._free.append((seg, time.monotonic()))
        self._free_bytes += seg.size
        return True

    def _trim_free(self, now: float) -> None:
        """Unlink kept segments that were not reused for FREE_IDLE_S."""
        with self._lock:
            old = [e for e in self._free if now - e[1] >= FREE_IDLE_S]
            for e in old:
                self._free.remove(e)
                self._free_bytes -= e[0].size
        for seg, _ in old:
            seg.unlink()

    def _take_all_free(self) -> list:
        """Every kept segment (caller holds the lock and unlinks them)."""
        free, self._free, self._free_bytes = [e[0] for e in self._free], [], 0
        return free

    # ---- receiving -------------------------------------------------------------------------
    def _read_loop(self) -> None:
        while True:
            try:
                msg = self.conn.recv()
                self.last_heard = time.monotonic()
            except (EOFError, OSError) as exc:
                if not (self.closing and self._closed_event.is_set()):
                    self._break(exc if str(exc) else EOFError("connection closed"))
                return
            except Exception as exc:  # an unpicklable message: the protocol is broken
                self._break(exc)
                return
            try:
                dispatch(self._table, msg)
            except ProtocolError as exc:
                self._break(exc)
                return

    def _on_reply(self, msg: Reply) -> None:
        with self._lock:
            fut = self._calls.get(msg.call_id)
        if fut is not None and not fut.done():
            if msg.ok:
                fut.set_result(msg.value)
            else:
                fut.set_exception(msg.value)

    def _watchdog(self) -> None:
        """A service that stops answering (stopped, hung) must not hang the writers: while uploads are
        pending and nothing was heard for `liveness_s`, ping it; no answer within `liveness_s` breaks the
        connection, which fails every pending upload with UploadServiceError."""
        while self.broken is None and not self._closed_event.is_set():
            time.sleep(min(1.0, self.liveness_s / 4))
            self._trim_free(time.monotonic())
            with self._lock:
                busy = bool(self._pending)
            if not busy or time.monotonic() - self.last_heard < self.liveness_s:
                continue
            try:
                self.call("ping", 0, timeout=self.liveness_s)
            except Exception as exc:
                if self.broken is None and not self._closed_event.is_set():
                    self._break(TimeoutError(f"no answer for {2 * self.liveness_s:.0f} s ({exc!r})"))
                return

    def _on_avail(self, msg: Availability) -> None:
        available, gauges = msg.available, msg.gauges
        pending = None
        with self._lock:
            self.gauges = gauges
            self.available = available
            if available:
                pending = self.availability._swap_available()
            else:
                self.availability._set_unavailable()
            self._lock.notify_all()
        if pending is not None:
            pending.set_result(None)

    def _take(self, task_id: int):
        with self._lock:
            entry = self._pending.pop(task_id, None)
            keep = entry is not None and entry[1] is not None and self._keep_free(entry[1])
        if entry is not None and not keep:
            _drop(entry[1])  # this client owns its segments (see shm.py)
        return entry

    def _on_done(self, msg: Done) -> None:
        self.gauges = msg.gauges
        entry = self._take(msg.task_id)
        self._record(msg.metrics)
        if entry is not None:
            self._callbacks.put((_complete, (entry[0], msg.path, msg.local_path, msg.logical_size, msg.results)))

    def _on_failed(self, msg: Failed) -> None:
        self.gauges = msg.gauges
        entry = self._take(msg.task_id)
        self._record(msg.metrics)
        if entry is not None:
            self._callbacks.put((entry[0].fail, (msg.error,)))

    def _record(self, m: Optional[dict]) -> None:
        """Apply a batch's metrics once, however many of this client's tasks were in it."""
        if not m or self.metrics is None:
            return
        batch_id = m.get("batch_id")
        with self._lock:
            if batch_id in self._seen_batches:
                return
            self._seen_batches[batch_id] = None
            if len(self._seen_batches) > 4096:
                self._seen_batches.pop(next(iter(self._seen_batches)))
        g = self.metrics
        g.upload_requests.inc(m["requests"])
        g.upload_failures.inc(m["failures"])
        for v in m["sizes"]:
            g.upload_sizes.update(v)
        for v in m["latencies"]:
            g.upload_latencies_nanos.update(v)
        if "attempts" in m:
            g.attempts_per_upload.update(m["attempts"])
            g.total_attempts_per_upload.update(m["total_attempts"])
        if "batch" in m:
            g.upload_batch_sizes.update(m["batch"])

    def _callback_loop(self) -> None:
        while True:
            fn, args = self._callbacks.get()
            if fn is None:
                return
            try:
                fn(*args)
            except Exception:
                log.exception("an upload callback failed")

    def _break(self, exc: BaseException) -> None:
        """The service is gone: fail everything pending, wake waiters, free our segments."""
        with self._lock:
            if self.broken is not None:
                return
            self.broken = exc
            pending, self._pending = self._pending, {}
            calls = list(self._calls.values())
            free = self._take_all_free()
            self._lock.notify_all()
        for seg in free:
            seg.unlink()
        log.error("lost the upload service (pid %s): %s", self.service_pid, exc)
        err = self._error()
        for task, seg in pending.values():
            _drop(seg)
            self._callbacks.put((task.fail, (err,)))
        for fut in calls:
            if not fut.done():
                fut.set_exception(err)
        swap = self.availability._swap_available()  # waiters must not hang on a dead service
        if swap is not None:
            swap.set_result(None)

    # ---- closing ---------------------------------------------------------------------------
    def close_uploads(self, timeout_s: float) -> None:
        """Cancel queued uploads, wait for this client's running attempts, fail what is left."""
        with self._lock:
            if self.closing:
                return
            self.closing = True
            self._lock.notify_all()
        self._drain_outbox(timeout_s)
        if self.broken is None:
            try:
                self.send(Close())
                self._closed_event.wait(timeout_s)
            except UploadServiceError:
                pass
        with self._lock:
            pending, self._pending = self._pending, {}
            free = self._take_all_free()
        for seg in free:
            seg.unlink()
        for task, seg in pending.values():
            _drop(seg)
            self._callbacks.put((task.fail, (CancelledError("the upload scheduler was closed"),)))

    def release_user(self) -> None:
        """Drop one user (scheduler or registry proxy); the last one closes the connection."""
        with self._lock:
            self._users -= 1
            last = self._users <= 0
        if last:
            self.shutdown()

    def abandon(self) -> None:
        """Drop the connection without saying close (see `_abandon_all_at_exit`)."""
        with self._lock:
            free = self._take_all_free()
            self.closing = True
        self._closed_event.set()
        hard_close(self.conn)
        self._callbacks.put((None, None))
        for seg in free:  # segments of tasks in flight are the service's to unlink now
            seg.unlink()
        _open_connections.discard(self)

    def shutdown(self) -> None:
        if not self.closing:
            self.close_uploads(30.0)
        for _ in range(SENDERS):
            try:
                self._outbox.put(None, timeout=5)
            except queue.Full:
                break
        for _ in range(self._region_writers):
            self._regions.put(None)
        self._closed_event.set()
        hard_close(self.conn)
        self._callbacks.put((None, None))
        for name in shm.list_segments(self.prefix):  # nothing of ours may outlive us
            shm.unlink(name)
        _open_connections.discard(self)


_open_connections: "weakref.WeakSet[ServiceConnection]" = weakref.WeakSet()


@atexit.register
def _abandon_all_at_exit() -> None:
    """The interpreter exits (sys.exit, an uncaught exception, the end of the script) with storages
    still open: like a killed client, this one becomes an orphan owner in the service (its unconfirmed
    files are settled after the grace period), rather than a closed one whose files stay tracked."""
    for c in list(_open_connections):
        try:
            c.abandon()
        except Exception:
            pass


def hard_close(conn) -> None:
    """Shut the socket down before closing it: a plain close() while our reader thread sits in recv()
    would neither wake that thread nor send the peer its end-of-file."""
    import socket

    try:
        s = socket.socket(fileno=os.dup(conn.fileno()))
        try:
            s.shutdown(socket.SHUT_RDWR)
        finally:
            s.close()
    except OSError:
        pass
    try:
        conn.close()
    except OSError:
        pass


def _complete(task, path, local_path, logical_size, results) -> None:
    from dstl.changelog.handles import StreamStateHandle
    from dstl.types import SequenceNumber
    from dstl.changelog.upload.task import UploadResult

    handle = StreamStateHandle(path, logical_size)
    local = StreamStateHandle(local_path, logical_size) if local_path else None
    task.complete([UploadResult(handle, local, off, loff, SequenceNumber(sqn), size)
                   for sqn, off, loff, size in results])


class ProcessUploadScheduler(StateChangeUploadScheduler):
    """`StateChangeUploadScheduler` whose batching, retries and uploads run in the host's service."""

    def __init__(self, connection: ServiceConnection, job_id: str, local_dir: Optional[str] = None):
        self.connection = connection
        self.job_id = job_id
        self.local_dir = local_dir
        self._closed = False
        cfg = connection.config
        self._close_timeout_s = max(30.0, cfg.max_attempts * (cfg.upload_timeout_ms + cfg.next_attempt_delay_ms)
                                    / 1000.0 + 10.0)

    def upload(self, task) -> None:
        c = self.connection
        if c.broken is not None:
            task.fail(c._error())
            return
        if self._closed:
            task.fail(CancelledError("the upload scheduler is closed"))
            return
        c.wait_available()
        if c.broken is not None:
            task.fail(c._error())
            return
        if self._closed or c.closing:
            task.fail(CancelledError("the upload scheduler was closed while waiting for capacity"))
            raise CancelledError("the upload scheduler was closed while waiting for capacity")
        try:
            c.submit(task, self.job_id, self.local_dir)
        except OSError as exc:  # e.g. /dev/shm full: the task fails, nothing is lost silently
            task.fail(exc)

    def get_availability_provider(self) -> AvailabilityProvider:
        return self.connection.availability

    def _gauges(self) -> tuple:
        """(in-flight bytes, queued tasks, available) of the whole service, fresh if it answers."""
        c = self.connection
        if c.broken is None and not c.closing:
            try:
                c.gauges = tuple(c.call("gauges", timeout=2.0))
            except Exception:
                pass  # the last pushed values
        return c.gauges

    def queue_size(self) -> int:
        return int(self._gauges()[1])

    def in_flight_bytes(self) -> int:
        return int(self._gauges()[0])

    @property
    def service_pid(self) -> int:
        return self.connection.service_pid

    def status(self) -> dict:
        """The service's pids and counters (operators, tests)."""
        return self.connection.call("status")

    def flush(self) -> None:
        """Upload everything the service has queued now (all clients' tasks), without the persist delay."""
        self.connection.call("flush")

    def ping(self) -> float:
        """One descriptor-sized round trip to the service, in seconds."""
        t = time.perf_counter()
        self.connection.call("ping", 0)
        return time.perf_counter() - t

    def close(self) -> None:
        if self._closed:
            return
        self._closed = True
        self.connection.close_uploads(self._close_timeout_s)
        self.connection.release_user()

    def __repr__(self) -> str:
        return f"ProcessUploadScheduler(service pid {self.connection.service_pid}, job {self.job_id})"


class ServiceRegistryProxy:
    """`TaskChangelogRegistry` interface, served by the service's registry process."""

    def __init__(self, connection: ServiceConnection):
        self.connection = connection
        self._closed = False

    def _release(self, handle) -> None:
        try:
            self.connection.send(Release(handle.handle_id))
        except UploadServiceError as exc:
            # nothing to release any more: the service that tracked the file is gone (gc is the net)
            log.warning("release of %s not delivered: %s", handle.handle_id, exc)

    def start_tracking(self, handle, ref_count: int) -> None:
        """Track `handle`; returns once the service's journal holds it durably (else raises)."""
        if isinstance(ref_count, bool) or not isinstance(ref_count, int) or ref_count <= 0:
            raise ValueError(f"ref_count must be a positive int, got {ref_count!r}")
        self.connection.call("reg", ("start", handle.handle_id, ref_count))

    def stop_tracking(self, handle) -> None:
        """Untrack `handle` (a checkpoint owns it): returns once that is durable in the service's
        journal, raises (OSError) if the journal cannot record it."""
        self.connection.call("reg", ("stop", handle.handle_id, 0))

    def release(self, handle) -> None:
        self._release(handle)

    def ref_count(self, handle) -> Optional[int]:
        return self.connection.call("count", handle.handle_id)

    @property
    def delete_failures(self) -> int:
        """Failed deletion attempts in the service's registry (each retried with backoff)."""
        return int(self.connection.call("delete_failures", timeout=10.0))

    def wait_for_deletions(self, timeout: Optional[float] = None) -> bool:
        """Block until the deletions requested so far ran (the registry applies operations in order)."""
        try:
            self.connection.call("sync", timeout=timeout if timeout is not None else 120.0)
            return True
        except Exception:
            return False

    def close(self) -> None:
        if self._closed:
            return
        self._closed = True
        if self.connection.broken is None:
            self.wait_for_deletions(60.0)
        self.connection.release_user()

    def __repr__(self) -> str:
        return f"ServiceRegistryProxy(service pid {self.connection.service_pid})"


_swept = False


def _sweep_once() -> None:
    """The first client of a process cleans up after dead services and processes (runtime.sweep_stale)."""
    global _swept
    if _swept:
        return
    _swept = True
    from dstl.changelog.upload.service.runtime import sweep_stale

    counts = sweep_stale()
    if any(counts.values()):
        log.info("removed what dead processes left: %s", counts)


def open_service_client(config, job_id: str, metrics=None, local_recovery_dir: Optional[str] = None
                        ) -> Tuple[ProcessUploadScheduler, ServiceRegistryProxy]:
    """Connect to (or start) the host's upload service for `config`; returns (scheduler, registry)."""
    from dstl.config import StorageConfig

    config = StorageConfig.of(config)
    if not isinstance(job_id, str) or not job_id or "/" in job_id or job_id in (".", ".."):
        raise ValueError(f"job_id must be a non-empty name without '/', got {job_id!r}")
    from dstl.changelog.upload.service.registry_proc import orphan_grace_ms

    orphan_grace_ms()  # a bad DSTL_ORPHAN_GRACE_MS is reported here, not only in the service's log
    if local_recovery_dir:  # the service resolves paths in its own working directory
        local_recovery_dir = os.path.abspath(local_recovery_dir)
    _sweep_once()
    try:
        paths = ServicePaths.for_config(config)
        connection = ServiceConnection(paths, config, metrics)
    except OSError as exc:
        if exc.errno not in (errno.ENOSPC, errno.EDQUOT):
            raise
        from dstl.changelog.upload.service.runtime import runtime_root

        raise UploadServiceError(exc.errno, f"the upload service's runtime directory {runtime_root()} is full "
                                 f"({exc}); free space there or set DSTL_RUNTIME_DIR to a directory with room"
                                 ) from exc
    return ProcessUploadScheduler(connection, job_id, local_recovery_dir), ServiceRegistryProxy(connection)


__all__ = ["open_service_client", "ProcessUploadScheduler", "ServiceRegistryProxy", "ServiceConnection"]
