"""Several key columns (`StatefulStream(key=["id1", "id2"])`): one stored key per row.

A composite key is stored as the msgpack encoding of the list of its column values, in the order
the columns were named (``packb(["a", 1], use_bin_type=True)``), and hashes to its key group as that
binary key does (docs/rescaling.md §7). The encoding is deterministic, so the same values always
land in the same key group, at any parallelism. The processor gets the tuple back, as Spark passes
a grouping key. A row with a null in any key column has a null key.
"""
from __future__ import annotations

from typing import Any, List, Sequence

from dstl.state.composite_keys import (display_key, job_key_columns, pack_columns, pack_key,  # noqa: F401
                                       parse_display_key, unpack_key)

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
