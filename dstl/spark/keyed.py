"""Keyed columns and `stateful_map_in_pandas`: a row's key group and logical subtask as Spark
columns, and the stateful task over any DataFrame without a coordinator's batch loop.

Every row's subtask comes from one function, `dstl.spark.routing.subtask_of` (Flink's assignment,
vectorised in dstl.keygroups; a null key rides with subtask 0). `with_subtask` computes it in the
executors (a pandas UDF); the batch loop shared by `StatefulStream` and `StatefulJob`
(dstl.spark.batch) also computes it on the driver for a pandas batch. Partition i of a batch's stage
is subtask i: `stateful_map_in_pandas` shuffles the rows there by a salt
(dstl.spark.routing.route_batch) with no placement; the batch loop runs them on the cached anchor of
dstl.spark.session.SubtaskStage, so subtask i stays on its executor.

The task body (dstl.spark.task) continues or restores the subtask's state, calls ``fn(rows,
state)``, stages the output and returns one report row (dstl.spark.report); the driver
(dstl.spark.coordinator) turns the reports into checkpoint metadata and only then commits the
staged output.
"""
from __future__ import annotations

import dataclasses
from typing import Any, Callable, Optional, Sequence

import pandas as pd

from dstl.config import StorageConfig
from dstl.keygroups import UPPER_BOUND_MAX_PARALLELISM, assign_key_groups
from dstl.spark.plan import CheckpointPlan
from dstl.spark.report import REPORT_SCHEMA
from dstl.spark.routing import SHUFFLE, SUBTASK_COL, route_batch, subtask_of
from dstl.spark.session import ensure_importable_on_workers
from dstl.spark.task import KG_COL, arrow_output_schema, make_task, refuse_null_keys


def with_key_group(df, key_col: str, max_parallelism: int, name: str = KG_COL):
    """`df` plus an int column `name`: the Flink key group of `key_col` (vectorised pandas UDF); a
    null key has no key group (null)."""
    from pyspark.sql import functions as F  # PySpark

    if not isinstance(max_parallelism, int) or not 1 <= max_parallelism <= UPPER_BOUND_MAX_PARALLELISM:
        raise ValueError(f"max_parallelism must be in 1..{UPPER_BOUND_MAX_PARALLELISM}, got {max_parallelism!r}")
    _check_key(df, key_col)
    maxp = max_parallelism
    ensure_importable_on_workers(df.sparkSession)

    @F.pandas_udf("int")
    def key_group(keys):  # pragma: no cover - runs in the Python worker
        null = keys.isna().to_numpy()
        out = pd.Series(pd.array([None] * len(keys), dtype="Int32"), index=keys.index)
        if (~null).any():
            values = keys[~null]
            if null.any() and values.dtype.kind == "f":  # an integer column with nulls arrives as float
                values = values.astype("int64")
            out[~null] = assign_key_groups(values, maxp)
        return out

    return df.withColumn(name, key_group(F.col(key_col)))


def subtask_column(df, key_col: str, max_parallelism: int, parallelism: int):
    """The Spark column of each row's logical subtask (`dstl.spark.routing.subtask_of` in a
    vectorised pandas UDF, run in the executors)."""
    from pyspark.sql import functions as F  # PySpark
    from pyspark.sql import types as T  # PySpark

    _check_key(df, key_col)
    ensure_importable_on_workers(df.sparkSession)
    maxp, p = max_parallelism, parallelism
    if not isinstance(df.schema[key_col].dataType, T.IntegralType):
        @F.pandas_udf("int")
        def subtask(keys):  # pragma: no cover - runs in the Python worker
            return pd.Series(subtask_of(keys, maxp, p), index=keys.index)

        return subtask(F.col(key_col))

    # Arrow hands pandas an integer column with nulls as float64, which rounds keys above 2**53: the
    # nulls are filled in and passed beside it, so the keys stay int64
    @F.pandas_udf("int")
    def integral_subtask(keys, null):  # pragma: no cover - runs in the Python worker
        return pd.Series(subtask_of(keys, maxp, p, null.to_numpy(dtype=bool)), index=keys.index)

    column = F.col(key_col)
    return integral_subtask(F.coalesce(column, F.lit(0).cast(df.schema[key_col].dataType)), column.isNull())


def with_subtask(df, key_col: str, max_parallelism: int, parallelism: int, name: str = SUBTASK_COL,
                 key_group_col: str = KG_COL):
    """`df` plus the key group and the logical subtask index (Flink's operator index) for `parallelism`."""
    if not isinstance(parallelism, int) or not 1 <= parallelism <= max_parallelism:
        raise ValueError(f"parallelism must be in 1..max_parallelism ({max_parallelism}), got {parallelism!r}")
    if key_group_col not in df.columns:
        df = with_key_group(df, key_col, max_parallelism, key_group_col)
    return df.withColumn(name, subtask_column(df, key_col, max_parallelism, parallelism))


def _check_key(df, key_col: str) -> None:
    if key_col not in df.columns:
        raise ValueError(f"key column {key_col!r} not in the DataFrame (columns: {', '.join(df.columns)})")


def check_plan(checkpoint: CheckpointPlan, parallelism: Optional[int], max_parallelism: Optional[int]) -> None:
    """Raises unless the given parallelism and max parallelism (None: the plan's) are the plan's."""
    parallelism = checkpoint.parallelism if parallelism is None else parallelism
    max_parallelism = checkpoint.max_parallelism if max_parallelism is None else max_parallelism
    if checkpoint.parallelism != parallelism or checkpoint.max_parallelism != max_parallelism:
        raise ValueError(f"checkpoint plan is for parallelism {checkpoint.parallelism}/{checkpoint.max_parallelism}, "
                         f"called with {parallelism}/{max_parallelism}")


def check_order_by(df, order_by: Optional[Sequence[str]]) -> None:
    for c in order_by or ():
        if c not in df.columns:
            raise ValueError(f"order_by column {c!r} not in the DataFrame")


def stateful_map_in_pandas(df, fn: Callable, schema, *, key: str, checkpoint: CheckpointPlan,
                           parallelism: Optional[int] = None, max_parallelism: Optional[int] = None,
                           storage_config: Any = None, order_by: Optional[Sequence[str]] = None):
    """Run ``fn(rows, state)`` per logical subtask over `df`; returns a DataFrame of task reports.

    `fn` gets all rows of one subtask for this micro-batch (a pandas DataFrame, sorted by `order_by`
    if given) and that subtask's `KeyedStateBackend`; it returns a pandas DataFrame matching `schema`
    (a DDL string or StructType), or None. Output is staged, not committed: hand the reports to
    `CheckpointCoordinator.complete` (or use `StatefulJob`). Evaluate the result exactly once.
    A null key fails the task with `NullKeyError`. `storage_config` overrides
    `checkpoint.storage_mapping` when given (mapping or StorageConfig). `parallelism` and
    `max_parallelism` come from the plan; passing them only double-checks them.
    """
    check_plan(checkpoint, parallelism, max_parallelism)
    if storage_config is not None:
        checkpoint = dataclasses.replace(checkpoint,
                                         storage_mapping=StorageConfig.of(storage_config).to_mapping())
    arrow_schema = arrow_output_schema(schema)
    check_order_by(df, order_by)
    keyed = with_subtask(df, key, checkpoint.max_parallelism, checkpoint.parallelism)
    routed = route_batch(keyed, SUBTASK_COL, checkpoint.parallelism, SHUFFLE)
    task = make_task(checkpoint, refuse_null_keys(fn, key), arrow_schema, routed.columns, order_by)
    return routed.mapInPandas(task, REPORT_SCHEMA)
