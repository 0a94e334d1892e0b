"""Back-pressure: in-flight byte accounting and the availability provider (docs/semantics.md §7.3)."""
from __future__ import annotations

import threading
from concurrent.futures import CancelledError, Future


def _completed_future() -> Future:
    f: Future = Future()
    f.set_result(None)
    return f


class AvailabilityProvider:
    """`is_available()` and a `future` that is done while uploads are accepted without waiting."""

    def __init__(self) -> None:
        self._lock = threading.Lock()
        self._future = _completed_future()

    def is_available(self) -> bool:
        return self._future.done()

    @property
    def future(self) -> Future:
        """Done while available; otherwise completes when capacity returns."""
        with self._lock:
            return self._future

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

    One task may overshoot the limit; only later callers wait (Flink's semantics).
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
            self._in_flight += size
            if self._in_flight >= self.max_in_flight:
                self.availability._set_unavailable()

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

    def close(self) -> None:
        """Fail every waiting and later `acquire` with CancelledError."""
        with self._cond:
            self._closed = True
            self._cond.notify_all()


__all__ = ["AvailabilityProvider", "UploadThrottle"]
