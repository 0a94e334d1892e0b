"""Where a task's state comes from: a fresh backend, or one restored from the latest completed
checkpoint, reading each file from this host's local copy when it has a good one
(dstl.changelog.local_recovery), and the bookkeeping that keeps only the local copies a checkpoint
this worker serves still references (Flink removes a subsumed checkpoint's local state)."""
from __future__ import annotations

import logging
from typing import Any, Callable, Dict, Optional, Tuple

from dstl.changelog.local_recovery import file_names, prune, source_of
from dstl.errors import CorruptChangelogError
from dstl.keygroups import compute_key_group_range_for_operator_index
from dstl.spark.cache import CACHE
from dstl.spark.plan import CheckpointPlan
from dstl.state.backend import KeyedStateBackend
from dstl.state.metadata import read_checkpoint

log = logging.getLogger(__name__)


def subtask_state_to_snapshot(state, max_parallelism: Optional[int] = None):
    """A checkpoint's SubtaskState -> the KeyedStateSnapshot a backend restores from."""
    return state.to_keyed_snapshot(max_parallelism)


def open_backend(storage, plan: CheckpointPlan, subtask: int):
    """A fresh backend (no checkpoint yet) or one restored from the plan's completed checkpoint."""
    return restore_backend(storage, plan, subtask)[0]


def restore_backend(storage, plan: CheckpointPlan, subtask: int):
    """`(backend, source, files)`: `open_backend`'s backend, where its files were read ("local",
    "local+dfs" or "dfs"; "new" without a checkpoint) and the names of the files it restored from."""
    kgr = compute_key_group_range_for_operator_index(plan.max_parallelism, plan.parallelism, subtask)
    if plan.restore_checkpoint_id is None:
        backend = KeyedStateBackend(storage, plan.operator_id, kgr, plan.max_parallelism, **plan.backend_options)
        return backend, "new", []
    meta = read_checkpoint(plan.base_path, plan.restore_checkpoint_id)
    if meta.max_parallelism != plan.max_parallelism:
        raise ValueError(f"checkpoint {meta.checkpoint_id} has max parallelism {meta.max_parallelism}, "
                         f"the job asks for {plan.max_parallelism}; it cannot change (docs/rescaling.md §1)")
    snaps = [subtask_state_to_snapshot(s, meta.max_parallelism) for s in meta.subtasks]
    if getattr(storage, "local_copies", None) is not None:  # other subtasks restoring here need the rest
        _CHECKPOINT_FILES[plan.job_id] = (meta.checkpoint_id, set(file_names(snaps)))
    old = [snap for s, snap in zip(meta.subtasks, snaps)
           if max(s.key_group_range.start, kgr.start) <= min(s.key_group_range.end, kgr.end)]
    backend, source = restore_preferring_local(
        storage, lambda: KeyedStateBackend.restore(storage, plan.operator_id, kgr, plan.max_parallelism, old,
                                                   **plan.backend_options))
    return backend, source, file_names(old)


def restore_preferring_local(storage, restore: Callable[[], Any]) -> Tuple[Any, str]:
    """`(restore(), source)`: the restore reads each file from this host's local copy when it has a
    good one (dstl.changelog.local_recovery). A copy that passed the length check but fails to
    decode (raw files carry no checksum, only their structure is checked) is deleted and the whole
    restore runs again from the base path, so a bad copy costs time, never a wrong state."""
    copies = getattr(storage, "local_copies", None)
    if copies is None:
        return restore(), "dfs"
    copies.read.clear()
    before = copies.counters()
    try:
        return restore(), source_of(before, copies.counters())
    except CorruptChangelogError as exc:
        if copies.hits == before["hits"]:
            raise  # nothing came from a copy: the base path's file itself is bad
        suspects = list(copies.read)
        log.warning(
            "restore from this host's local copies failed (%s): deleting the %d copies it read and "
            "restoring from the base path", exc, len(suspects))
        copies.discard(suspects)
    copies.enabled = False
    try:
        return restore(), "dfs"
    finally:
        copies.enabled = True


#: local recovery in this worker: per cache key, the files of its latest snapshot(s) (kept while the
#: key is cached), and per job the files of the checkpoint the last restore here read
_KEY_FILES: Dict[Tuple, set] = {}
_LAST_FILES: Dict[Tuple, set] = {}
_CHECKPOINT_FILES: Dict[str, Tuple[int, set]] = {}


def prune_local_copies(storage, plan: CheckpointPlan, key: Tuple, completed_files) -> None:
    """Delete this worker's local copies no checkpoint it still serves references (Flink removes a
    subsumed checkpoint's local state): kept are the files of the completed and the pending snapshot
    of every subtask this worker holds, and those of the latest completed checkpoint a restore here
    read (other subtasks restoring from it on this host need them)."""
    owner = getattr(storage, "local_recovery_dir", None)
    if getattr(storage, "local_copies", None) is None or not owner or plan.restore_checkpoint_id is None:
        return
    _KEY_FILES[key] = set(completed_files)
    live = set(CACHE.checkpoints()) | {key}
    for k in [k for k in _KEY_FILES if k not in live]:
        _KEY_FILES.pop(k, None)
        _LAST_FILES.pop(k, None)
    keep: set = set()
    for k, files in _KEY_FILES.items():
        if k[0] == plan.job_id:
            keep |= files
    ckpt = _CHECKPOINT_FILES.get(plan.job_id)
    if ckpt is not None and ckpt[0] < plan.restore_checkpoint_id:  # subsumed
        del _CHECKPOINT_FILES[plan.job_id]
    elif ckpt is not None:
        keep |= ckpt[1]
    prune(owner, plan.job_id, keep)




def remember_snapshot_files(storage, key: Tuple, snapshot) -> None:
    """After a task's snapshot: its files join those kept for `key` (completed + pending: either may
    be restored here)."""
    if getattr(storage, "local_copies", None) is None:
        return
    _LAST_FILES[key] = set(file_names([snapshot]))
    _KEY_FILES[key] = _KEY_FILES.get(key, set()) | _LAST_FILES[key]


def last_snapshot_files(key: Tuple):
    """The files of the snapshot the task of `key` took last in this process (for a continued backend)."""
    return _LAST_FILES.get(key, ())
