"""FsStateChangelogWriter: sequence numbers, persist, truncate/confirm/reset/close (docs/semantics.md §2-§6).

Concurrency (docs/semantics.md §2): a writer is used from one thread, like Flink's (@NotThreadSafe); upload
callbacks run on other threads. One lock guards the state they share (persist listeners, upload
results); callbacks take it, collect the futures to settle, release it and only then settle them; the
scheduler is never called under the lock. `append`/`append_meta` come from `WriterCore` (Cython, or
its twin) and take no lock: they only touch the active buffer, which upload callbacks never do.
"""
from __future__ import annotations

import logging
import threading
import uuid
from concurrent.futures import Future
from typing import Dict, List, Optional, Tuple

import numpy as np

from dstl.errors import WriterClosedError
from dstl.format import WriterCore
from dstl.types import KeyGroupRange, SealedChangeSet, SequenceNumber, as_sqn
from dstl.changelog.upload.task import UploadResult, UploadTask

log = logging.getLogger(__name__)

NO_CHECKPOINT = -1  # checkpoint id of a pre-emptive persist


class _Listener:
    """A pending persist: waits until every sqn of `[start, end)` has an upload result."""

    __slots__ = ("start", "end", "results", "future", "checkpointed_size")

    def __init__(self, start: int, end: int, ready: Dict[int, UploadResult], future: Future):
        self.start = start
        self.end = end
        self.results = dict(ready)
        self.future = future
        self.checkpointed_size = 0


def _checkpoint_int(checkpoint_id) -> int:
    if isinstance(checkpoint_id, bool) or not hasattr(checkpoint_id, "__index__"):
        raise TypeError(f"checkpoint_id must be an int, got {type(checkpoint_id).__name__}")
    return checkpoint_id.__index__()


def _as_os_error(exc: BaseException) -> OSError:
    if isinstance(exc, OSError):
        return exc
    err = OSError(f"upload failed: {exc!r}")
    err.__cause__ = exc
    return err


class FsStateChangelogWriter(WriterCore):
    """The changelog writer of one operator and key-group range; obtain it from `storage.create_writer`.

    `append`/`append_meta`/`append_many` add changes to the active change set; `persist(from, cp)`
    uploads everything from sqn `from` on and returns a Future of a `SnapshotResult`.

    Not thread-safe (as Flink's writer): call appends, `next_sequence_number`, `persist` and the
    lifecycle methods from one thread at a time. An append that arrives from another thread while one
    is inside its pre-emptive persist raises RuntimeError rather than interleaving.
    """

    def __init__(self, log_id: uuid.UUID, key_group_range: KeyGroupRange, scheduler, registry,
                 local_registry, preemptive_persist_threshold: int, *, local_recovery: bool = False,
                 operator_id: Optional[str] = None, on_close=None):
        self.log_id = log_id
        self.key_group_range = key_group_range
        self.operator_id = operator_id
        self._scheduler = scheduler
        self._registry = registry
        self._local_registry = local_registry
        self._threshold = min(int(preemptive_persist_threshold), 2**63 - 1)
        self._local_recovery = local_recovery
        self._on_close = on_close
        self._lock = threading.Lock()
        # the active buffer (`self._buffer`) belongs to WriterCore
        self._active = 0
        self._not_uploaded: Dict[int, SealedChangeSet] = {}
        self._uploaded: Dict[int, UploadResult] = {}
        # uploaded sqns whose files a checkpoint owns (confirm stopped tracking them): releasing them
        # again would be a no-op that only logs "untracked" warnings, so truncate skips them
        self._confirmed: set = set()
        self._lowest = 0
        self._highest: Optional[int] = None  # exclusive; None = unbounded
        self._highest_failed: Optional[Tuple[int, BaseException]] = None
        self._listeners: List[_Listener] = []
        self._closed = False
        self._kg_start = key_group_range.start
        self._kg_end = key_group_range.end

    # -- sequence numbers ----------------------------------------------------------------------
    def initial_sequence_number(self) -> SequenceNumber:
        return SequenceNumber(0)

    def next_sequence_number(self) -> SequenceNumber:
        """Roll the active change set over (if non-empty) and return the sqn the next change gets."""
        with self._lock:
            self._rollover()
            return SequenceNumber(self._active)

    def _rollover(self) -> None:
        sealed = self._take_active()  # the payload is copied only while the upload streams it
        if sealed is None:
            return
        body, size, n = sealed
        self._not_uploaded[self._active] = SealedChangeSet(self.log_id, self._active, body, size, n)
        self._active += 1

    # -- appends -------------------------------------------------------------------------------
    def _check_open(self) -> None:
        if self._closed:
            raise WriterClosedError(f"changelog writer {self.log_id} is closed")

    # append(key_group, data) and append_meta(data) are WriterCore's (no Python frame per call);
    # they call _preemptive once the active change set reaches the threshold.
    def _preemptive(self) -> None:
        """The pre-emptive persist of an append that filled the active set up to the threshold."""
        with self._lock:
            if self._closed:  # closed meanwhile: there is nothing left to upload
                return
            task = self._preemptive_locked()
        if task is not None:
            self._submit(task)

    def append_many(self, key_groups, data, offsets) -> None:
        """Add many data changes at once (Arrow binary layout), all or nothing.

        `key_groups`: n ints; `data`: one contiguous buffer; `offsets`: n+1 monotone ints into `data`.
        Every key group must be in the writer's range; the threshold is checked once, afterwards.
        """
        kgs = key_groups
        if hasattr(kgs, "to_numpy") and hasattr(kgs, "null_count"):  # pyarrow (Chunked)Array
            kgs = kgs.to_numpy() if not kgs.null_count else kgs
        kgs = np.asarray(kgs)
        if kgs.ndim == 1 and kgs.dtype.kind in "iu" and kgs.size:
            bad = (kgs < self._kg_start) | (kgs > self._kg_end)
            if bad.any():
                row = int(np.argmax(bad))
                raise ValueError(f"row {row}: key group {int(kgs[row])} is outside the writer's range "
                                 f"{self.key_group_range}")
        task = None
        with self._lock:
            self._check_open()
            self._buffer.append_many(key_groups, data, offsets)
            if self._buffer.size >= self._threshold:
                task = self._preemptive_locked()
        if task is not None:
            self._submit(task)

    def _submit(self, task: UploadTask) -> None:
        """Hand `task` to the scheduler (never under the lock). If the scheduler raises, the task fails
        too, so no persist waits forever for change sets that never left."""
        try:
            self._scheduler.upload(task)
        except BaseException as exc:
            task.fail(exc)
            raise

    def _preemptive_locked(self) -> Optional[UploadTask]:
        start = min(self._not_uploaded) if self._not_uploaded else self._active
        _, task = self._persist_locked(start, NO_CHECKPOINT)
        return task

    # -- persist -------------------------------------------------------------------------------
    def persist(self, from_sqn, checkpoint_id: int) -> Future:
        """Upload every change set at or after `from_sqn`; Future of a `SnapshotResult` (docs/semantics.md §5)."""
        start = int(as_sqn(from_sqn))
        checkpoint_id = _checkpoint_int(checkpoint_id)
        with self._lock:
            self._check_open()
            future, task = self._persist_locked(start, checkpoint_id)
        if task is not None:
            self._submit(task)
        return future

    def _persist_locked(self, start: int, checkpoint_id: int) -> Tuple[Future, Optional[UploadTask]]:
        hf = self._highest_failed
        if hf is not None and hf[0] >= start:
            err = OSError(f"upload of sequence number {hf[0]} already failed; cannot persist from {start}")
            err.__cause__ = hf[1]
            raise err
        if start < self._lowest:
            raise ValueError(f"sequence number {start} is already truncated (lowest is {self._lowest})")
        if start > self._active:
            raise ValueError(f"sequence number {start} is not yet appended (active is {self._active})")
        self._rollover()
        to_upload = [cs for sqn, cs in self._not_uploaded.items() if sqn >= start]
        for cs in to_upload:
            del self._not_uploaded[int(cs.sequence_number)]
        ready = {sqn: r for sqn, r in self._uploaded.items() if sqn >= start}
        if checkpoint_id != NO_CHECKPOINT:
            for r in ready.values():
                if r.local_stream_handle is not None:
                    self._local_registry.register(r.local_stream_handle, checkpoint_id)
        end = self._active
        future: Future = Future()
        if end - start == len(ready):
            future.set_result(self._build_result(ready, 0))
            return future, None
        self._listeners.append(_Listener(start, end, ready, future))
        if not to_upload:
            return future, None
        to_upload.sort(key=lambda cs: int(cs.sequence_number))
        task = UploadTask(to_upload,
                          lambda results: self._on_upload_success(results, checkpoint_id),
                          self._on_upload_failure)
        return future, task

    def _build_result(self, results: Dict[int, UploadResult], checkpointed_size: int):
        from dstl.changelog.handles import ChangelogStateHandleStreamImpl, SnapshotResult

        ordered = [results[s] for s in sorted(results)]
        state_size = sum(r.size for r in ordered)
        remote = ChangelogStateHandleStreamImpl(
            [(r.stream_handle, r.offset) for r in ordered], self.key_group_range, state_size,
            checkpointed_size, "filesystem")
        local = None
        if self._local_recovery and ordered:
            with_local = sum(1 for r in ordered if r.local_stream_handle is not None)
            if with_local == len(ordered):
                local = ChangelogStateHandleStreamImpl(
                    [(r.local_stream_handle, r.local_offset) for r in ordered], self.key_group_range,
                    state_size, 0, "filesystem")
            elif with_local:
                log.warning("writer %s: only %d of %d change sets have a local copy; no local snapshot",
                            self.log_id, with_local, len(ordered))
        return SnapshotResult(remote, local)

    # -- upload outcomes (any thread) ----------------------------------------------------------
    def _on_upload_success(self, results: List[UploadResult], checkpoint_id: int) -> None:
        done: List[Tuple[Future, object]] = []
        with self._lock:
            if self._closed:
                release = list(results)
            else:
                release = []
                self._notify_success(results, done)
                hi = self._highest
                for r in results:
                    sqn = int(r.sequence_number)
                    if checkpoint_id != NO_CHECKPOINT and r.local_stream_handle is not None:
                        self._local_registry.register(r.local_stream_handle, checkpoint_id)
                    if self._lowest <= sqn and (hi is None or sqn < hi):
                        self._uploaded[sqn] = r
                    else:  # truncated or closed meanwhile
                        release.append(r)
        for r in release:
            self._release(r)
        for fut, value in done:
            fut.set_result(value)

    def _notify_success(self, results: List[UploadResult], done) -> None:
        remaining = []
        for lst in self._listeners:
            for r in results:
                sqn = int(r.sequence_number)
                if lst.start <= sqn < lst.end and sqn not in lst.results:
                    lst.results[sqn] = r
                    lst.checkpointed_size += r.size
            if len(lst.results) == lst.end - lst.start:
                done.append((lst.future, self._build_result(lst.results, lst.checkpointed_size)))
            else:
                remaining.append(lst)
        self._listeners = remaining

    def _on_upload_failure(self, sqns: List[SequenceNumber], exc: BaseException) -> None:
        failed: List[Future] = []
        with self._lock:
            if self._closed:
                return
            ints = [int(s) for s in sqns]
            remaining = []
            for lst in self._listeners:
                if any(lst.start <= s < lst.end for s in ints):
                    failed.append(lst.future)
                else:
                    remaining.append(lst)
            self._listeners = remaining
            if ints:
                top = max(ints)
                hf = self._highest_failed
                if top >= self._lowest and (hf is None or top > hf[0]):
                    self._highest_failed = (top, exc)
        err = _as_os_error(exc)
        for fut in failed:
            fut.set_exception(err)

    def _release(self, r: UploadResult) -> None:
        for h in (r.stream_handle, r.local_stream_handle):
            if h is None:
                continue
            try:
                self._registry.release(h)
            except Exception:  # a registry problem must not stop futures from settling
                log.exception("writer %s: could not release %s", self.log_id, h)

    # -- lifecycle -----------------------------------------------------------------------------
    def _pop_uploaded(self, sqns) -> List[UploadResult]:
        """Remove `sqns` from `uploaded`; return the results this writer still has to release."""
        out = []
        for sqn in sqns:
            r = self._uploaded.pop(sqn)
            if sqn in self._confirmed:
                self._confirmed.discard(sqn)
            else:
                out.append(r)
        return out

    def truncate(self, to_sqn) -> None:
        """Forget change sets below `to_sqn`: nothing before it will be persisted again. `lowest` never
        moves back (docs/semantics.md §12): the change sets below it are gone, and a persist from
        there would wait for them forever."""
        to = int(as_sqn(to_sqn))
        with self._lock:
            if to > self._active:
                raise ValueError(f"cannot truncate to {to}: not yet appended (active is {self._active})")
            self._lowest = max(self._lowest, to)
            for sqn in [s for s in self._not_uploaded if s < to]:
                del self._not_uploaded[sqn]
            release = self._pop_uploaded([s for s in self._uploaded if s < to])
        for r in release:
            self._release(r)

    def truncate_and_close(self, from_sqn) -> None:
        """Release change sets at or after `from_sqn` and close; earlier persisted handles stay valid."""
        start = int(as_sqn(from_sqn))
        with self._lock:
            self._highest = start
            release = self._pop_uploaded([s for s in self._uploaded if s >= start])
        for r in release:
            self._release(r)
        self.close()

    def confirm(self, from_sqn, to_sqn, checkpoint_id: int) -> None:
        """Checkpoint `checkpoint_id` completed: it owns the files of `[from, to)` from now on."""
        start, end = int(as_sqn(from_sqn)), int(as_sqn(to_sqn))
        with self._lock:
            if not (start <= end <= self._active):
                raise ValueError(f"invalid confirm range [{start}, {end}) (active is {self._active})")
            owned = [r for s, r in self._uploaded.items() if start <= s < end]
            self._confirmed.update(s for s in self._uploaded if start <= s < end)
        for r in owned:
            self._registry.stop_tracking(r.stream_handle)
            if r.local_stream_handle is not None:
                self._registry.stop_tracking(r.local_stream_handle)
        self._local_registry.discard_up_to_checkpoint(_checkpoint_int(checkpoint_id))

    def reset(self, from_sqn, to_sqn, checkpoint_id: int) -> None:
        """Checkpoint `checkpoint_id` was aborted: drop its local copies; uploads stay reusable."""
        as_sqn(from_sqn), as_sqn(to_sqn)  # validates the arguments
        self._local_registry.discard_up_to_checkpoint(_checkpoint_int(checkpoint_id) + 1)

    def close(self) -> None:
        """Close the writer; pending persist futures fail with WriterClosedError. Idempotent."""
        with self._lock:
            if self._closed:
                return
            self._closed = True
            self._buffer.clear()
            self._not_uploaded.clear()
            self._uploaded.clear()
            self._confirmed.clear()
            listeners, self._listeners = self._listeners, []
        err = WriterClosedError(f"changelog writer {self.log_id} was closed")
        for lst in listeners:
            if not lst.future.done():
                lst.future.set_exception(err)
        if self._on_close is not None:
            self._on_close(self)

    def __enter__(self) -> "FsStateChangelogWriter":
        return self

    def __exit__(self, *exc) -> None:
        self.close()

    # -- introspection -------------------------------------------------------------------------
    @property
    def closed(self) -> bool:
        return self._closed

    @property
    def highest_failed(self) -> Optional[Tuple[SequenceNumber, BaseException]]:
        hf = self._highest_failed
        return None if hf is None else (SequenceNumber(hf[0]), hf[1])

    @property
    def lowest_sequence_number(self) -> SequenceNumber:
        return SequenceNumber(self._lowest)

    @property
    def active_size(self) -> int:
        """Payload bytes in the active (not yet rolled over) change set."""
        return self._buffer.size

    def uploaded_sequence_numbers(self) -> List[int]:
        with self._lock:
            return sorted(self._uploaded)

    def not_uploaded_sequence_numbers(self) -> List[int]:
        with self._lock:
            return sorted(self._not_uploaded)

    def __repr__(self) -> str:
        return (f"FsStateChangelogWriter(log_id={self.log_id}, range={self.key_group_range}, "
                f"active={self._active}, closed={self._closed})")


__all__ = ["FsStateChangelogWriter"]
