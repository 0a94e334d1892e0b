"""FsStateChangelogStorage: creates writers and readers over one upload scheduler and registry.

Upload modes (docs/options.md `upload.mode`): `direct` uploads synchronously on the calling thread,
`thread` batches the tasks of every writer on threads (BatchingStateChangeUploadScheduler with
retries and back-pressure), `process` hands them to the host's upload service (dstl.changelog.upload.service).
"""
from __future__ import annotations

import logging
import re
import threading
import uuid
from typing import Any, Dict, Mapping, Optional, Union

from dstl.config import StorageConfig
from dstl.format import release_spares
from dstl.types import KeyGroupRange
from dstl.changelog.writer import FsStateChangelogWriter

log = logging.getLogger(__name__)

_JOB_ID = re.compile(r"[0-9a-f]{32}")


class FsStateChangelogStorage:
    """The changelog storage of one task (or executor): one scheduler, uploader and registry.

    `config` is a mapping of option keys (`dstl.dfs.*` or `state.changelog.dstl.dfs.*`) or a
    `StorageConfig`. `job_id` (32 lowercase hex digits) names the job directory; default: random.
    `local_recovery_dir` enables local recovery: every file is also written below it, and readers
    read a file from its copy there when the copy is good (else from the base path).
    `local_recovery_root` (the host's shared root, dstl.changelog.local_recovery) lets readers also
    use the copies other processes of this host wrote below it.

    Writers get log ids `UUID(0, n)` with n counting per storage, as Flink does; the log id never
    appears in a file, it only orders change sets inside one upload task.
    """

    def __init__(self, config: Union[Mapping[str, Any], StorageConfig], *, job_id: Optional[str] = None,
                 local_recovery_dir: Optional[str] = None, local_recovery_root: Optional[str] = None):
        from dstl.metrics import ChangelogStorageMetricGroup
        from dstl.changelog.registry import LocalChangelogRegistry, TaskChangelogRegistry

        self.config = StorageConfig.of(config)  # validates before any thread starts or file is written
        from dstl.changelog.fs import validate_base_path

        if self.config.upload_mode == "process":  # protocols the service's modules register count too
            from dstl.changelog.upload.service.worker import _preload_user_modules

            try:
                _preload_user_modules()
            except ImportError:  # the service reports it, with its log
                pass
        validate_base_path(self.config.base_path)  # unknown protocol, a file: rejected now, not at upload
        if job_id is None:
            job_id = uuid.uuid4().hex
        if not isinstance(job_id, str) or not _JOB_ID.fullmatch(job_id):
            raise ValueError(f"job_id must be 32 lowercase hex digits, got {job_id!r}")
        self.job_id = job_id
        self.local_recovery_dir = local_recovery_dir
        from dstl.changelog.local_recovery import LocalCopies

        #: where restores look for local copies first (None: local recovery off)
        self.local_copies = (LocalCopies(job_id, directory=local_recovery_dir, root=local_recovery_root)
                             if local_recovery_dir or local_recovery_root else None)
        if local_recovery_root:
            _sweep_dead_owners(local_recovery_root)
        self.metric_group = ChangelogStorageMetricGroup()
        self._lock = threading.Lock()
        self._next_log = 0
        self._writers: Dict[uuid.UUID, FsStateChangelogWriter] = {}
        self._closed = False
        self._cache = None
        mode = self.config.upload_mode
        if mode == "process":
            try:
                from dstl.changelog.upload.service import open_service_client
            except ImportError as exc:
                raise ValueError("dstl.dfs.upload.mode 'process' needs the upload service "
                                 "(dstl.changelog.upload.service), which is not available; use 'thread' or "
                                 "'direct'") from exc
            # the service's uploaders write the local copies; their refcounts live in its registry
            self.scheduler, self.registry = open_service_client(
                self.config, job_id, self.metric_group, local_recovery_dir=local_recovery_dir)
            self.uploader = None
        elif mode in ("thread", "direct"):
            from dstl.changelog.upload.scheduler import StateChangeUploadScheduler
            from dstl.changelog.upload.uploader import StateChangeFsUploader

            self.registry = TaskChangelogRegistry(self.config.discard_num_threads)
            self.uploader = StateChangeFsUploader(
                self.config.base_path, job_id, self.config.compression, self.config.upload_buffer_size,
                self.registry, self.metric_group, local_recovery_dir)
            if mode == "direct":
                self.scheduler = StateChangeUploadScheduler.direct_scheduler(self.uploader)
            else:
                self.scheduler = StateChangeUploadScheduler.from_config(
                    self.config, self.uploader, self.metric_group)
        else:  # StorageConfig validates the mode; this guards a hand-built config
            raise ValueError(f"unknown dstl.dfs.upload.mode {mode!r} (process, thread or direct)")
        # With a host-shared root, copies serve every process of the host, and which are still
        # needed is decided by the checkpoints that read them (dstl.spark.keyed prunes by reference):
        # this storage-wide registry would delete, at one writer's confirm, copies that another
        # subtask's or process's checkpoint still reads.
        self.local_registry = (LocalChangelogRegistry(self.config.discard_num_threads)
                               if local_recovery_dir and not local_recovery_root else LocalChangelogRegistry.NO_OP)
        sched = self.scheduler
        self.metric_group.register_gauge("uploadQueueSize", lambda: int(sched.queue_size()))
        self.metric_group.register_gauge("inFlightBytes", lambda: int(sched.in_flight_bytes()))
        self.metric_group.register_gauge(
            "availability", lambda: 1 if sched.get_availability_provider().is_available() else 0)
        registry = self.registry
        self.metric_group.register_gauge("numberOfDeleteFailures", lambda: int(registry.delete_failures))

    # -- writers and readers -------------------------------------------------------------------
    def create_writer(self, operator_id: str, key_group_range: KeyGroupRange) -> FsStateChangelogWriter:
        """A new writer for `operator_id` over `key_group_range` (its own log id)."""
        if not isinstance(key_group_range, KeyGroupRange):
            raise TypeError(f"key_group_range must be a KeyGroupRange, got {type(key_group_range).__name__}")
        if not isinstance(operator_id, str):
            raise TypeError(f"operator_id must be a str, got {type(operator_id).__name__}")
        if not operator_id:
            raise ValueError("operator_id must be a non-empty string")
        with self._lock:
            self._check_open()
            log_id = uuid.UUID(int=self._next_log)  # Flink: new UUID(0, n)
            self._next_log += 1
            writer = FsStateChangelogWriter(
                log_id, key_group_range, self.scheduler, self.registry, self.local_registry,
                self.config.preemptive_persist_threshold, local_recovery=bool(self.local_recovery_dir),
                operator_id=operator_id, on_close=self._forget)
            self._writers[log_id] = writer
        return writer

    def _forget(self, writer: FsStateChangelogWriter) -> None:
        with self._lock:
            self._writers.pop(writer.log_id, None)

    def create_reader(self):
        """A reader sharing this storage's download cache."""
        from dstl.changelog.reader import DownloadCache, StateChangelogReader

        with self._lock:
            self._check_open()
            if self._cache is None:
                self._cache = DownloadCache(self.config.cache_idle_timeout_ms)
            cache = self._cache
        return StateChangelogReader(cache, self.local_copies)

    def get_availability_provider(self):
        """Back-pressure signal of the upload scheduler (always available in direct mode)."""
        return self.scheduler.get_availability_provider()

    @property
    def metrics(self) -> Dict[str, object]:
        """A snapshot of `ChangelogStorage.*` metrics (docs/options.md §4)."""
        return self.metric_group.snapshot()

    @property
    def upload_mode(self) -> str:
        return self.config.upload_mode

    @property
    def closed(self) -> bool:
        return self._closed

    @property
    def broken(self) -> bool:
        """True when the upload service this storage used has died: every later upload would fail,
        so the owner should close it and open a new one (which starts a new service)."""
        conn = getattr(self.scheduler, "connection", None)
        return conn is not None and getattr(conn, "broken", None) is not None

    def _check_open(self) -> None:
        if self._closed:
            raise RuntimeError("the changelog storage is closed")

    # -- close ----------------------------------------------------------------------------------
    def close(self) -> None:
        """Wait for running uploads, finish scheduled deletions, stop every thread (docs/semantics.md §7.4).

        Writers are closed by their owners; closing the storage releases nothing in the registry.
        """
        with self._lock:
            if self._closed:
                return
            self._closed = True
            cache = self._cache
        errors = []
        for step in (self.scheduler.close, self.registry.close, self.local_registry.close,
                     cache.close if cache is not None else None):
            if step is None:
                continue
            try:
                step()
            except Exception as exc:  # close everything, then report the first problem
                log.warning("error while closing the changelog storage", exc_info=True)
                errors.append(exc)
        release_spares()  # the memory kept for this storage's next change sets
        if errors:
            raise errors[0]

    def __enter__(self) -> "FsStateChangelogStorage":
        return self

    def __exit__(self, *exc) -> None:
        self.close()

    def __repr__(self) -> str:
        return (f"FsStateChangelogStorage({self.config.base_path!r}, job_id={self.job_id}, "
                f"mode={self.config.upload_mode}, closed={self._closed})")


_swept_roots: Dict[str, int] = {}  # root -> pid that swept it (once per process)


def _sweep_dead_owners(root: str) -> None:
    """Remove the owner directories below a local-recovery root whose process died (a lost
    executor's Python workers, a killed slot), by the pid in their name: the download caches' sweep.
    An owner that wrote within `DSTL_LOCAL_RECOVERY_GRACE_S` (600 s) is kept: the retry of the task
    it died in restores from its copies of the latest checkpoint."""
    import os

    if _swept_roots.get(root) == os.getpid():
        return
    _swept_roots[root] = os.getpid()
    from dstl.changelog.local_recovery import OWNER_PREFIX
    from dstl.changelog.upload.service.runtime import sweep_download_caches

    try:
        sweep_download_caches(root, OWNER_PREFIX, float(os.environ.get("DSTL_LOCAL_RECOVERY_GRACE_S", "600")))
    except OSError as exc:
        log.warning("could not sweep the local-recovery directory %s: %s", root, exc)


def open_storage(base_path: str, *, storage_options: Optional[Mapping[str, Any]] = None,
                 options: Optional[Mapping[str, Any]] = None, job_id: Optional[str] = None,
                 local_recovery_dir: Optional[str] = None, local_recovery_root: Optional[str] = None,
                 **kwargs: Any) -> FsStateChangelogStorage:
    """Short form: `open_storage("s3://bucket/cl", batch_persist_delay="10 ms", upload_mode="direct")`.

    dstl options come as keywords (the key suffixes with '.' and '-' written as '_') or in `options`
    (any spelling: `{"upload.mode": "direct"}`, `dstl.dfs.*` keys). `storage_options`: the fsspec
    file system's keyword arguments (`{"key": ..., "secret": ..., "client_kwargs": {...}}`), as
    pandas takes them; in memory only.
    """
    from dstl.config import parse_options, storage_config

    if "fs_options" in kwargs:
        raise ValueError("fs_options= is now storage_options= (the file system's keyword arguments)")
    merged = parse_options(options)
    for key, value in parse_options(kwargs).items():
        if key in merged and merged[key] != value:
            raise ValueError(f"option {key!r} given both in options= and as a keyword")
        merged[key] = value
    config = storage_config(base_path, merged, storage_options)
    return FsStateChangelogStorage(config, job_id=job_id, local_recovery_dir=local_recovery_dir,
                                   local_recovery_root=local_recovery_root)


__all__ = ["FsStateChangelogStorage", "open_storage"]
