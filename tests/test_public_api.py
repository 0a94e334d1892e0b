"""The public API surface that issues 2, 3, 5 and 6 name: importable from `dstl` (and `dstl.state`,
`dstl.spark`), the same objects as in their modules, with the methods the issues pin down.

The scheduler factories are exercised for real (a file is written through them and read back)."""
from __future__ import annotations

import inspect
import os
from concurrent.futures import Future

import pytest

import dstl
import dstl.spark
import dstl.state
from dstl.config import StorageConfig
from dstl.metrics import ChangelogStorageMetricGroup
from dstl.changelog.registry import TaskChangelogRegistry

T = 20
JOB = "0123456789abcdef" * 2

# issue -> names the issue lists for `from dstl import ...`
ISSUE_NAMES = {
    2: ["SequenceNumber", "KeyGroupRange", "StateChange", "StateChangeSet", "CorruptChangelogError"],
    3: ["FsStateChangelogStorage", "open_storage", "FsStateChangelogWriter", "SnapshotResult",
        "ChangelogStateHandleStreamImpl", "StreamStateHandle", "StateChangeUploadScheduler",
        "BatchingStateChangeUploadScheduler", "UploadTask", "UploadResult", "UploadTasksResult",
        "StateChangeUploader", "StateChangeFsUploader", "RetryPolicy", "RetryingExecutor",
        "TaskChangelogRegistry"],
    5: ["assign_to_key_group", "compute_key_group_range_for_operator_index",
        "compute_operator_index_for_key_group", "compute_default_max_parallelism", "ValueState", "ListState",
        "MapState", "OperatorListState", "CheckpointMetadata"],
}


@pytest.mark.parametrize("name", sorted({n for names in ISSUE_NAMES.values() for n in names}))
def test_issue_names_import_from_dstl(name):
    ns = {}
    exec(f"from dstl import {name}", ns)  # the exact spelling users write
    obj = ns[name]
    assert obj is getattr(dstl, name)
    assert name in dstl.__all__ and name in dir(dstl)
    # the facade re-exports the defining module's object, not a copy or a stand-in
    assert getattr(inspect.getmodule(obj), name) is obj


def test_unknown_name_is_an_attribute_error():
    with pytest.raises(AttributeError, match="no_such_name"):
        dstl.no_such_name  # noqa: B018
    with pytest.raises(ImportError):
        exec("from dstl import no_such_name", {})


def test_state_and_spark_facades():
    for name in ("ValueState", "ListState", "MapState", "ReducingState", "OperatorListState", "KeyedStateBackend",
                 "CheckpointMetadata", "repartition", "latest_checkpoint"):
        assert getattr(dstl.state, name) is not None, name
    assert dstl.state.ValueState is dstl.ValueState and dstl.state.CheckpointMetadata is dstl.CheckpointMetadata
    for name in ("with_key_group", "with_subtask", "stateful_map_in_pandas", "CheckpointCoordinator"):
        assert callable(getattr(dstl.spark, name)), name
    params = inspect.signature(dstl.spark.stateful_map_in_pandas).parameters
    for p in ("key", "parallelism", "max_parallelism", "storage_config", "checkpoint"):
        assert p in params, p


def test_value_type_methods():
    s = dstl.SequenceNumber.of(4)
    assert int(s.next()) == 5
    r = dstl.KeyGroupRange.of(0, 3)
    assert len(r) == 4 and r.contains(3) and dstl.KeyGroupRange.EMPTY.is_empty()
    assert dstl.StateChange.META_KEY_GROUP == dstl.META_KEY_GROUP == -1


def test_format_entry_points():
    import dstl.format as fmt

    enc = inspect.signature(fmt.encode_file).parameters
    assert list(enc)[:2] == ["change_sets", "compression"]
    assert enc["compression"].kind is inspect.Parameter.KEYWORD_ONLY and enc["compression"].default is None
    dec = list(inspect.signature(fmt.decode_file).parameters)
    assert dec[:3] == ["data", "offset", "key_group_range"]


def test_writer_reader_and_handle_methods():
    for name in ("append", "append_meta", "append_many", "initial_sequence_number", "next_sequence_number",
                 "persist", "truncate", "truncate_and_close", "confirm", "reset", "close",
                 "__enter__", "__exit__"):
        assert callable(getattr(dstl.FsStateChangelogWriter, name)), name
    for name in ("create_writer", "create_reader", "get_availability_provider", "close", "__enter__", "__exit__"):
        assert callable(getattr(dstl.FsStateChangelogStorage, name)), name
    assert callable(dstl.StateChangelogReader.get_changes)
    for name in ("get_intersection", "to_bytes", "from_bytes"):
        assert callable(getattr(dstl.ChangelogStateHandleStreamImpl, name)), name
    for name in ("fixed", "none"):
        assert callable(getattr(dstl.RetryPolicy, name)), name


def _uploader(tmp_path, registry, metrics):
    return dstl.StateChangeFsUploader(str(tmp_path), JOB, None, 1 << 16, registry, metrics)


def _upload_one(scheduler):
    """Upload one sealed change set through `scheduler`; -> the UploadResult."""
    import uuid

    from dstl.format import ChangeBuffer
    from dstl.types import SealedChangeSet

    buf = ChangeBuffer()
    buf.append(1, b"public")
    body = buf.seal()
    done: Future = Future()
    sealed = SealedChangeSet(uuid.uuid4(), dstl.SequenceNumber.of(0), body, len(b"public"), 1)
    task = dstl.UploadTask([sealed], lambda results: done.set_result(results),
                           lambda sqns, err: done.set_exception(err))
    scheduler.upload(task)
    (result,) = done.result(T)
    assert isinstance(result, dstl.UploadResult)
    return result


def _read_back(result):
    handle = dstl.ChangelogStateHandleStreamImpl([(result.stream_handle, result.offset)],
                                                 dstl.KeyGroupRange(0, 3), result.size)
    with dstl.open_storage(os.path.dirname(result.stream_handle.path), upload_mode="direct") as s:
        return [(c.key_group, c.data) for c in s.create_reader().get_changes(handle)]


def test_direct_scheduler_uploads_through_a_real_uploader(tmp_path):
    registry, metrics = TaskChangelogRegistry(), ChangelogStorageMetricGroup()
    s = dstl.StateChangeUploadScheduler.direct_scheduler(_uploader(tmp_path, registry, metrics))
    try:
        assert isinstance(s, dstl.StateChangeUploadScheduler)
        assert not isinstance(s, dstl.BatchingStateChangeUploadScheduler)
        assert s.get_availability_provider().is_available()
        assert _read_back(_upload_one(s)) == [(1, b"public")]
    finally:
        s.close()
        registry.close()


@pytest.mark.parametrize("form", ["storage_config", "flink_mapping"])
def test_from_config_builds_the_batching_scheduler(tmp_path, form):
    options = {"dstl.dfs.base-path": str(tmp_path), "dstl.dfs.batch.persist-delay": "7 ms",
               "dstl.dfs.batch.persist-size-threshold": "2kb", "dstl.dfs.upload.max-in-flight": "3mb"}
    config = StorageConfig.from_mapping(options) if form == "storage_config" else options
    registry, metrics = TaskChangelogRegistry(), ChangelogStorageMetricGroup()
    s = dstl.StateChangeUploadScheduler.from_config(config, _uploader(tmp_path, registry, metrics), metrics)
    try:
        assert isinstance(s, dstl.BatchingStateChangeUploadScheduler)
        assert s.persist_delay_ms == 7
        avail = s.get_availability_provider()
        assert avail.is_available() and avail.future.done()
        assert _read_back(_upload_one(s)) == [(1, b"public")]
        assert metrics.snapshot()["ChangelogStorage.numberOfUploadRequests"] == 1
    finally:
        s.close()
        registry.close()


def test_retry_policies():
    fixed = dstl.RetryPolicy.fixed(3, 100, 5)
    none = dstl.RetryPolicy.none()
    assert isinstance(fixed, dstl.RetryPolicy) and isinstance(none, dstl.RetryPolicy)
    assert fixed.timeout_ms == 100 and none.timeout_ms == 0
