"""Composite keys as stored: the msgpack list of a row's key column values (docs/rescaling.md §7).

Below the Spark layer because the state readers show such keys as their values; dstl.spark.keys
(the columns, their types) re-exports these.
"""
from __future__ import annotations

import math
from typing import Any, List, Optional, Sequence

__all__ = ["JOB_FILE", "pack_key", "pack_columns", "unpack_key", "display_key", "parse_display_key",
           "job_key_columns"]

#: a StatefulStream or StatefulJob's job file below its base path (dstl.spark.coordinator writes it)
JOB_FILE = "_dstl_job.json"


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

    try:
        fs, root = filesystem(base_path.rstrip("/"))
        with fs.open(f"{root}/{JOB_FILE}", "rb") as f:
            params = json.loads(f.read().decode()).get("params") or {}
    except Exception:  # noqa: BLE001 - no readable job file (a plain backend's checkpoints): single keys
        return None
    key = params.get("key")
    return list(key) if isinstance(key, list) and len(key) > 1 else None
