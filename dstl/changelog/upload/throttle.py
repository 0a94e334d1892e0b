"""Back-pressure: in-flight byte accounting and the availability provider (docs/semantics.md §7.3)."""
from __future__ import annotations

import logging
import threading
from concurrent.futures import CancelledError, Future
from typing import Callable, List

log = logging.getLogger(__name__)


def _completed_future() -> Future:
    f: Future = Future()
    f.set_result(None)
    return f


class AvailabilityProvider:
    """`is_available()` and a `future` that is done while uploads are accepted without waiting.

    Listeners (`add_listener`) hear every change, e.g. the upload service pushing it to its clients.
    """

    def __init__(self) -> None:
        self._lock = threading.Lock()
        self._future = _completed_future()
        self._listeners: List[Callable[[bool], None]] = []
        self._notify_lock = threading.Lock()
        self._last_notified = True

    def is_available(self) -> bool:
        return self._future.done()

    @property
    def future(self) -> Future:
        """Done while available; otherwise completes when capacity returns."""
        with self._lock:
            return self._future

    def add_listener(self, listener: Callable[[bool], None]) -> None:
        """Call `listener(available)` after each change, outside the throttle's locks.

        Calls are serialised and the value is read when the call is made, so the last call a
        listener gets always carries the current state (two racing changes cannot arrive reversed).
        A listener must not block for long: the next change waits for it.
        """
        with self._notify_lock:
            self._listeners.append(listener)

    def remove_listener(self, listener: Callable[[bool], None]) -> None:
        with self._notify_lock:
            self._listeners.remove(listener)

    def _notify(self) -> None:
        """Tell the listeners the state now, unless they heard it last; never under the throttle's lock."""
        if not self._listeners:
            return
        with self._notify_lock:
            available = self.is_available()
            if available == self._last_notified:
                return
            self._last_notified = available
            for listener in list(self._listeners):
                try:
                    listener(available)
                except Exception:  # one listener must not keep the others (or the throttle) from going on
                    log.exception("availability listener %r failed", listener)

    def _set_unavailable(self) -> None:
        with self._lock:
            if self._future.done():
                self._future = Future()

    def _swap_available(self) -> Future | None:
        """Mark available now; return the pending future for the caller to complete outside locks."""
        with self._lock:
            f = self._future
            if f.done():
                return None
            self._future = _completed_future()
            return f

    def __repr__(self) -> str:
        return f"AvailabilityProvider(available={self.is_available()})"


AvailabilityProvider.ALWAYS = AvailabilityProvider()  # type: ignore[attr-defined]


class UploadThrottle:
    """Counts bytes accepted and not yet finished; callers wait while the limit is reached.

    One task may overshoot the limit; only later callers wait (Flink's semantics). `take` is the
    non-blocking admission for a host whose callers wait elsewhere (the upload service: its clients
    wait on the availability it pushes to them).
    """

    def __init__(self, max_in_flight: int):
        if max_in_flight < 1:
            raise ValueError(f"max in-flight bytes must be >= 1, got {max_in_flight}")
        self.max_in_flight = int(max_in_flight)
        self._cond = threading.Condition(threading.Lock())
        self._in_flight = 0
        self._closed = False
        self._waiting = 0
        self.availability = AvailabilityProvider()

    @property
    def in_flight(self) -> int:
        return self._in_flight

    @property
    def waiting(self) -> int:
        """Callers currently blocked on back-pressure."""
        return self._waiting

    def acquire(self, size: int, timeout: float | None = None) -> None:
        """Wait while no capacity is left, then take `size` bytes. Raises CancelledError once closed."""
        with self._cond:
            self._waiting += 1
            try:
                while self._in_flight >= self.max_in_flight and not self._closed:
                    self._cond.wait(timeout)
            finally:
                self._waiting -= 1
            if self._closed:
                raise CancelledError("the upload scheduler was closed while waiting for capacity")
            changed = self._add(size)
        if changed:
            self.availability._notify()

    def take(self, size: int) -> None:
        """Take `size` bytes now, even past the limit: never waits. Raises CancelledError once closed.

        For callers that waited for availability themselves; like `acquire`, a task admitted while
        capacity was left may overshoot, and the availability turns false for later callers.
        """
        with self._cond:
            if self._closed:
                raise CancelledError("the upload scheduler is closed")
            changed = self._add(size)
        if changed:
            self.availability._notify()

    def _add(self, size: int) -> bool:
        """Under the condition's lock: count `size` bytes; True if that used up the capacity."""
        was_available = self._in_flight < self.max_in_flight
        self._in_flight += size
        if self._in_flight >= self.max_in_flight:
            self.availability._set_unavailable()
            return was_available
        return False

    def release(self, size: int) -> None:
        """Give back `size` bytes; wake waiters; complete the availability future on regaining capacity."""
        pending = None
        with self._cond:
            had_none = self._in_flight >= self.max_in_flight
            self._in_flight -= size
            if had_none and self._in_flight < self.max_in_flight:
                pending = self.availability._swap_available()
            self._cond.notify_all()
        if pending is not None:
            pending.set_result(None)  # runs waiting callbacks, so never under a lock
            self.availability._notify()

    def close(self) -> None:
        """Fail every waiting and later `acquire` with CancelledError."""
        with self._cond:
            self._closed = True
            self._cond.notify_all()


__all__ = ["AvailabilityProvider", "UploadThrottle"]
