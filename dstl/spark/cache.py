"""Per-worker state cache: what a reused PySpark Python worker keeps between micro-batches.

A Python worker (``spark.python.worker.reuse``, on by default) lives across tasks. After a task
snapshots subtask ``s`` for checkpoint ``c`` it puts the live `KeyedStateBackend` here, tagged with
``(c, token)``; ``token`` is unique per task attempt and is recorded in the checkpoint metadata when
the driver accepts that attempt's snapshot. The next task for ``s`` in the same worker continues
from memory only if the driver says the latest *completed* checkpoint is exactly ``(c, token)``.
Anything else (a checkpoint that never completed, a losing or retried attempt, a rescale, another
worker having owned ``s`` since) makes the entry stale: its backend is closed and never used again,
and the task restores from the changelog instead.

A backend is taken *out* of the cache while a task uses it and only put back after a successful
snapshot, so a task that fails half-way can never leave a half-updated backend behind.
"""
from __future__ import annotations

import atexit
import logging
import os
import shutil
import threading
import time
from dataclasses import dataclass, field
from typing import Any, Dict, Hashable, Mapping, Optional, Tuple

from dstl.changelog import local_recovery as lr
from dstl.changelog.fs import protocol_of
from dstl.changelog.storage import FsStateChangelogStorage
from dstl.config import StorageConfig

log = logging.getLogger(__name__)


#: a cached backend nobody asked for in this long is closed (a finished job's state, in a long-lived worker)
IDLE_TIMEOUT_S = float(os.environ.get("DSTL_SPARK_CACHE_IDLE_S", "600"))


@dataclass
class CacheEntry:
    backend: Any
    checkpoint_id: int
    token: str
    last_used: float = field(default_factory=time.monotonic)


class StateCache:
    """Live backends by key (job, operator, parallelism, max parallelism, subtask)."""

    def __init__(self) -> None:
        self._lock = threading.Lock()
        self._entries: Dict[Hashable, CacheEntry] = {}
        self.hits = 0
        self.misses = 0
        self.stale_closed = 0

    def backends(self) -> Tuple[Any, ...]:
        """The live backends held now (a task's own is out of the cache while it runs)."""
        with self._lock:
            return tuple(e.backend for e in self._entries.values())

    def acquire(self, key: Hashable, checkpoint_id: Optional[int], token: Optional[str]) -> Optional[Any]:
        """Take the backend for `key` if it is exactly at the completed checkpoint `(checkpoint_id, token)`.

        Returns None on a miss; a stale entry for `key` is closed on the way.
        """
        self.evict_idle()
        with self._lock:
            entry = self._entries.pop(key, None)
        if entry is None:
            self.misses += 1
            return None
        if checkpoint_id is not None and token is not None and \
                entry.checkpoint_id == checkpoint_id and entry.token == token:
            self.hits += 1
            return entry.backend
        self.misses += 1
        self._close_stale(entry, checkpoint_id)
        return None

    def put(self, key: Hashable, backend: Any, checkpoint_id: int, token: str) -> None:
        """Keep `backend`, which has just snapshotted `checkpoint_id` in the attempt `token`."""
        with self._lock:
            old = self._entries.pop(key, None)
            self._entries[key] = CacheEntry(backend, checkpoint_id, token)
        if old is not None and old.backend is not backend:
            self._close_stale(old, None)

    def evict_rescaled(self, job_id: str, operator_id: str, parallelism: int, max_parallelism: int) -> None:
        """Close this operator's entries for another (parallelism, max parallelism): rescaled away."""
        with self._lock:
            doomed = [k for k in self._entries
                      if isinstance(k, tuple) and len(k) == 5 and k[0] == job_id and k[1] == operator_id
                      and (k[2], k[3]) != (parallelism, max_parallelism)]
            entries = [self._entries.pop(k) for k in doomed]
        for entry in entries:
            self._close_stale(entry, None)

    def evict_idle(self, idle_s: Optional[float] = None) -> int:
        """Close entries unused for `idle_s` seconds (default IDLE_TIMEOUT_S); returns how many."""
        limit = IDLE_TIMEOUT_S if idle_s is None else idle_s
        now = time.monotonic()
        with self._lock:
            doomed = [k for k, e in self._entries.items() if now - e.last_used > limit]
            entries = [self._entries.pop(k) for k in doomed]
        for entry in entries:
            self._close_stale(entry, None)
        return len(entries)

    def _close_stale(self, entry: CacheEntry, completed: Optional[int]) -> None:
        # A stale backend's last snapshot may be part of a completed checkpoint that a newer owner
        # restored from. Confirming first hands its files to the checkpoints (they stop being tracked
        # here), so closing can never delete a file a checkpoint references; files no retained
        # checkpoint references are removed by the coordinator's garbage collection.
        self.stale_closed += 1
        try:
            if completed is not None and entry.checkpoint_id <= completed:
                entry.backend.confirm(entry.checkpoint_id)
        except Exception:  # best effort: the backend is being thrown away
            log.warning("confirming a stale state backend failed", exc_info=True)
        try:
            entry.backend.close()
        except Exception:
            log.warning("closing a stale state backend failed", exc_info=True)

    def clear(self) -> None:
        """Close every cached backend (worker shutdown, tests)."""
        with self._lock:
            entries = list(self._entries.values())
            self._entries.clear()
        for entry in entries:
            try:
                entry.backend.close()
            except Exception:
                log.warning("closing a cached state backend failed", exc_info=True)

    def __len__(self) -> int:
        with self._lock:
            return len(self._entries)

    def checkpoints(self) -> Dict[Hashable, Tuple[int, str]]:
        """Key -> (checkpoint id, token) of every entry (for tests and diagnostics)."""
        with self._lock:
            return {k: (e.checkpoint_id, e.token) for k, e in self._entries.items()}


#: The worker's cache (one per Python process).
CACHE = StateCache()

_storages_lock = threading.Lock()
_storages: Dict[Tuple[str, Tuple[Tuple[str, Any], ...]], Any] = {}


#: this process's local recovery: (pid it was set up in, host root, own owner directory)
_local: Dict[str, Any] = {"pid": None, "root": None, "owner": None}


def local_recovery_dirs() -> Tuple[Optional[str], Optional[str]]:
    """(host root, this process's owner directory) for local recovery, set up once per process:
    the root is ``$DSTL_LOCAL_RECOVERY_DIR`` (default: per user under the temp dir, 0700); the
    storage opened with it sweeps the copies of owners that died. (None, None) when it is off or
    the directory cannot be used (local recovery only saves time)."""
    if _local["pid"] != os.getpid():  # also after a fork
        _local.update(pid=os.getpid(), root=None, owner=None)
        root = lr.configured_root()
        if root is not None:
            try:
                lr.ensure_root(root)
                _local.update(root=root, owner=lr.new_owner_dir(root))
            except OSError as exc:
                log.warning("local recovery is off in this worker: %s", exc)
    return _local["root"], _local["owner"]


def _wants_local_recovery(options: Mapping[str, Any]) -> bool:
    """By default only for a remote base path: a copy of a file on the same local disk saves no
    read, it only doubles the writes. ``$DSTL_LOCAL_RECOVERY_DIR`` set (not off) turns it on anyway."""
    if os.environ.get(lr.ENV, "").strip():
        return True
    return protocol_of(StorageConfig.of(options).base_path) not in ("file", "local")


def storage_for(job_id: str, options: Mapping[str, Any]):
    """The worker's `FsStateChangelogStorage` for (job, options), created once and kept open, with
    local recovery into this process's owner directory (`local_recovery_dirs`)."""
    key = (job_id, tuple(sorted((k, repr(v)) for k, v in options.items())))
    with _storages_lock:
        storage = _storages.get(key)
        if storage is None or storage.closed or storage.broken:  # broken: its upload service died
            root, owner = local_recovery_dirs() if _wants_local_recovery(options) else (None, None)
            storage = FsStateChangelogStorage(dict(options), job_id=job_id, local_recovery_dir=owner,
                                              local_recovery_root=root)
            _storages[key] = storage
        return storage


def shutdown() -> None:
    """Close cached backends, then storages (waits for running uploads)."""
    CACHE.clear()
    with _storages_lock:
        storages = list(_storages.values())
        _storages.clear()
    for storage in storages:
        try:
            storage.close()
        except Exception:
            log.warning("closing a changelog storage failed", exc_info=True)
    owner = _local["owner"] if _local["pid"] == os.getpid() else None
    if owner is not None:  # nobody restores from a finished worker's copies: remove them now
        shutil.rmtree(owner, ignore_errors=True)
        _local.update(pid=None, root=None, owner=None)


atexit.register(shutdown)
