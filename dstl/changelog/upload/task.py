"""Upload tasks and their results (docs/semantics.md §1, §7.1)."""
from __future__ import annotations

import logging
import threading
from typing import Callable, List, Optional, Sequence, Tuple

from dstl.types import SealedChangeSet, SequenceNumber

log = logging.getLogger(__name__)


class UploadResult:
    """Where one change set landed: `(remote handle, local handle or None, offset, local_offset, sqn, size)`."""

    __slots__ = ("stream_handle", "local_stream_handle", "offset", "local_offset", "sequence_number", "size")

    def __init__(self, stream_handle, local_stream_handle, offset: int, local_offset: int,
                 sequence_number: SequenceNumber, size: int):
        self.stream_handle = stream_handle
        self.local_stream_handle = local_stream_handle
        self.offset = offset
        self.local_offset = local_offset
        self.sequence_number = sequence_number
        self.size = size

    @classmethod
    def of(cls, stream_handle, local_stream_handle, change_set: SealedChangeSet,
           offset: int, local_offset: int) -> "UploadResult":
        return cls(stream_handle, local_stream_handle, offset, local_offset,
                   change_set.sequence_number, change_set.size)

    def __repr__(self) -> str:
        return (f"UploadResult(sqn={int(self.sequence_number)}, offset={self.offset}, size={self.size}, "
                f"handle={getattr(self.stream_handle, 'path', self.stream_handle)!r})")


class UploadTask:
    """Change sets of one writer plus its two callbacks; finishes exactly once (first of complete/fail)."""

    __slots__ = ("change_sets", "on_complete", "on_failed", "size", "_lock", "_finished")

    def __init__(self, change_sets: Sequence[SealedChangeSet],
                 on_complete: Callable[[List[UploadResult]], None],
                 on_failed: Callable[[List[SequenceNumber], BaseException], None],
                 size: Optional[int] = None):
        self.change_sets = list(change_sets)
        self.on_complete = on_complete
        self.on_failed = on_failed
        # `size` for a task whose bodies travel elsewhere (the upload service's shared memory)
        self.size = sum(cs.size for cs in self.change_sets) if size is None else int(size)
        self._lock = threading.Lock()
        self._finished = False

    @property
    def finished(self) -> bool:
        return self._finished

    def _finish(self) -> bool:
        with self._lock:
            if self._finished:
                return False
            self._finished = True
            return True

    def complete(self, results: List[UploadResult]) -> None:
        """Deliver the results; ignored if the task already finished."""
        if self._finish():
            self.on_complete(results)

    def fail(self, exc: BaseException) -> None:
        """Report the failure of every change set; ignored if the task already finished."""
        if self._finish():
            self.on_failed([cs.sequence_number for cs in self.change_sets], exc)

    def __repr__(self) -> str:
        return f"UploadTask(change_sets={len(self.change_sets)}, size={self.size}, finished={self._finished})"


class UploadTasksResult:
    """The outcome of one successful uploader attempt: one file (plus an optional local copy).

    `tasks_offsets` lists, per task in file order, `(change_set, offset, local_offset)` triples.
    """

    def __init__(self, tasks_offsets: Sequence[Tuple[UploadTask, Sequence[Tuple[SealedChangeSet, int, int]]]],
                 handle, local_handle=None, registry=None):
        self.tasks_offsets = list(tasks_offsets)
        self.handle = handle
        self.local_handle = local_handle
        self.registry = registry

    @property
    def state_size(self) -> int:
        return self.handle.state_size

    def results_for(self, index: int) -> List[UploadResult]:
        _, entries = self.tasks_offsets[index]
        return [UploadResult.of(self.handle, self.local_handle, cs, off, loff) for cs, off, loff in entries]

    def complete(self) -> None:
        """Deliver each task its results (the winning attempt)."""
        for i, (task, _) in enumerate(self.tasks_offsets):
            try:
                task.complete(self.results_for(i))
            except Exception:  # one failing callback must not keep the other tasks waiting
                log.exception("completion callback of %r failed", task)

    def discard(self) -> None:
        """A losing attempt: forget both registry entries and delete both files."""
        for h in (self.handle, self.local_handle):
            if h is None:
                continue
            if self.registry is not None:
                self.registry.stop_tracking(h)
            try:
                h.discard_state()
            except Exception:  # best effort: the file is garbage either way
                log.warning("could not delete the file of a losing upload attempt: %s", h, exc_info=True)

    def __repr__(self) -> str:
        return f"UploadTasksResult(tasks={len(self.tasks_offsets)}, handle={self.handle!r})"


__all__ = ["UploadTask", "UploadResult", "UploadTasksResult"]
