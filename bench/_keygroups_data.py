"""Benchmark inputs for key-group assignment (keygroups_report.py)."""
from __future__ import annotations

import importlib
from typing import Dict

import numpy as np
import pyarrow as pa
import pyarrow.compute as pc


def int_keys(n: int, seed: int = 1) -> np.ndarray:
    """n int64 keys; a quarter fit in int32 (Integer rule), the rest need the Long rule."""
    rng = np.random.default_rng(seed)
    keys = rng.integers(-(2**62), 2**62, size=n, dtype=np.int64)
    keys[: n // 4] = rng.integers(-(2**31), 2**31, size=n // 4)
    return keys


def string_keys(n: int) -> pa.Array:
    """n distinct keys like 'user-123456' as an Arrow string column; every 10th is non-ASCII."""
    ids = pa.array(np.arange(n, dtype=np.int64)).cast(pa.string())
    prefix = np.where(np.arange(n) % 10 == 0, "ключ-😀-", "user-")
    return pc.binary_join_element_wise(pa.array(prefix), ids, "")


def kernels() -> Dict[str, object]:
    """The implementations available here: the Cython module (if built) and the pure-Python twin."""
    out = {}
    try:
        out["cython"] = importlib.import_module("dstl._fast._hash")
    except ImportError:
        pass
    out["python"] = importlib.import_module("dstl._fast._hash_py")
    return out
