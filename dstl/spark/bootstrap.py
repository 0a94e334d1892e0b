"""Write a job's first checkpoint from a DataFrame (Flink's State Processor API "bootstrap").

`bootstrap_state(spark, df, base_path, key=..., state_name=..., parallelism=...)` routes the rows to
their logical subtasks (key group -> operator index, as a running job does), and each Spark task
builds its subtasks' value state, materializes it and persists the snapshot. The driver receives only
the serialised snapshots and writes checkpoint 1 and the job file. A job (StatefulJob, the pipeline,
StatefulStream) resumed at `base_path` continues from it with its first micro-batch.
"""
from __future__ import annotations

import uuid
from typing import Any, Dict, Optional, Sequence

import pandas as pd

from dstl.changelog.fs import root_of
from dstl.changelog.storage import FsStateChangelogStorage
from dstl.config import storage_config
from dstl.keygroups import compute_default_max_parallelism, compute_key_group_range_for_operator_index
from dstl.spark.coordinator import JOB_FILE, CheckpointCoordinator, JobConflictError, JobSpec
from dstl.spark.keyed import with_subtask
from dstl.spark.routing import SUBTASK_COL, NullKeyError
from dstl.spark.session import ensure_importable_on_workers, struct_from_ddl
from dstl.state import KeyedStateBackend, KeyedStateSnapshot
from dstl.state.metadata import CheckpointMetadata, SubtaskState, list_checkpoints, write_checkpoint
from dstl.state.schema import StateSchema

__all__ = ["bootstrap_state"]

BOOTSTRAP_OPERATOR = "dstl-bootstrap"


def _fields(schema: Any):
    """Field names of a DDL string / StructType, or None."""
    if schema is None:
        return None
    from pyspark.sql.types import StructType  # PySpark

    if isinstance(schema, str):
        schema = struct_from_ddl(schema)
    if not isinstance(schema, StructType):
        raise TypeError(f"schema must be a DDL string or a StructType, got {type(schema).__name__}")
    return [f.name for f in schema.fields]


def _schema_record(state_name: str, schema: Any) -> Dict[str, Any]:
    """The `state_schemas` property (as StatefulStream records it) when the value schema is given:
    read_state then shows the value's columns, and a StatefulStream resuming here checks its
    declared schema against it (dstl.state.evolution)."""
    if schema is None:
        return {}
    return {state_name: StateSchema(state_name, "value", schema).to_record()}


def bootstrap_state(spark, df, base_path: str, *, key: str, state_name: str, schema: Any = None,
                    max_parallelism: Optional[int] = None, parallelism: int, operator_id: Optional[str] = None,
                    output_path: Optional[str] = None, storage_options: Optional[Dict[str, Any]] = None,
                    params: Optional[Dict[str, Any]] = None, options: Optional[Dict[str, Any]] = None):
    """Write checkpoint 1 of a new job at `base_path` holding value state `state_name` per `key`.

    The value of each key is its row's `schema` columns as a list (a StatefulProcessor's tuple); with
    `schema=None`, the one non-key column itself, or a list of all non-key columns. A key must occur
    once. `operator_id` / `output_path` / `params` go into the job file and must be what the job that
    continues passes (defaults: "dstl-bootstrap", `<base>/output`, none; for a StatefulStream pass
    ``operator_id=StatefulStream.operator_id``). Checkpoint 1 has no Spark batch (its batch is -1):
    the continuing job's first batch is 0. With `schema`, the state's schema is recorded as
    StatefulStream records it. `storage_options`: the file system's keyword arguments (key, secret,
    client_kwargs, ...); `options`: dstl's storage options. Returns the checkpoint's metadata.
    """
    if key not in df.columns:
        raise ValueError(f"key column {key!r} not in the DataFrame (columns: {', '.join(df.columns)})")
    fields = _fields(schema)
    rest = [c for c in df.columns if c != key]
    if fields is not None:
        missing = [f for f in fields if f not in df.columns]
        if missing:
            raise ValueError(f"schema fields {missing} are not columns of the DataFrame")
    elif not rest:
        raise ValueError("the DataFrame has no value column besides the key")
    single = fields is None and len(rest) == 1
    columns = fields if fields is not None else rest
    maxp = max_parallelism or compute_default_max_parallelism(parallelism)
    if not isinstance(parallelism, int) or not 1 <= parallelism <= maxp:
        raise ValueError(f"parallelism must be in 1..{maxp} (max parallelism), got {parallelism!r}")
    # registers the file system's arguments before the first look at the base path
    config = storage_config(base_path, options, storage_options).replace(upload_mode="direct")

    bfs, broot = root_of(base_path)
    if list_checkpoints(base_path) or bfs.exists(f"{broot}/{JOB_FILE}"):
        raise JobConflictError(f"{base_path} already holds a job; bootstrap writes a new job's first checkpoint")
    job_id = uuid.uuid4().hex
    operator_id = operator_id or BOOTSTRAP_OPERATOR
    output = output_path or base_path.rstrip("/") + "/output"
    ensure_importable_on_workers(spark)
    opts = config.to_mapping()  # to the tasks, in memory
    keyed = with_subtask(df.select(key, *columns), key, maxp, parallelism)
    routed = keyed.repartition(parallelism, SUBTASK_COL)

    def task(batches):  # pragma: no cover - runs in the Python worker
        frames = [b for b in batches if len(b)]
        if not frames:
            return
        rows = pd.concat(frames, ignore_index=True)
        nulls = int(rows[key].isna().sum())  # they ride with subtask 0 (dstl.spark.routing.subtask_of)
        if nulls:
            raise NullKeyError(f"key column {key!r} has {nulls} null value(s) in the bootstrap DataFrame; "
                               f"keys must not be null")
        dup = rows[key].duplicated()
        if dup.any():
            raise ValueError(f"key {rows[key][dup].iloc[0]!r} occurs more than once in the bootstrap DataFrame")
        with FsStateChangelogStorage(opts, job_id=job_id) as storage:
            for sub, part in rows.groupby(SUBTASK_COL, sort=True):
                kgr = compute_key_group_range_for_operator_index(maxp, parallelism, int(sub))
                backend = KeyedStateBackend(storage, operator_id, kgr, maxp)
                try:
                    keys = part[key].tolist()
                    vals = part[columns[0]].tolist() if single else [list(t) for t in
                                                                     zip(*(part[c].tolist() for c in columns))]
                    state = backend.value_state(state_name)
                    for k, v in zip(keys, vals):
                        state.update(k, v)
                    backend.materialize(force=True)
                    snap = backend.snapshot(1).result()
                    backend.confirm(1)  # the checkpoint will own these files
                finally:
                    backend.close()
                yield pd.DataFrame({"subtask": [int(sub)], "snapshot": [snap.to_bytes()]})

    reports = routed.mapInPandas(task, "subtask int, snapshot binary").collect()
    snaps = {r["subtask"]: KeyedStateSnapshot.from_bytes(bytes(r["snapshot"])) for r in reports}
    subtasks = [SubtaskState.from_keyed_snapshot(i, snaps[i]) if i in snaps else
                SubtaskState(i, compute_key_group_range_for_operator_index(maxp, parallelism, i))
                for i in range(parallelism)]
    spec = JobSpec(job_id, operator_id, maxp, output, dict(params or {}))
    CheckpointCoordinator.open(base_path, spec, config, resume=False)  # writes the job file
    props = {"batch": -1, "job_id": job_id, "operator_id": operator_id, "bootstrap": True,
             "state_schemas": _schema_record(state_name, schema),
             "tokens": [uuid.uuid4().hex for _ in range(parallelism)], "output": {"batch": -1, "files": []}}
    meta = CheckpointMetadata(1, maxp, parallelism, subtasks, props, job_id=job_id)
    write_checkpoint(base_path, meta)
    return meta
