"""Retries of upload attempts (docs/semantics.md §8): Flink's `RetryPolicy` and `RetryingExecutor`.

A slow attempt gets a speculative parallel successor when its timeout fires; the first attempt to
succeed wins and every other result is handed back through `discard_result`. An `OSError` retries
after a delay; anything else fails the action at once.
"""
from __future__ import annotations

import logging
import threading
from concurrent.futures import CancelledError, Future, ThreadPoolExecutor
from typing import Generic, Optional, Protocol, Set, TypeVar

from dstl._timer import TimerHandle, TimerThread
from dstl.metrics import Histogram

log = logging.getLogger(__name__)

T = TypeVar("T")
NEVER = -1


class AttemptTimeoutError(TimeoutError):
    """An attempt ran longer than the policy's timeout (its successor may already be running)."""


class RetryPolicy:
    """When to start another attempt. Use `RetryPolicy.fixed(...)`, `RetryPolicy.none()` or
    `RetryPolicy.from_config(config)`."""

    @property
    def timeout_ms(self) -> int:
        """Attempt timeout in ms; <= 0 means none."""
        return 0

    def retry_after(self, attempt: int, exc: BaseException) -> int:
        """Delay in ms before attempt `attempt + 1`, or -1 for no further attempt."""
        return NEVER

    @staticmethod
    def fixed(max_attempts: int, timeout_ms: int, delay_ms: int) -> "FixedRetryPolicy":
        return FixedRetryPolicy(max_attempts, timeout_ms, delay_ms)

    @staticmethod
    def none() -> "RetryPolicy":
        return NONE

    @staticmethod
    def from_config(config) -> "RetryPolicy":
        """From a `StorageConfig` (or a mapping of option keys)."""
        from dstl.config import StorageConfig

        cfg = StorageConfig.of(config)
        if cfg.retry_policy == "none":
            return NONE
        return FixedRetryPolicy(cfg.max_attempts, cfg.upload_timeout_ms, cfg.next_attempt_delay_ms)

    def __repr__(self) -> str:
        return "RetryPolicy.none()"


NONE = RetryPolicy()


class FixedRetryPolicy(RetryPolicy):
    """Up to `max_attempts` attempts (the first included); speculative on timeout, delayed on OSError."""

    def __init__(self, max_attempts: int, timeout_ms: int, delay_ms: int):
        for name, value, lo in (("max_attempts", max_attempts, 1), ("timeout_ms", timeout_ms, None),
                                ("delay_ms", delay_ms, 0)):
            if isinstance(value, bool) or not isinstance(value, int) or (lo is not None and value < lo):
                raise ValueError(f"retry policy {name} must be an int" + (f" >= {lo}" if lo is not None else "")
                                 + f", got {value!r}")
        self.max_attempts = max_attempts
        self._timeout_ms = timeout_ms
        self.delay_ms = delay_ms

    @property
    def timeout_ms(self) -> int:
        return self._timeout_ms

    def retry_after(self, attempt: int, exc: BaseException) -> int:
        if attempt >= self.max_attempts:
            return NEVER
        if isinstance(exc, TimeoutError):  # before OSError: TimeoutError is an OSError in Python
            return 0
        if isinstance(exc, OSError):
            return self.delay_ms
        return NEVER

    def __repr__(self) -> str:
        return f"RetryPolicy.fixed(max_attempts={self.max_attempts}, timeout_ms={self._timeout_ms}, " \
               f"delay_ms={self.delay_ms})"


class RetriableAction(Protocol[T]):
    """What the executor runs: `try_execute` may run several times, even concurrently.

    An action may also define `prepare_attempt()`: called on the attempt's thread right before the
    attempt's timeout starts (acquiring what the attempt runs on); raising fails that attempt.
    """

    def try_execute(self) -> T: ...

    def complete_with_result(self, result: T) -> None: ...

    def discard_result(self, result: T) -> None: ...

    def handle_failure(self, exc: BaseException) -> None: ...


class _ActionState(Generic[T]):
    __slots__ = ("policy", "action", "lock", "done", "active", "total", "finished")

    def __init__(self, policy: RetryPolicy, action: RetriableAction):
        self.policy = policy
        self.action = action
        self.lock = threading.Lock()
        self.done = False
        self.active = 1
        self.total = 1
        self.finished: Set[int] = set()


def _call_quietly(what: str, fn, arg) -> None:
    try:
        fn(arg)
    except Exception:  # callbacks belong to the caller; the executor must keep going
        log.exception("RetryingExecutor: %s raised", what)


class RetryingExecutor:
    """Runs actions with retries on `num_threads` worker threads; `execute` never blocks."""

    def __init__(self, num_threads: int = 5, attempts_per_upload: Optional[Histogram] = None,
                 total_attempts_per_upload: Optional[Histogram] = None):
        if isinstance(num_threads, bool) or not isinstance(num_threads, int) or num_threads < 1:
            raise ValueError(f"num_threads must be an int >= 1, got {num_threads!r}")
        self._pool = ThreadPoolExecutor(max_workers=num_threads, thread_name_prefix="dstl-upload")
        self._timer = TimerThread("dstl-retry-timer")
        self._attempts_per_upload = attempts_per_upload
        self._total_attempts_per_upload = total_attempts_per_upload
        self._lock = threading.Lock()
        self._closed = False
        self._close_done = threading.Event()
        self._running: Set[Future] = set()
        self._local = threading.local()  # marks this executor's worker and timer callbacks

    @property
    def closed(self) -> bool:
        return self._closed

    def execute(self, policy: RetryPolicy, action: RetriableAction) -> None:
        """Start the first attempt of `action`; raises RuntimeError once the executor is closed."""
        if self._closed:
            raise RuntimeError("RetryingExecutor is closed")
        state = _ActionState(policy, action)
        self._submit(state, 1)

    # --- attempts ------------------------------------------------------------------------------
    def _submit(self, state: _ActionState, n: int) -> None:
        with self._lock:
            fut = None if self._closed else self._pool.submit(self._run_attempt, state, n)
            if fut is not None:
                self._running.add(fut)
        if fut is not None:
            fut.add_done_callback(self._forget)  # may run inline: outside the lock
            return
        self._handle_error(state, n, CancelledError("RetryingExecutor closed before attempt %d started" % n))

    def _forget(self, fut: Future) -> None:
        with self._lock:
            self._running.discard(fut)

    def _run_attempt(self, state: _ActionState, n: int) -> None:
        self._local.inside = True
        try:
            self._run_attempt_inner(state, n)
        finally:
            self._local.inside = False

    def _run_attempt_inner(self, state: _ActionState, n: int) -> None:
        if state.done:
            return
        if self._closed:  # queued behind busy workers when close() came: never started
            self._handle_error(state, n, CancelledError(f"RetryingExecutor closed before attempt {n} started"))
            return
        prepare = getattr(state.action, "prepare_attempt", None)
        if prepare is not None:
            # e.g. the upload service taking a healthy uploader process: not part of the attempt's time
            try:
                prepare()
            except BaseException as exc:  # noqa: B902 - every outcome must settle the action
                self._handle_error(state, n, exc)
                return
        timer: Optional[TimerHandle] = None
        timeout_ms = state.policy.timeout_ms
        if timeout_ms > 0:
            try:
                timer = self._timer.schedule(timeout_ms / 1000.0, lambda: self._handle_error(
                    state, n, AttemptTimeoutError(f"upload attempt {n} timed out after {timeout_ms} ms")))
            except RuntimeError:  # timer already shut down (executor closing): run without timeout
                timer = None
        try:
            result = state.action.try_execute()
        except BaseException as exc:  # noqa: B902 - every outcome must settle the action
            self._handle_error(state, n, exc)
        else:
            with state.lock:
                won = not state.done
                if won:
                    state.done = True
                    state.finished.add(n)
                    total = state.total
            if won:
                if self._attempts_per_upload is not None:
                    self._attempts_per_upload.update(n)
                if self._total_attempts_per_upload is not None:
                    self._total_attempts_per_upload.update(total)
                _call_quietly("complete_with_result", state.action.complete_with_result, result)
            else:
                _call_quietly("discard_result", state.action.discard_result, result)
        finally:
            if timer is not None:
                timer.cancel()

    def _handle_error(self, state: _ActionState, n: int, exc: BaseException) -> None:
        start_next = False
        delay = NEVER
        with state.lock:
            if n in state.finished or state.done:
                return
            state.finished.add(n)
            if not self._closed and not isinstance(exc, CancelledError):
                try:
                    delay = state.policy.retry_after(n, exc)
                except Exception:
                    log.exception("retry policy failed; not retrying")
                    delay = NEVER
            if delay >= 0:
                state.active += 1
                state.total += 1
                start_next = True
            state.active -= 1
            failed = state.active == 0 and not state.done
            if failed:
                state.done = True
        if start_next:
            if delay == 0:
                self._submit(state, n + 1)
            else:
                self._schedule_retry(state, n + 1, delay)
        if failed:
            _call_quietly("handle_failure", state.action.handle_failure, exc)

    def _schedule_retry(self, state: _ActionState, n: int, delay_ms: int) -> None:
        def cancelled() -> None:
            self._handle_error(state, n, CancelledError(f"RetryingExecutor closed while attempt {n} "
                                                        f"waited for its retry delay"))
        try:
            self._timer.schedule(delay_ms / 1000.0, lambda: self._submit(state, n), on_cancel=cancelled)
        except RuntimeError:  # closed meanwhile
            cancelled()

    # --- shutdown ------------------------------------------------------------------------------
    def close(self, wait: bool = True) -> None:
        """No new attempts; delayed retries fail with CancelledError; running attempts finish.

        With `wait`, returns once every running attempt and its outcome handling is done.
        """
        if wait and (getattr(self._local, "inside", False) or self._timer.is_timer_thread()):
            wait = False  # called from one of our own callbacks: waiting would wait for itself
        with self._lock:
            first = not self._closed
            self._closed = True
        if first:
            # Delayed retries are cancelled now; attempt timeouts keep firing until the pool drains.
            threading.Thread(target=self._finish_close, name="dstl-retry-close", daemon=True).start() \
                if not wait else self._finish_close()
        if wait:
            self._close_done.wait()

    def _finish_close(self) -> None:
        try:
            self._cancel_delayed()
            self._pool.shutdown(wait=True)
        finally:
            self._timer.shutdown(wait=True)
            self._close_done.set()

    def _cancel_delayed(self) -> None:
        # Only delayed retries carry on_cancel; fail them now rather than after their delay.
        self._timer.cancel_pending(lambda h: h.on_cancel is not None)

    def __enter__(self) -> "RetryingExecutor":
        return self

    def __exit__(self, *exc) -> None:
        self.close()


__all__ = ["RetryPolicy", "FixedRetryPolicy", "RetriableAction", "RetryingExecutor", "AttemptTimeoutError"]
