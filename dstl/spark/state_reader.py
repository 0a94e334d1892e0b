"""A job's state and change feed as Spark DataFrames, read in parallel on the executors.

`read_state` runs one task per key-group range; each task restores only its range from the
checkpoint's changelog (the vectorised reader) and yields the live values as rows. `read_changes`
runs one task per (checkpoint, changelog handle) with the change sets that checkpoint added. The
driver reads checkpoint metadata and the first change set of each handle (state definitions and the
key type), never the changelog itself. Columns are those of dstl.state.reader.

`storage_options`: the base path file system's keyword arguments (key, secret, client_kwargs, ...),
as pandas takes them; they reach the executors inside the tasks, in memory. `options`: dstl's
storage options (docs/options.md).
"""
from __future__ import annotations

from typing import Any, Dict, List, Optional

import pandas as pd

from dstl.spark.keys import display_key, job_key_columns
from dstl.spark.session import default_parallelism, ensure_importable_on_workers
from dstl.state.reader import (CHANGE_COLUMNS, STATE_COLUMNS, TIMER_STATE, StateReadError, change_rows, expand_values,
                               first_look, key_group_ranges, new_entries, open_checkpoint, open_checkpoint as _open,
                               restored_range, state_rows, state_schema, to_json)
from dstl.types import KeyGroupRange

__all__ = ["read_state", "read_changes", "read_timers"]

_ROWS_PER_CHUNK = 50_000
_SPARK_KEY_TYPES = {int: "long", str: "string", bytes: "binary"}


def _key_ddl(key_type) -> str:
    return _SPARK_KEY_TYPES.get(key_type, "string")


def _schema(key_type, columns: List[str]) -> str:
    types = {"key": _key_ddl(key_type), "key_group": "int", "state": "string", "kind": "string",
             "user_key": "string", "position": "int", "value": "string", "checkpoint_id": "long",
             "op": "string"}
    return ", ".join(f"{c} {types[c]}" for c in columns)


def read_state(spark, base_path: str, state_name: Optional[str] = None, *, checkpoint_id: Optional[int] = None,
               tasks: Optional[int] = None, serializers: Optional[Dict[str, Any]] = None,
               storage_options: Optional[Dict[str, Any]] = None, now_ms: Optional[int] = None,
               options: Optional[Dict[str, Any]] = None):
    """The live state of a checkpoint (default: the latest) as a Spark DataFrame, one row per live
    value: key, key_group, state, kind, user_key (map state, JSON), position (list state), value
    (JSON). For one state whose schema the job recorded, the value's fields are columns instead of
    `value`. Expired TTL values (at `now_ms`, default now) are left out. `tasks`: key-group ranges
    read in parallel (default: the larger of the checkpoint's parallelism and Spark's default
    parallelism)."""
    meta = open_checkpoint(base_path, checkpoint_id, storage_options=storage_options)
    names, key_type = first_look(meta, storage_options, options)
    if state_name is not None and state_name not in names:
        names.update(_all_state_names(spark, base_path, meta, serializers, storage_options, options))
        if state_name not in names:
            known = ", ".join(sorted(names)) or "none"
            raise StateReadError(f"checkpoint {meta.checkpoint_id} at {base_path} has no state {state_name!r} "
                                 f"(states: {known})")
    n = tasks or max(meta.parallelism, default_parallelism(spark))
    ranges = key_group_ranges(meta.max_parallelism, n)
    ensure_importable_on_workers(spark)
    cid = meta.checkpoint_id
    declared = state_schema(meta, state_name)
    composite = job_key_columns(base_path, storage_options) is not None
    if composite:  # several key columns: the key shown as its values, a JSON list (dstl.spark.keys)
        key_type = str
    ddl = _schema(key_type, STATE_COLUMNS)
    if declared is not None:
        from pyspark.sql.types import StructType  # PySpark

        fields = StructType.fromJson(meta.properties["state_schemas"][state_name]["value"])
        ddl = _schema(key_type, STATE_COLUMNS[:-1]) + ", " + ", ".join(
            f"`{f.name}` {f.dataType.simpleString()}" for f in fields.fields)
    now = now_ms

    def frame(rows):
        df = pd.DataFrame(rows, columns=STATE_COLUMNS)
        if composite:
            df["key"] = df["key"].map(display_key)
        return expand_values(df, *state_schema(m_holder[0], state_name)) if declared is not None else df

    m_holder: List[Any] = []

    def task(batches):  # pragma: no cover - runs in the Python worker
        m_holder[:] = [_open(base_path, cid, storage_options=storage_options)]
        enc = None if declared is not None else to_json
        for pdf in batches:
            for i in pdf["id"].tolist():
                with restored_range(base_path, m_holder[0], ranges[i], serializers=serializers,
                                    storage_options=storage_options, options=options) as backend:
                    rows = []
                    for r in state_rows(backend, state_name, now_ms=now, encode=enc):
                        rows.append(r)
                        if len(rows) >= _ROWS_PER_CHUNK:
                            yield frame(rows)
                            rows = []
                    if rows:
                        yield frame(rows)

    return spark.range(0, len(ranges), 1, len(ranges)).mapInPandas(task, ddl)


def read_timers(spark, base_path: str, *, checkpoint_id: Optional[int] = None, tasks: Optional[int] = None,
                storage_options: Optional[Dict[str, Any]] = None, options: Optional[Dict[str, Any]] = None):
    """The registered timers of a checkpoint as a Spark DataFrame: key, key_group, timestamp_ms."""
    from pyspark.sql import functions as F  # PySpark

    meta = open_checkpoint(base_path, checkpoint_id, storage_options=storage_options)
    names, key_type = first_look(meta, storage_options, options)
    if TIMER_STATE not in names:
        names.update(_all_state_names(spark, base_path, meta, None, storage_options, options))
    if TIMER_STATE not in names:
        return spark.createDataFrame([], _schema(key_type, ["key", "key_group"]) + ", timestamp_ms long")
    df = read_state(spark, base_path, TIMER_STATE, checkpoint_id=meta.checkpoint_id, tasks=tasks,
                    storage_options=storage_options, options=options)
    return df.select("key", "key_group", F.col("user_key").cast("long").alias("timestamp_ms"))


def _all_state_names(spark, base_path, meta, serializers, storage_options, options) -> Dict[str, str]:
    """Every state's name and kind, found by the executors (the driver reads no changelog)."""
    ranges = [s.key_group_range for s in meta.subtasks if not s.key_group_range.is_empty()]
    ensure_importable_on_workers(spark)
    cid = meta.checkpoint_id

    def task(batches):  # pragma: no cover - runs in the Python worker
        m = _open(base_path, cid, storage_options=storage_options)
        for pdf in batches:
            for i in pdf["id"].tolist():
                r = ranges[i]
                with restored_range(base_path, m, KeyGroupRange(r.start, r.start), serializers=serializers,
                                    storage_options=storage_options, options=options) as backend:
                    yield pd.DataFrame({"name": backend.state_names,
                                        "kind": [backend.get_state(x).kind for x in backend.state_names]})

    rows = spark.range(0, len(ranges), 1, len(ranges)).mapInPandas(task, "name string, kind string") \
        .distinct().collect()
    return {r["name"]: r["kind"] for r in rows}


def read_changes(spark, base_path: str, from_checkpoint: int, to_checkpoint: int, *,
                 serializers: Optional[Dict[str, Any]] = None, storage_options: Optional[Dict[str, Any]] = None,
                 options: Optional[Dict[str, Any]] = None):
    """Every state change after `from_checkpoint` up to `to_checkpoint` as a Spark DataFrame:
    checkpoint_id (the first checkpoint holding the change), key, key_group, state, op (update,
    clear, add, add_all, put, put_all, remove), user_key (JSON), value (JSON). One task per
    (checkpoint, changelog handle); both checkpoints must be retained."""
    work = [(cid, hb, entries) for cid, per_subtask in new_entries(base_path, from_checkpoint, to_checkpoint,
                                                                   storage_options=storage_options)
            for _, _, hb, entries in per_subtask]
    meta = open_checkpoint(base_path, to_checkpoint, storage_options=storage_options)
    _, key_type = first_look(meta, storage_options, options)
    ensure_importable_on_workers(spark)
    composite = job_key_columns(base_path, storage_options) is not None
    if composite:  # several key columns: the key shown as its values, a JSON list, as read_state does
        key_type = str
    schema = _schema(key_type, CHANGE_COLUMNS)
    if not work:
        return spark.createDataFrame([], schema)

    def task(batches):  # pragma: no cover - runs in the Python worker
        for pdf in batches:
            for i in pdf["id"].tolist():
                cid, hb, entries = work[i]
                rows = list(change_rows(base_path, cid, hb, entries, storage_options=storage_options,
                                        serializers=serializers, options=options))
                if rows:
                    df = pd.DataFrame(rows, columns=CHANGE_COLUMNS)
                    if composite:
                        df["key"] = df["key"].map(display_key)
                    yield df

    return spark.range(0, len(work), 1, len(work)).mapInPandas(task, schema)
