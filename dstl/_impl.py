"""Picks the Cython hot path or its pure-Python twin.

`DSTL_PUREPYTHON=1` forces the twins (as msgpack-python does with MSGPACK_PUREPYTHON); otherwise the
compiled extension is used when it imports, and the twins are the fallback.
"""
from __future__ import annotations

import os

FORCED_PURE = os.environ.get("DSTL_PUREPYTHON", "") not in ("", "0", "false", "False")

if FORCED_PURE:
    IMPLEMENTATION = "python"
else:
    try:
        from dstl._fast import _buffer, _change, _decode, _hash  # noqa: F401

        IMPLEMENTATION = "cython"
    except ImportError:  # not built: fall back to the twins
        IMPLEMENTATION = "python"
