"""dstl: a durable, batched, retried log of state changes, compatible with Apache Flink's DSTL.

The public names below are imported lazily, so `import dstl` stays cheap inside PySpark workers
and a Cython-free install still works (see `dstl.IMPLEMENTATION`).
"""
from __future__ import annotations

from typing import TYPE_CHECKING, Dict

from dstl._lazy import lazy_getattr

__version__ = "0.1.0"

_EXPORTS: Dict[str, str] = {
    # value types and errors
    "SequenceNumber": "dstl.types", "KeyGroupRange": "dstl.types", "StateChange": "dstl.types",
    "StateChangeSet": "dstl.types", "SealedChangeSet": "dstl.types", "META_KEY_GROUP": "dstl.types",
    "DstlError": "dstl.errors", "CorruptChangelogError": "dstl.errors",
    "WriterClosedError": "dstl.errors", "UploadServiceError": "dstl.errors",
    "IMPLEMENTATION": "dstl._impl",
    # format and the hot path
    "ChangeBuffer": "dstl.format",
    # handles, storage, writer, reader
    "StreamStateHandle": "dstl.handles", "ChangelogStateHandleStreamImpl": "dstl.handles",
    "SnapshotResult": "dstl.handles",
    "StorageConfig": "dstl.config",
    "FsStateChangelogStorage": "dstl.storage", "open_storage": "dstl.storage",
    "FsStateChangelogWriter": "dstl.writer",
    "StateChangelogReader": "dstl.reader",
    "DownloadCache": "dstl.reader", "ChangelogStorageMetricGroup": "dstl.metrics",
    "TaskChangelogRegistry": "dstl.registry", "LocalChangelogRegistry": "dstl.registry",
    # upload machinery
    "StateChangeUploadScheduler": "dstl.upload.scheduler",
    "BatchingStateChangeUploadScheduler": "dstl.upload.scheduler",
    "UploadTask": "dstl.upload.task", "UploadResult": "dstl.upload.task",
    "UploadTasksResult": "dstl.upload.task", "AvailabilityProvider": "dstl.upload.throttle",
    "StateChangeUploader": "dstl.upload.uploader", "StateChangeFsUploader": "dstl.upload.uploader",
    "RetryPolicy": "dstl.upload.retry", "RetryingExecutor": "dstl.upload.retry",
    "open_service_client": "dstl.upload.service",
    # key groups and state
    "assign_to_key_group": "dstl.keygroups",
    "compute_key_group_range_for_operator_index": "dstl.keygroups",
    "compute_operator_index_for_key_group": "dstl.keygroups",
    "compute_default_max_parallelism": "dstl.keygroups",
    "assign_key_groups": "dstl.keygroups", "assign_key_to_parallel_operator": "dstl.keygroups",
    "operator_indices_for_key_groups": "dstl.keygroups",
    "KeyedStateBackend": "dstl.state", "ValueState": "dstl.state", "ListState": "dstl.state",
    "MapState": "dstl.state", "OperatorListState": "dstl.state", "CheckpointMetadata": "dstl.state",
}

__all__ = sorted(_EXPORTS) + ["__version__"]

__getattr__ = lazy_getattr("dstl", _EXPORTS, globals())


def __dir__():
    return __all__


if TYPE_CHECKING:  # pragma: no cover - for type checkers and IDEs only
    from dstl._impl import IMPLEMENTATION  # noqa: F401
    from dstl.errors import CorruptChangelogError, DstlError, UploadServiceError, WriterClosedError  # noqa: F401
    from dstl.types import KeyGroupRange, SequenceNumber, StateChange, StateChangeSet  # noqa: F401
