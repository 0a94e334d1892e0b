"""Who still needs an uploaded file (docs/semantics.md §9, §10).

`TaskChangelogRegistry` counts, per file, the change sets nobody has confirmed or released yet and
deletes the file when that count reaches 0. `LocalChangelogRegistry` tracks local-recovery copies by
the last checkpoint that uses them.
"""
from __future__ import annotations

import logging
import threading
from concurrent.futures import Future, ThreadPoolExecutor
from typing import Callable, Dict, List, Optional, Sequence, Set

from dstl.changelog.handles import StreamStateHandle

log = logging.getLogger(__name__)


def _discard(handle: StreamStateHandle) -> None:
    handle.discard_state()  # a file that is already gone is fine; other errors are retried


# Delays before the retries of a failed deletion (then the file is left for `dstl gc`).
DELETE_RETRY_DELAYS_S = (0.1, 0.4, 1.6, 6.4)


class _Discarder:
    """Deletes files on a small thread pool, retrying failures with backoff; after close, deletes on
    the calling thread. `failures` counts failed deletion attempts (metric `numberOfDeleteFailures`)."""

    def __init__(self, num_threads: int, name: str, discard: Callable[[StreamStateHandle], None],
                 retry_delays_s: Optional[Sequence[float]] = None):
        if isinstance(num_threads, bool) or not isinstance(num_threads, int) or num_threads < 1:
            raise ValueError(f"discard_num_threads must be an int >= 1, got {num_threads!r}")
        self._pool = ThreadPoolExecutor(max_workers=num_threads, thread_name_prefix=name)
        self._discard = discard
        self._delays = tuple(DELETE_RETRY_DELAYS_S if retry_delays_s is None else retry_delays_s)
        self._pending: Set[Future] = set()
        self._lock = threading.Lock()
        self._closed = False
        self.failures = 0

    def submit(self, handle: StreamStateHandle) -> None:
        done: Future = Future()  # completes when the file is gone or the retries are used up
        with self._lock:
            self._pending.add(done)
        done.add_done_callback(self._done)
        self._attempt(handle, done, 0)

    def _attempt(self, handle: StreamStateHandle, done: Future, n: int) -> None:
        with self._lock:
            fut = None if self._closed else self._pool.submit(self._try, handle, done, n)
        if fut is None:
            self._try(handle, done, n)  # a late release after close still cleans up

    def _try(self, handle: StreamStateHandle, done: Future, n: int) -> None:
        try:
            self._discard(handle)
        except Exception as exc:
            with self._lock:
                self.failures += 1
                closed = self._closed
            if n < len(self._delays) and not closed:
                log.warning("could not delete changelog file %s (%s); retrying in %.1f s", handle.path, exc,
                            self._delays[n])
                t = threading.Timer(self._delays[n], self._attempt, (handle, done, n + 1))
                t.daemon = True
                t.start()
                return
            log.warning("could not delete changelog file %s after %d attempts; left for `dstl gc`",
                        handle.path, n + 1, exc_info=True)
        done.set_result(None)

    def _done(self, fut: Future) -> None:
        with self._lock:
            self._pending.discard(fut)

    def wait(self, timeout: Optional[float] = None) -> bool:
        """Wait for the deletions scheduled so far; False on timeout."""
        from concurrent.futures import wait as wait_all

        with self._lock:
            pending = list(self._pending)
        done, not_done = wait_all(pending, timeout=timeout)
        return not not_done

    def close(self) -> None:
        with self._lock:
            if self._closed:
                return
        self.wait(sum(self._delays) + 5.0)  # deletions scheduled (and their retries) finish first
        with self._lock:
            self._closed = True
        self._pool.shutdown(wait=True)


class RefCounts:
    """The reference-counting core of both upload modes: per file, the change sets nobody has
    confirmed or released yet, split by owner (the clients of an upload service; thread mode has one
    anonymous owner), plus orphans: shares of owners that went away without releasing them.

    Not thread-safe (its users lock). Methods return whether a file became deletable; the caller
    deletes it. `TaskChangelogRegistry` (thread mode) and the service's journaled `RegistryState`
    (process mode) both keep their counts here.
    """

    def __init__(self) -> None:
        self.entries: Dict[str, list] = {}  # path -> [count, {owner: outstanding}]
        self.orphans: Dict[str, List[int]] = {}  # path -> [since wall-clock ms, outstanding]

    def start(self, path: str, count: int, owners: Optional[Dict[str, int]] = None) -> None:
        """Track `path` with `count` change sets (replaces an existing entry)."""
        self.entries[path] = [int(count), {str(o): int(k) for o, k in (owners or {}).items()}]
        self.orphans.pop(path, None)

    def stop(self, path: str) -> None:
        """Forget `path`: a checkpoint owns it now and it is never deleted by us."""
        self.entries.pop(path, None)
        self.orphans.pop(path, None)

    def release(self, path: str, owner: Optional[str] = None, times: int = 1) -> bool:
        """`times` change sets of `path` are no longer needed; True when its count reached 0."""
        entry = self.entries.get(path)
        if entry is None:
            log.warning("release of untracked changelog file %s ignored", path)
            return False
        shares = entry[1]
        if owner is not None and shares.get(owner):
            left = shares[owner] - times
            if left > 0:
                shares[owner] = left
            else:
                del shares[owner]
        entry[0] -= times
        if entry[0] > 0:
            return False
        del self.entries[path]
        self.orphans.pop(path, None)
        return True

    def drop_owner(self, owner: Optional[str], since_ms: int) -> None:
        """`owner` (None: every owner) went away: its shares become orphans since `since_ms`. They are
        not released: a checkpoint written elsewhere may already reference the files."""
        for path, (_, shares) in list(self.entries.items()):
            outstanding = sum(shares.values()) if owner is None else shares.get(owner, 0)
            if not outstanding:
                continue
            if owner is None:
                shares.clear()
            else:
                del shares[owner]
            self.orphans.setdefault(path, [since_ms, 0])[1] += outstanding

    def adopt_orphan(self, path: str, since_ms: int) -> None:
        """A file nobody tracks but someone may have written (an attempt of a dead service)."""
        self.entries.setdefault(path, [1, {}])
        self.orphans.setdefault(path, [since_ms, 1])

    def resolve_orphan(self, path: str, keep: bool) -> bool:
        """Settle an orphan: `keep` (a checkpoint references it) untracks it like `stop`; otherwise
        its outstanding change sets are released. True when the file became deletable."""
        orphan = self.orphans.pop(path, None)
        if orphan is None or path not in self.entries:
            return False
        if keep:
            del self.entries[path]
            return False
        return self.release(path, None, orphan[1])

    def expired_orphans(self, now_ms: int, grace_ms: int) -> List[str]:
        return sorted(p for p, (since, _) in self.orphans.items() if since + grace_ms <= now_ms)

    def ref_count(self, path: str) -> Optional[int]:
        entry = self.entries.get(path)
        return None if entry is None else entry[0]


class TaskChangelogRegistry:
    """Thread-safe map handle id (path) -> number of change sets still unreleased."""

    def __init__(self, discard_num_threads: int = 1,
                 discard: Callable[[StreamStateHandle], None] = _discard):
        self._counts = RefCounts()
        self._handles: Dict[str, StreamStateHandle] = {}
        self._lock = threading.Lock()
        self._discarder = _Discarder(discard_num_threads, "dstl-discard", discard)

    def start_tracking(self, handle: StreamStateHandle, ref_count: int) -> None:
        """Track `handle` with `ref_count` (> 0) change sets; replaces an existing entry."""
        if isinstance(ref_count, bool) or not isinstance(ref_count, int) or ref_count <= 0:
            raise ValueError(f"ref_count must be an int > 0, got {ref_count!r} for {handle!r}")
        with self._lock:
            self._counts.start(handle.handle_id, ref_count)
            self._handles[handle.handle_id] = handle

    def stop_tracking(self, handle: StreamStateHandle) -> None:
        """Forget `handle`: a checkpoint owns the file now and dstl never deletes it."""
        with self._lock:
            self._counts.stop(handle.handle_id)
            self._handles.pop(handle.handle_id, None)

    def release(self, handle: StreamStateHandle) -> None:
        """One change set of the file is no longer needed; the last release deletes the file."""
        with self._lock:
            if not self._counts.release(handle.handle_id):
                return
            tracked = self._handles.pop(handle.handle_id)
        self._discarder.submit(tracked)

    def ref_count(self, handle: StreamStateHandle) -> Optional[int]:
        """The current count, or None when the file is not tracked."""
        with self._lock:
            return self._counts.ref_count(handle.handle_id)

    def tracked(self) -> Dict[str, int]:
        """A copy of the map path -> count."""
        with self._lock:
            return {p: e[0] for p, e in self._counts.entries.items()}

    def wait_for_deletions(self, timeout: Optional[float] = None) -> bool:
        """Block until the deletions scheduled so far are done (tests, shutdown)."""
        return self._discarder.wait(timeout)

    @property
    def delete_failures(self) -> int:
        """Failed deletion attempts so far (each retried with backoff; metric numberOfDeleteFailures)."""
        return self._discarder.failures

    def close(self) -> None:
        """Finish the scheduled deletions and stop the pool; later deletions run inline."""
        self._discarder.close()

    def __enter__(self) -> "TaskChangelogRegistry":
        return self

    def __exit__(self, *exc) -> None:
        self.close()


class LocalChangelogRegistry:
    """Local-recovery copies: handle -> last checkpoint using it (docs/semantics.md §10)."""

    NO_OP: "LocalChangelogRegistry"

    def __init__(self, discard_num_threads: int = 1, *, enabled: bool = True,
                 discard: Callable[[StreamStateHandle], None] = _discard):
        self._enabled = enabled
        self._entries: Dict[str, int] = {}
        self._handles: Dict[str, StreamStateHandle] = {}
        self._lock = threading.Lock()
        self._discarder = _Discarder(discard_num_threads, "dstl-local-discard", discard) if enabled else None

    @property
    def enabled(self) -> bool:
        return self._enabled

    def register(self, handle: StreamStateHandle, checkpoint_id: int) -> None:
        """Insert `handle`, or raise its checkpoint to `max(old, checkpoint_id)`."""
        if not self._enabled:
            return
        with self._lock:
            old = self._entries.get(handle.handle_id)
            self._entries[handle.handle_id] = checkpoint_id if old is None else max(old, checkpoint_id)
            self._handles[handle.handle_id] = handle

    def discard_up_to_checkpoint(self, checkpoint_id: int) -> None:
        """Delete (asynchronously) every local file whose last checkpoint is < `checkpoint_id`."""
        if not self._enabled:
            return
        doomed: List[StreamStateHandle] = []
        with self._lock:
            for hid in [h for h, cp in self._entries.items() if cp < checkpoint_id]:
                del self._entries[hid]
                doomed.append(self._handles.pop(hid))
        for handle in doomed:
            self._discarder.submit(handle)

    def checkpoint_of(self, handle: StreamStateHandle) -> Optional[int]:
        with self._lock:
            return self._entries.get(handle.handle_id)

    def wait_for_deletions(self, timeout: Optional[float] = None) -> bool:
        return True if self._discarder is None else self._discarder.wait(timeout)

    def close(self) -> None:
        if self._discarder is not None and self is not LocalChangelogRegistry.NO_OP:
            self._discarder.close()

    def __repr__(self) -> str:
        return "LocalChangelogRegistry.NO_OP" if not self._enabled else f"LocalChangelogRegistry({len(self._entries)})"


LocalChangelogRegistry.NO_OP = LocalChangelogRegistry(enabled=False)

__all__ = ["RefCounts", "TaskChangelogRegistry", "LocalChangelogRegistry"]
