"""Who still needs an uploaded file (docs/semantics.md §9, §10).

`TaskChangelogRegistry` counts, per file, the change sets nobody has confirmed or released yet and
deletes the file when that count reaches 0. `LocalChangelogRegistry` tracks local-recovery copies by
the last checkpoint that uses them.
"""
from __future__ import annotations

import logging
import threading
from concurrent.futures import Future, ThreadPoolExecutor
from typing import Callable, Dict, List, Optional, Set

from dstl.changelog.handles import StreamStateHandle

log = logging.getLogger(__name__)


def _discard(handle: StreamStateHandle) -> None:
    try:
        handle.discard_state()
    except Exception:  # deletion is best effort: the file is merely left behind
        log.warning("could not delete changelog file %s", handle.path, exc_info=True)


class _Discarder:
    """Deletes files on a small thread pool; after close, deletes on the calling thread."""

    def __init__(self, num_threads: int, name: str, discard: Callable[[StreamStateHandle], None]):
        if isinstance(num_threads, bool) or not isinstance(num_threads, int) or num_threads < 1:
            raise ValueError(f"discard_num_threads must be an int >= 1, got {num_threads!r}")
        self._pool = ThreadPoolExecutor(max_workers=num_threads, thread_name_prefix=name)
        self._discard = discard
        self._pending: Set[Future] = set()
        self._lock = threading.Lock()
        self._closed = False

    def submit(self, handle: StreamStateHandle) -> None:
        with self._lock:
            fut = None if self._closed else self._pool.submit(self._discard, handle)
            if fut is not None:
                self._pending.add(fut)
        if fut is None:
            self._discard(handle)  # a late release after close still cleans up
        else:
            fut.add_done_callback(self._done)  # may run inline: outside the lock

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
            self._closed = True
        self._pool.shutdown(wait=True)  # deletions already scheduled finish first


class TaskChangelogRegistry:
    """Thread-safe map handle id (path) -> number of change sets still unreleased."""

    def __init__(self, discard_num_threads: int = 1,
                 discard: Callable[[StreamStateHandle], None] = _discard):
        self._entries: Dict[str, int] = {}
        self._handles: Dict[str, StreamStateHandle] = {}
        self._lock = threading.Lock()
        self._discarder = _Discarder(discard_num_threads, "dstl-discard", discard)

    def start_tracking(self, handle: StreamStateHandle, ref_count: int) -> None:
        """Track `handle` with `ref_count` (> 0) change sets; replaces an existing entry."""
        if isinstance(ref_count, bool) or not isinstance(ref_count, int) or ref_count <= 0:
            raise ValueError(f"ref_count must be an int > 0, got {ref_count!r} for {handle!r}")
        with self._lock:
            self._entries[handle.handle_id] = ref_count
            self._handles[handle.handle_id] = handle

    def stop_tracking(self, handle: StreamStateHandle) -> None:
        """Forget `handle`: a checkpoint owns the file now and dstl never deletes it."""
        with self._lock:
            self._entries.pop(handle.handle_id, None)
            self._handles.pop(handle.handle_id, None)

    def release(self, handle: StreamStateHandle) -> None:
        """One change set of the file is no longer needed; the last release deletes the file."""
        with self._lock:
            count = self._entries.get(handle.handle_id)
            if count is None:
                log.warning("release of untracked changelog file %s ignored", handle.handle_id)
                return
            if count > 1:
                self._entries[handle.handle_id] = count - 1
                return
            del self._entries[handle.handle_id]
            tracked = self._handles.pop(handle.handle_id)
        self._discarder.submit(tracked)

    def ref_count(self, handle: StreamStateHandle) -> Optional[int]:
        """The current count, or None when the file is not tracked."""
        with self._lock:
            return self._entries.get(handle.handle_id)

    def tracked(self) -> Dict[str, int]:
        """A copy of the map path -> count."""
        with self._lock:
            return dict(self._entries)

    def wait_for_deletions(self, timeout: Optional[float] = None) -> bool:
        """Block until the deletions scheduled so far are done (tests, shutdown)."""
        return self._discarder.wait(timeout)

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

__all__ = ["TaskChangelogRegistry", "LocalChangelogRegistry"]
