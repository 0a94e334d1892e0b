"""One daemon thread running delayed callbacks (attempt timeouts, delayed retries, cache expiry).

A `threading.Timer` per call would cost one thread per pending timeout; this keeps a heap instead.
Callbacks run on the timer thread, so they must be short and must not block.
"""
from __future__ import annotations

import heapq
import itertools
import logging
import threading
import time
from typing import Callable, List, Optional

log = logging.getLogger(__name__)


class TimerHandle:
    """A scheduled callback; `cancel()` stops it if it has not started yet."""

    __slots__ = ("when", "fn", "cancelled", "on_cancel")

    def __init__(self, when: float, fn: Callable[[], None], on_cancel: Optional[Callable[[], None]]):
        self.when = when
        self.fn = fn
        self.cancelled = False
        self.on_cancel = on_cancel

    def cancel(self) -> bool:
        """True if this call cancelled it (it had neither run nor been cancelled)."""
        return self._cancel() is not False

    def _cancel(self):
        """Cancel; the `on_cancel` callback (or None), or False if it ran or was cancelled already.

        The callbacks are dropped at once: a cancelled timer stays in the heap until its deadline, and
        must not keep what they reference alive that long (an attempt timeout's upload, with its bodies)."""
        if self.cancelled or self.fn is None:
            return False
        self.cancelled = True
        on_cancel = self.on_cancel
        self.fn = self.on_cancel = None
        return on_cancel


class TimerThread:
    """Runs `fn` after `delay` seconds on one shared daemon thread (started lazily)."""

    def __init__(self, name: str = "dstl-timer"):
        self._name = name
        self._cond = threading.Condition()
        self._heap: List[tuple] = []
        self._seq = itertools.count()
        self._thread: Optional[threading.Thread] = None
        self._stopped = False

    def schedule(self, delay: float, fn: Callable[[], None],
                 on_cancel: Optional[Callable[[], None]] = None) -> TimerHandle:
        """Run `fn` after `delay` s; `on_cancel` runs instead if the timer is shut down first."""
        handle = TimerHandle(time.monotonic() + max(0.0, delay), fn, on_cancel)
        with self._cond:
            if self._stopped:
                raise RuntimeError(f"timer {self._name} is shut down")
            heapq.heappush(self._heap, (handle.when, next(self._seq), handle))
            if self._thread is None:
                self._thread = threading.Thread(target=self._loop, name=self._name, daemon=True)
                self._thread.start()
            self._cond.notify()
        return handle

    def _loop(self) -> None:
        while True:
            with self._cond:
                while True:
                    if self._stopped:
                        return
                    if self._heap:
                        when, _, handle = self._heap[0]
                        wait = when - time.monotonic()
                        if wait <= 0:
                            heapq.heappop(self._heap)
                            break
                        self._cond.wait(wait)
                    else:
                        self._cond.wait()
                if handle.cancelled:
                    continue
                fn, handle.fn = handle.fn, None
            try:
                fn()
            except BaseException:  # a failing callback must not kill the timer thread
                log.exception("timer callback failed")

    def is_timer_thread(self) -> bool:
        """True when called from a callback running on this timer's thread."""
        return self._thread is not None and self._thread is threading.current_thread()

    def cancel_pending(self, predicate: Callable[[TimerHandle], bool]) -> int:
        """Cancel pending timers matching `predicate`, running their `on_cancel` here; returns how many."""
        with self._cond:  # under the lock, so a timer cannot both run and be cancelled
            chosen = [h._cancel() for _, _, h in self._heap if not h.cancelled and predicate(h)]
        chosen = [c for c in chosen if c is not False]
        _run_cancelled(chosen)
        return len(chosen)

    def shutdown(self, wait: bool = True) -> None:
        """Stop the thread; pending timers are dropped after their `on_cancel` runs (on this thread)."""
        with self._cond:
            if self._stopped:
                return
            self._stopped = True
            pending = [h._cancel() for _, _, h in self._heap]
            self._heap.clear()
            self._cond.notify_all()
            thread = self._thread
        _run_cancelled(pending)
        if wait and thread is not None and thread is not threading.current_thread():
            thread.join()


def _run_cancelled(callbacks) -> None:
    for on_cancel in callbacks:
        if on_cancel:  # None: no on_cancel; False: it had run or was cancelled already
            try:
                on_cancel()
            except BaseException:
                log.exception("timer cancel callback failed")
