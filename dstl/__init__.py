"""dstl: a durable, batched, retried log of state changes, compatible with Apache Flink's DSTL.

The public names below are imported lazily, so `import dstl` stays cheap inside PySpark workers
and a Cython-free install still works (see `dstl.IMPLEMENTATION`).
"""
from __future__ import annotations

from typing import TYPE_CHECKING, Dict

from dstl._lazy import lazy_getattr

# The one place the version is written: setuptools reads it from here without importing dstl
# (pyproject.toml, [tool.setuptools.dynamic]); `dstl --version` prints it.
__version__ = "0.2.0.dev0"

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
    "StreamStateHandle": "dstl.changelog.handles", "ChangelogStateHandleStreamImpl": "dstl.changelog.handles",
    "SnapshotResult": "dstl.changelog.handles",
    "StorageConfig": "dstl.config",
    "FsStateChangelogStorage": "dstl.changelog.storage", "open_storage": "dstl.changelog.storage",
    "FsStateChangelogWriter": "dstl.changelog.writer",
    "StateChangelogReader": "dstl.changelog.reader",
    "DownloadCache": "dstl.changelog.reader", "ChangelogStorageMetricGroup": "dstl.metrics",
    "TaskChangelogRegistry": "dstl.changelog.registry", "LocalChangelogRegistry": "dstl.changelog.registry",
    # upload machinery
    "StateChangeUploadScheduler": "dstl.changelog.upload.scheduler",
    "BatchingStateChangeUploadScheduler": "dstl.changelog.upload.scheduler",
    "UploadTask": "dstl.changelog.upload.task", "UploadResult": "dstl.changelog.upload.task",
    "UploadTasksResult": "dstl.changelog.upload.task", "AvailabilityProvider": "dstl.changelog.upload.throttle",
    "StateChangeUploader": "dstl.changelog.upload.uploader", "StateChangeFsUploader": "dstl.changelog.upload.uploader",
    "RetryPolicy": "dstl.changelog.upload.retry", "RetryingExecutor": "dstl.changelog.upload.retry",
    "open_service_client": "dstl.changelog.upload.service",
    # key groups and state
    "assign_to_key_group": "dstl.keygroups",
    "compute_key_group_range_for_operator_index": "dstl.keygroups",
    "compute_operator_index_for_key_group": "dstl.keygroups",
    "compute_default_max_parallelism": "dstl.keygroups",
    "assign_key_groups": "dstl.keygroups", "assign_key_to_parallel_operator": "dstl.keygroups",
    "operator_indices_for_key_groups": "dstl.keygroups",
    "KeyedStateBackend": "dstl.state", "ValueState": "dstl.state", "ListState": "dstl.state",
    "MapState": "dstl.state", "OperatorListState": "dstl.state", "CheckpointMetadata": "dstl.state",
    "BasePathInUseError": "dstl.state.fencing", "StoreUnreachableError": "dstl.changelog.fs",
}

# public subpackages, imported on first attribute access (`import dstl; dstl.format.decode_file(...)`)
SUBPACKAGES = ("format", "keygroups", "changelog", "state", "spark", "types", "errors", "config", "metrics")

__all__ = sorted(_EXPORTS) + ["__version__"]

__getattr__ = lazy_getattr("dstl", _EXPORTS, globals(), SUBPACKAGES)


def __dir__():
    return __all__ + list(SUBPACKAGES)


if TYPE_CHECKING:  # pragma: no cover - for type checkers and IDEs only
    from dstl._impl import IMPLEMENTATION  # noqa: F401
    from dstl.errors import CorruptChangelogError, DstlError, UploadServiceError, WriterClosedError  # noqa: F401
    from dstl.types import KeyGroupRange, SequenceNumber, StateChange, StateChangeSet  # noqa: F401
