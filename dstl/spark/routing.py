"""How a micro-batch's rows reach their subtask's task: Spark's partitioning hash and the route choice.

Partition i of a batch's stage is subtask i. Two routes get the rows there (dstl.spark.session builds
both on the same cached anchor, so subtask i stays on its executor either way):

* ``shuffle`` (the default; any Spark DataFrame, and a large driver-held batch): each row gets a
  *salt*, the smallest int that Spark's own hash partitioning (Murmur3, seed 42, ``pmod``) sends to
  partition ``subtask``; ``repartition(P, salt)`` moves every row once, executor to executor, and
  the anchor is hash-partitioned the same way, so the join with it shuffles only the batch;
* ``broadcast``: for a small batch the driver already holds (a pandas DataFrame): shipping it whole
  to every executor costs less than a shuffle's extra stage. Chosen when the batch's in-memory size
  is at most `BROADCAST_MAX_BYTES`.
"""
from __future__ import annotations

import os
from typing import Any, List, Optional

import numpy as np
import pandas as pd

from dstl.keygroups import assign_key_groups, operator_indices_for_key_groups

#: a row's logical subtask (Flink's operator index of its key's key group)
SUBTASK_COL = "_dstl_subtask"
#: arrival order: a join or a shuffle hands a subtask's rows over in another order, so tasks sort by it
SEQ_COL = "_dstl_seq"
#: a batch row's salt: the shuffle route hash-partitions the batch by it, as the anchor is
SALT_COL = "_dstl_salt"



class NullKeyError(ValueError):
    """The key column holds nulls (and null_keys='drop' was not given)."""


SHUFFLE = "shuffle"
BROADCAST = "broadcast"
ROUTES = (SHUFFLE, BROADCAST)

#: a driver-held batch up to this size (pandas memory, bytes) is broadcast; env DSTL_BROADCAST_MAX_BYTES
BROADCAST_MAX_BYTES = int(os.environ.get("DSTL_BROADCAST_MAX_BYTES", str(4 << 20)))

_M32 = 0xFFFFFFFF


def _rotl(x: int, r: int) -> int:
    return ((x << r) | (x >> (32 - r))) & _M32


def spark_hash_int(value: int, seed: int = 42) -> int:
    """Spark's `hash()` of an IntegerType value (Murmur3_x86_32.hashInt), as a signed int32."""
    k1 = (value & _M32) * 0xCC9E2D51 & _M32
    k1 = _rotl(k1, 15) * 0x1B873593 & _M32
    h1 = (seed & _M32) ^ k1
    h1 = (_rotl(h1, 13) * 5 + 0xE6546B64) & _M32
    h1 ^= 4
    h1 ^= h1 >> 16
    h1 = h1 * 0x85EBCA6B & _M32
    h1 ^= h1 >> 13
    h1 = h1 * 0xC2B2AE35 & _M32
    h1 ^= h1 >> 16
    return h1 - (1 << 32) if h1 >= 1 << 31 else h1


def partition_salts(parallelism: int) -> List[int]:
    """For each subtask i, the smallest int v >= 0 that Spark's `repartition(parallelism, v)` puts in partition i."""
    if isinstance(parallelism, bool) or not isinstance(parallelism, int) or parallelism < 1:
        raise ValueError(f"parallelism must be a positive int, got {parallelism!r}")
    salts: List[Optional[int]] = [None] * parallelism
    missing, v = parallelism, 0
    while missing:
        p = spark_hash_int(v) % parallelism
        if salts[p] is None:
            salts[p] = v
            missing -= 1
        v += 1
    return salts  # type: ignore[return-value]


def subtask_of(keys: Any, max_parallelism: int, parallelism: int, null: Optional[np.ndarray] = None) -> np.ndarray:
    """Each key's logical subtask as int32: its Flink key group (dstl.keygroups), then the operator
    index owning that group at `parallelism`. The one null-key rule: a null key rides with subtask 0,
    whose task counts it; the front door then raises or drops (docs/streaming.md, "Null keys").

    `keys`: a pandas Series or anything pandas makes one of. `null`: which keys are null, when the
    caller knows better than the values (an integer column whose nulls were filled in, so it never
    passed through float). An integer column that holds nulls may arrive from Arrow as float; its
    other values are its integers again (exact up to 2**53)."""
    keys = keys if isinstance(keys, pd.Series) else pd.Series(keys)
    null = keys.isna().to_numpy() if null is None else np.asarray(null, dtype=bool)
    out = np.zeros(len(keys), dtype=np.int32)
    if null.all():
        return out
    values = keys[~null] if null.any() else keys
    if null.any() and values.dtype.kind == "f":
        values = values.astype("int64")
    out[~null] = operator_indices_for_key_groups(assign_key_groups(values, max_parallelism), max_parallelism,
                                                 parallelism)
    return out


def salt_column(subtask, parallelism: int):
    """The Spark column of the salt that routes a row of subtask `subtask` (a Column) to partition
    `subtask` under ``repartition(parallelism, salt)``."""
    from pyspark.sql import functions as F  # PySpark: imported where a Spark column is built

    return F.element_at(F.array(*[F.lit(s) for s in partition_salts(parallelism)]), subtask + 1)


def choose_route(batch: Any, route: Optional[str] = None) -> str:
    """The route for `batch`: `route` if given (checked), else ``broadcast`` for a pandas DataFrame of
    at most `BROADCAST_MAX_BYTES`, ``shuffle`` for anything else (a Spark DataFrame's size is not
    known without evaluating it, and the driver must never collect it)."""
    if route is not None:
        if route not in ROUTES:
            raise ValueError(f"route must be one of {', '.join(ROUTES)}, got {route!r}")
        return route
    if not type(batch).__module__.startswith("pandas"):
        return SHUFFLE
    shallow = int(batch.memory_usage(index=False, deep=False).sum())
    if shallow > BROADCAST_MAX_BYTES:
        return SHUFFLE
    return BROADCAST if int(batch.memory_usage(index=False, deep=True).sum()) <= BROADCAST_MAX_BYTES else SHUFFLE


def route_batch(batch, subtask_col: str, parallelism: int, route: str = SHUFFLE):
    """`batch` (a Spark DataFrame with `subtask_col`) made ready to reach its subtasks' partitions:
    ``shuffle`` adds the salt and ``repartition(parallelism, salt)``-s by it (partition i then holds
    subtask i's rows); ``broadcast`` marks it for a broadcast join. The one place a route is built."""
    from pyspark.sql import functions as F  # PySpark: imported where a Spark plan is built

    if route == BROADCAST:
        return F.broadcast(batch)
    if route == SHUFFLE:
        return batch.withColumn(SALT_COL, salt_column(F.col(subtask_col), parallelism)).repartition(
            parallelism, F.col(SALT_COL))
    raise ValueError(f"route must be one of {', '.join(ROUTES)}, got {route!r}")
