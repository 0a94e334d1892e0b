"""Upload schedulers: direct (synchronous) and batching with retries and back-pressure (docs/semantics.md §7)."""
from __future__ import annotations

import abc
import logging
import threading
from concurrent.futures import CancelledError
from typing import List, Optional

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


class BatchingStateChangeUploadScheduler(StateChangeUploadScheduler):
    """Collects tasks of all writers for `persist_delay_ms` (or `persist_size_threshold` bytes) into one file.

    Back-pressure: `upload` waits while `max_in_flight` bytes are accepted and unfinished.
    """

    def __init__(self, persist_delay_ms: int, persist_size_threshold: int, max_in_flight: int,
                 retry_policy, uploader, executor, metrics=None):
        if persist_size_threshold > max_in_flight:
            raise ValueError(
                f"persist-size-threshold ({persist_size_threshold}) must not exceed "
                f"upload.max-in-flight ({max_in_flight})")
        if persist_delay_ms < 0:
            raise ValueError(f"persist-delay must be >= 0 ms, got {persist_delay_ms}")
        self.persist_delay_ms = int(persist_delay_ms)
        self.persist_size_threshold = int(persist_size_threshold)
        self.retry_policy = retry_policy
        self.uploader = uploader
        self.executor = executor
        self.metrics = metrics
        self._throttle = UploadThrottle(max_in_flight)
        self._lock = threading.Lock()
        self._queue: List[UploadTask] = []
        self._queued_bytes = 0
        self._timer: Optional[threading.Timer] = None
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
    def waiting_callers(self) -> int:
        """Callers blocked on back-pressure right now (for tests and diagnostics)."""
        return self._throttle.waiting

    @property
    def sticky_error(self) -> Optional[BaseException]:
        return self._error

    # -- upload ---------------------------------------------------------------------------------
    def upload(self, task: UploadTask) -> None:
        if self._error is not None:
            task.fail(self._error)
            return
        if self._closed:
            task.fail(CancelledError("the upload scheduler is closed"))
            return
        try:
            self._throttle.acquire(task.size)
        except CancelledError as exc:
            task.fail(exc)
            raise
        size = task.size
        released = threading.Event()

        def release() -> None:
            # capacity goes back before the writer's callback runs (docs/semantics.md §2.4)
            if not released.is_set():
                released.set()
                self._throttle.release(size)

        def on_complete(results) -> None:
            release()
            task.complete(results)

        def on_failed(_sqns, exc) -> None:
            release()
            task.fail(exc)

        wrapped = UploadTask(task.change_sets, on_complete, on_failed)
        drain_now = False
        with self._lock:
            if self._closed:
                closed = True
            else:
                closed = False
                self._queue.append(wrapped)
                self._queued_bytes += size
                if self.persist_delay_ms == 0 or self._queued_bytes >= self.persist_size_threshold:
                    drain_now = True
                    if self._timer is not None:
                        self._timer.cancel()
                        self._timer = None
                elif self._timer is None:
                    # the delay runs from the first queued task; later tasks do not extend it
                    self._timer = threading.Timer(self.persist_delay_ms / 1000.0, self._drain)
                    self._timer.daemon = True
                    self._timer.start()
        if closed:
            wrapped.fail(CancelledError("the upload scheduler is closed"))
            raise CancelledError("the upload scheduler was closed while the upload was being scheduled")
        if drain_now:
            self._drain()

    def flush(self) -> None:
        """Drain the queue now (tests, shutdown helpers)."""
        with self._lock:
            if self._timer is not None:
                self._timer.cancel()
                self._timer = None
        self._drain()

    def _drain(self) -> None:
        with self._lock:
            tasks, self._queue = self._queue, []
            self._queued_bytes = 0
            if self._timer is not None and self._timer is not threading.current_thread():
                self._timer.cancel()
            self._timer = None
            error = self._error
        if not tasks:
            return
        if error is not None:
            _fail_all(tasks, error)
            return
        if self.metrics is not None:
            self.metrics.upload_batch_sizes.update(len(tasks))
        try:
            self.executor.execute(self.retry_policy, _BatchUploadAction(self.uploader, tasks))
        except BaseException as exc:
            if not isinstance(exc, OSError):
                self._error = exc
                log.error("upload hand-off failed; failing every later upload", exc_info=True)
            _fail_all(tasks, exc)

    # -- close ----------------------------------------------------------------------------------
    def close(self) -> None:
        """Fail queued and waiting uploads with CancelledError, wait for running attempts, close the uploader."""
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
        _fail_all(tasks, CancelledError("the upload scheduler was closed before the upload started"))
        try:
            self.executor.close(wait=True)
        finally:
            self.uploader.close()

    def __repr__(self) -> str:
        return (f"BatchingStateChangeUploadScheduler(delay={self.persist_delay_ms} ms, "
                f"threshold={self.persist_size_threshold}, max_in_flight={self._throttle.max_in_flight}, "
                f"queued={len(self._queue)}, in_flight={self._throttle.in_flight})")


__all__ = ["StateChangeUploadScheduler", "BatchingStateChangeUploadScheduler", "DirectUploadScheduler",
           "AvailabilityProvider"]
