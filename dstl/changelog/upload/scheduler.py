"""Upload schedulers: direct (synchronous) and batching with retries and back-pressure (docs/semantics.md §7)."""
from __future__ import annotations

import abc
import logging
import threading
import time
from concurrent.futures import CancelledError
from typing import Callable, Dict, Hashable, List, Optional

from dstl._timer import TimerHandle, TimerThread
from dstl.changelog.upload.task import UploadTask
from dstl.changelog.upload.throttle import AvailabilityProvider, UploadThrottle

log = logging.getLogger(__name__)


class StateChangeUploadScheduler(abc.ABC):
    """Accepts upload tasks from writers; settles each task exactly once (complete or fail)."""

    @abc.abstractmethod
    def upload(self, task: UploadTask) -> None:
        """Schedule `task`. Called without any writer lock; may block on back-pressure."""

    def get_availability_provider(self) -> AvailabilityProvider:
        """Always available unless the scheduler applies back-pressure."""
        return AvailabilityProvider.ALWAYS

    def queue_size(self) -> int:
        """Tasks queued and not yet handed to an uploader (gauge `uploadQueueSize`)."""
        return 0

    def in_flight_bytes(self) -> int:
        """Bytes accepted and not yet completed or failed (gauge `inFlightBytes`)."""
        return 0

    def close(self) -> None:
        """Stop accepting uploads and release resources."""

    @staticmethod
    def direct_scheduler(uploader) -> "StateChangeUploadScheduler":
        """One synchronous attempt on the caller's thread: no batching, back-pressure or retries."""
        return DirectUploadScheduler(uploader)

    @staticmethod
    def from_config(config, uploader, metrics, executor=None, retry_policy=None
                    ) -> "BatchingStateChangeUploadScheduler":
        """The batching scheduler built from a `StorageConfig` or a mapping of option keys (thread mode)."""
        from dstl.config import StorageConfig
        from dstl.changelog.upload.retry import RetryingExecutor, RetryPolicy

        config = StorageConfig.of(config)  # a mapping of Flink keys, like the storage accepts
        if retry_policy is None:
            retry_policy = RetryPolicy.from_config(config)
        if executor is None:
            executor = RetryingExecutor(config.upload_num_threads, metrics.attempts_per_upload,
                                        metrics.total_attempts_per_upload)
        return BatchingStateChangeUploadScheduler(
            config.persist_delay_ms, config.persist_size_threshold, config.max_in_flight,
            retry_policy, uploader, executor, metrics)


class DirectUploadScheduler(StateChangeUploadScheduler):
    """docs/semantics.md §7.2: failures go to the task only, never re-raised."""

    def __init__(self, uploader):
        self.uploader = uploader
        self._closed = False

    def upload(self, task: UploadTask) -> None:
        if self._closed:
            task.fail(CancelledError("the upload scheduler is closed"))
            return
        try:
            result = self.uploader.upload([task])
        except Exception as exc:
            task.fail(exc)
            return
        except BaseException as exc:  # KeyboardInterrupt etc.: settle the task, then propagate
            task.fail(exc)
            raise
        result.complete()

    def close(self) -> None:
        if not self._closed:
            self._closed = True
            self.uploader.close()

    def __repr__(self) -> str:
        return f"DirectUploadScheduler({self.uploader!r})"


class _BatchUploadAction:
    """RetriableAction: one uploader attempt with every task of a batch -> one file."""

    __slots__ = ("uploader", "tasks")

    def __init__(self, uploader, tasks: List[UploadTask]):
        self.uploader = uploader
        self.tasks = tasks

    def try_execute(self):
        return self.uploader.upload(self.tasks)

    def complete_with_result(self, result) -> None:
        result.complete()

    def discard_result(self, result) -> None:
        result.discard()

    def handle_failure(self, exc: BaseException) -> None:
        _fail_all(self.tasks, exc)


def _fail_all(tasks, exc: BaseException) -> None:
    """Fail every task; a failing callback must not keep the other tasks waiting."""
    for t in tasks:
        try:
            t.fail(exc)
        except Exception:
            log.exception("failure callback of %r failed", t)


class AdmittedTask(UploadTask):
    """A task the batching scheduler accepted: its bytes go back to the throttle when it settles,
    before the submitter's callback runs (docs/semantics.md §2.4). `inner` is the task as submitted."""

    __slots__ = ("inner", "_throttle")

    def __init__(self, inner: UploadTask, throttle: UploadThrottle):
        # the inner task's fields, not a copy of its change sets: this is on every persist's path
        self.inner = inner
        self.change_sets = inner.change_sets
        self.on_complete = inner.on_complete
        self.on_failed = inner.on_failed
        self.size = inner.size
        self._lock = threading.Lock()
        self._finished = False
        self._throttle = throttle

    def complete(self, results) -> None:
        if self._finish():
            self._throttle.release(self.size)
            self.inner.complete(results)

    def fail(self, exc: BaseException) -> None:
        if self._finish():
            self._throttle.release(self.size)
            self.inner.fail(exc)


ActionFactory = Callable[[List[AdmittedTask]], object]


class BatchingStateChangeUploadScheduler(StateChangeUploadScheduler):
    """Collects tasks of all writers for `persist_delay_ms` (or `persist_size_threshold` bytes) into one file.

    Back-pressure: `upload` waits while `max_in_flight` bytes are accepted and unfinished;
    `upload_nowait` never waits (its callers waited on the availability provider themselves).

    Hooks for a host with several kinds of tasks (the upload service):
    - `make_action(tasks) -> RetriableAction` builds the attempt for one batch (default: one
      uploader attempt writing the tasks into one file); it gets `AdmittedTask`s whose `inner` is
      the task as submitted;
    - `group_key(task)` splits each drain into one batch per key, first-come order kept inside a
      batch (default: one batch per drain);
    - `cancel(predicate, exc)` fails queued tasks, `fail_later_uploads(exc)` makes an error sticky.
    """

    def __init__(self, persist_delay_ms: int, persist_size_threshold: int, max_in_flight: int,
                 retry_policy, uploader, executor, metrics=None, *,
                 make_action: Optional[ActionFactory] = None,
                 group_key: Optional[Callable[[UploadTask], Hashable]] = None):
        if persist_size_threshold > max_in_flight:
            raise ValueError(
                f"persist-size-threshold ({persist_size_threshold}) must not exceed "
                f"upload.max-in-flight ({max_in_flight})")
        if persist_delay_ms < 0:
            raise ValueError(f"persist-delay must be >= 0 ms, got {persist_delay_ms}")
        if uploader is None and make_action is None:
            raise ValueError("a batching scheduler needs an uploader or a make_action factory")
        self.persist_delay_ms = int(persist_delay_ms)
        self.persist_size_threshold = int(persist_size_threshold)
        self.retry_policy = retry_policy
        self.uploader = uploader
        self.executor = executor
        self.metrics = metrics
        self._make_action = make_action
        self._group_key = group_key
        self._throttle = UploadThrottle(max_in_flight)
        self._lock = threading.Lock()
        self._queue: List[AdmittedTask] = []
        self._queued_bytes = 0
        # One timer thread for the persist delay (a threading.Timer per batch would start a thread per
        # batch, and Thread.start() waits for the new thread: about 2 ms of the appending thread's
        # time each on a busy 2-core host, eight times per 100 MB write).
        self._timers = TimerThread("dstl-persist-delay")
        self._timer: Optional[TimerHandle] = None
        self._deadline = 0.0  # time.monotonic() at which the pending timer drains
        self._first_queued = 0.0  # time.monotonic() the first queued task was queued (or handed over)
        self._closed = False
        self._error: Optional[BaseException] = None  # sticky: set by a non-I/O hand-off failure
        self._close_lock = threading.Lock()
        self._closed_done = False

    # -- gauges -------------------------------------------------------------------------------
    def queue_size(self) -> int:
        return len(self._queue)

    def in_flight_bytes(self) -> int:
        return self._throttle.in_flight

    def get_availability_provider(self) -> AvailabilityProvider:
        return self._throttle.availability

    @property
    def max_in_flight(self) -> int:
        return self._throttle.max_in_flight

    @property
    def waiting_callers(self) -> int:
        """Callers blocked on back-pressure right now (for tests and diagnostics)."""
        return self._throttle.waiting

    @property
    def sticky_error(self) -> Optional[BaseException]:
        return self._error

    def fail_later_uploads(self, exc: BaseException) -> None:
        """Make `exc` sticky (unless an error already is): queued and later uploads fail with it."""
        with self._lock:
            if self._error is None:
                self._error = exc

    # -- upload ---------------------------------------------------------------------------------
    def upload(self, task: UploadTask) -> None:
        self._admit(task, True)

    def upload_nowait(self, task: UploadTask, queued_at: Optional[float] = None, more: bool = False) -> None:
        """Like `upload`, but take the capacity at once even past `max_in_flight`, and never raise:
        a closed scheduler fails the task with CancelledError. For a host whose callers wait for
        availability themselves (one task each may overshoot; later ones wait).

        For a host whose callers prepare a task before it arrives (the upload service's clients copy
        the bodies into shared memory first): `queued_at` (`time.monotonic()`, same host) is when
        the caller handed the task over, and the persist delay runs from the first queued task's
        `queued_at`, as if it had been queued then. `more` says the same caller has handed over
        more tasks that are on their way: the batch then waits for them (at most the persist delay
        from now) rather than drain early without them."""
        self._admit(task, False, queued_at, more)

    def _admit(self, task: UploadTask, wait: bool, queued_at: Optional[float] = None, more: bool = False) -> None:
        if self._error is not None:
            task.fail(self._error)
            return
        if self._closed:
            task.fail(CancelledError("the upload scheduler is closed"))
            return
        try:
            if wait:
                self._throttle.acquire(task.size)
            else:
                self._throttle.take(task.size)
        except CancelledError as exc:
            task.fail(exc)
            if wait:
                raise
            return
        admitted = AdmittedTask(task, self._throttle)
        drain_now = False
        now = time.monotonic()
        delay_s = self.persist_delay_ms / 1000.0
        # when the task was queued: handed over (never earlier than the delay ago) or now
        queued = now if queued_at is None else min(now, max(float(queued_at), now - delay_s))
        with self._lock:
            if self._closed:
                closed = True
            else:
                closed = False
                self._first_queued = queued if not self._queue else min(self._first_queued, queued)
                self._queue.append(admitted)
                self._queued_bytes += admitted.size
                # the delay runs from the first queued task; later tasks do not extend it
                deadline = self._first_queued + delay_s
                if more:  # its successors are on their way: wait for them, but not past a delay from now
                    deadline = max(deadline, now + delay_s) if self._timer is None else self._deadline
                if self.persist_delay_ms == 0 or self._queued_bytes >= self.persist_size_threshold or deadline <= now:
                    drain_now = True
                    if self._timer is not None:
                        self._timer.cancel()
                        self._timer = None
                elif self._timer is None or deadline < self._deadline:
                    if self._timer is not None:  # a task handed over earlier brings the drain forward
                        self._timer.cancel()
                    self._deadline = deadline
                    self._timer = self._timers.schedule(deadline - now, self._drain)
        if closed:
            admitted.fail(CancelledError("the upload scheduler is closed"))
            if wait:
                raise CancelledError("the upload scheduler was closed while the upload was being scheduled")
            return
        if drain_now:
            self._drain()

    def flush(self) -> None:
        """Drain the queue now (tests, shutdown helpers, the service's `flush` call)."""
        with self._lock:
            if self._timer is not None:
                self._timer.cancel()
                self._timer = None
        self._drain()

    def cancel(self, predicate: Callable[[UploadTask], bool], exc: BaseException) -> int:
        """Fail with `exc` every queued task (as submitted) that `predicate` selects; returns how many.

        Tasks already handed to an attempt are not touched: they settle with their batch.
        """
        with self._lock:
            keep: List[AdmittedTask] = []
            gone: List[AdmittedTask] = []
            for t in self._queue:
                (gone if predicate(t.inner) else keep).append(t)
            if not gone:
                return 0
            self._queue = keep
            self._queued_bytes -= sum(t.size for t in gone)
            if not self._queue and self._timer is not None:
                self._timer.cancel()
                self._timer = None
        _fail_all(gone, exc)
        return len(gone)

    def _drain(self) -> None:
        with self._lock:
            tasks, self._queue = self._queue, []
            self._queued_bytes = 0
            if self._timer is not None:  # a no-op for the timer running this drain
                self._timer.cancel()
            self._timer = None
            error = self._error
        if not tasks:
            return
        if error is not None:
            _fail_all(tasks, error)
            return
        if self._group_key is None:
            self._hand_off(tasks)
            return
        groups: Dict[Hashable, List[AdmittedTask]] = {}
        for t in tasks:
            groups.setdefault(self._group_key(t.inner), []).append(t)
        for batch in groups.values():
            self._hand_off(batch)

    def _hand_off(self, tasks: List[AdmittedTask]) -> None:
        """One batch -> one action on the executor (one file)."""
        if self.metrics is not None:
            self.metrics.upload_batch_sizes.update(len(tasks))
        try:
            if self._make_action is None:
                action = _BatchUploadAction(self.uploader, tasks)
            else:
                action = self._make_action(tasks)
            self.executor.execute(self.retry_policy, action)
        except BaseException as exc:
            if not isinstance(exc, OSError):
                with self._lock:
                    if self._error is None:
                        self._error = exc
                log.error("upload hand-off failed; failing every later upload", exc_info=True)
            _fail_all(tasks, exc)

    # -- close ----------------------------------------------------------------------------------
    def close(self, reason: str = "the upload scheduler was closed before the upload started") -> None:
        """Fail queued and waiting uploads with CancelledError(`reason`), wait for running attempts,
        close the uploader (if any)."""
        with self._close_lock:
            if self._closed_done:
                return
            self._closed_done = True
        with self._lock:
            self._closed = True
            if self._timer is not None:
                self._timer.cancel()
                self._timer = None
            tasks, self._queue = self._queue, []
            self._queued_bytes = 0
        self._throttle.close()
        self._timers.shutdown()  # waits for a drain running on it (it hands its batch to the executor)
        _fail_all(tasks, CancelledError(reason))
        try:
            self.executor.close(wait=True)
        finally:
            if self.uploader is not None:
                self.uploader.close()

    def __repr__(self) -> str:
        return (f"BatchingStateChangeUploadScheduler(delay={self.persist_delay_ms} ms, "
                f"threshold={self.persist_size_threshold}, max_in_flight={self._throttle.max_in_flight}, "
                f"queued={len(self._queue)}, in_flight={self._throttle.in_flight})")


__all__ = ["StateChangeUploadScheduler", "BatchingStateChangeUploadScheduler", "DirectUploadScheduler",
           "AdmittedTask", "AvailabilityProvider"]
