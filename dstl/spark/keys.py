"""Several key columns (`StatefulStream(key=["id1", "id2"])`): one stored key per row.

A composite key is stored as the msgpack encoding of the list of its column values, in the order
the columns were named (``packb(["a", 1], use_bin_type=True)``), and hashes to its key group as that
binary key does (docs/rescaling.md §7). The encoding is deterministic, so the same values always
land in the same key group, at any parallelism. The processor gets the tuple back, as Spark passes
a grouping key. A row with a null in any key column has a null key.
"""
from __future__ import annotations

import math
from typing import Any, List, Optional, Sequence

__all__ = ["KEY_COL", "pack_key", "pack_columns", "unpack_key", "normalize_keys"]

#: the column a StatefulStream with several key columns adds (and drops before the processor)
KEY_COL = "_dstl_key"

_ALLOWED = ("ByteType", "ShortType", "IntegerType", "LongType", "StringType", "BooleanType", "BinaryType")


def normalize_keys(key: Any) -> List[str]:
    """The key column names, from one name or a list of distinct names."""
    keys = [key] if isinstance(key, str) else list(key) if isinstance(key, (list, tuple)) else None
    if not keys or any(not isinstance(k, str) or not k for k in keys) or len(set(keys)) != len(keys):
        raise ValueError(f"key must be the name of the key column or a list of distinct names, got {key!r}")
    return keys


def check_key_types(schema, keys: Sequence[str]) -> None:
    """Raises unless every key column is an integer, string, boolean or binary column (other
    types' values have no stable encoding)."""
    for k in keys:
        if type(schema[k].dataType).__name__ not in _ALLOWED:
            raise TypeError(f"key column {k!r} is {schema[k].dataType.simpleString()}; several key columns "
                            f"must be integers, strings, booleans or binary")


def pack_key(values: Sequence[Any]) -> Optional[bytes]:
    """One row's key values -> the stored key (None if any is null)."""
    import msgpack

    vals = []
    for v in values:
        if v is None or (isinstance(v, float) and math.isnan(v)):
            return None
        if hasattr(v, "item"):  # numpy scalars
            v = v.item()
        if isinstance(v, float):
            # no key column is floating point (check_key_types): a float is an integer column
            # that pandas widened for its nulls, and must pack as the integer the rows without
            # nulls pack as
            v = int(v)
        vals.append(bytes(v) if isinstance(v, (bytearray, memoryview)) else v)
    return msgpack.packb(vals, use_bin_type=True)


def pack_columns(columns: Sequence[Any]) -> List[Optional[bytes]]:
    """The stored keys of whole columns (pandas Series or lists of equal length)."""
    lists = [c.tolist() if hasattr(c, "tolist") else list(c) for c in columns]
    return [pack_key(vals) for vals in zip(*lists)]


def unpack_key(stored: bytes) -> tuple:
    """A stored composite key -> the key tuple the processor gets."""
    import msgpack

    return tuple(msgpack.unpackb(stored, raw=False))


def display_key(stored: Any) -> Any:
    """A stored composite key as text for tables: its values as a JSON list, `["ann", 7]`."""
    import json

    if not isinstance(stored, (bytes, bytearray)):
        return stored
    return json.dumps(list(unpack_key(bytes(stored))), default=lambda b: bytes(b).hex())


def parse_display_key(text: str) -> bytes:
    """The stored key of a composite key given as a JSON list (`dstl state show --key '["ann", 7]'`)."""
    import json

    try:
        values = json.loads(text)
    except ValueError:
        values = None
    if not isinstance(values, list) or not values:
        raise ValueError(f"this job has several key columns: give the key as a JSON list such as "
                         f"'[\"ann\", 7]', got {text!r}")
    return pack_key(values)


def job_key_columns(base_path: str, storage_options: Optional[dict] = None) -> Optional[List[str]]:
    """The key columns of the StatefulStream job at `base_path` when it has several, else None."""
    import json

    from dstl.changelog.fs import filesystem
    from dstl.spark.coordinator import JOB_FILE

    try:
        fs, root = filesystem(base_path.rstrip("/"))
        with fs.open(f"{root}/{JOB_FILE}", "rb") as f:
            params = json.loads(f.read().decode()).get("params") or {}
    except Exception:  # noqa: BLE001 - no readable job file (a plain backend's checkpoints): single keys
        return None
    key = params.get("key")
    return list(key) if isinstance(key, list) and len(key) > 1 else None
