"""Picks the Cython hot path or its pure-Python twins: the one place that decides.

Every module in `dstl/_fast/` comes as `<name>.pyx` (compiled) beside `<name>_py.py` (its twin, byte-
identical results). `DSTL_PUREPYTHON=1` forces the twins (as msgpack-python does with
MSGPACK_PUREPYTHON); otherwise the compiled modules are used when every one of them imports, and the
twins are the fallback. `kernel(name)` returns the chosen module. Pure-Python helpers that both
sides share (`_buffer_common.py`, as fastavro's `_read_common.py`) have no twin and are not listed.
"""
from __future__ import annotations

import importlib
import os
from types import ModuleType

# bottom first: a module may cimport those before it
MODULES = ("_spares", "_sealed", "_buffer", "_filewrite", "_writer", "_change", "_decode", "_hash", "_keyed",
           "_statecols")

FORCED_PURE = os.environ.get("DSTL_PUREPYTHON", "") not in ("", "0", "false", "False")


def _probe() -> str:
    try:
        for name in MODULES:
            importlib.import_module(f"dstl._fast.{name}")
    except ImportError:  # not built (or a stale build): fall back to the twins
        return "python"
    return "cython"


IMPLEMENTATION = "python" if FORCED_PURE else _probe()


def kernel(name: str) -> ModuleType:
    """`dstl._fast.<name>` under the Cython build, else its twin `dstl._fast.<name>_py`."""
    if name not in MODULES:
        raise ValueError(f"unknown kernel module {name!r}; expected one of {MODULES}")
    suffix = "" if IMPLEMENTATION == "cython" else "_py"
    return importlib.import_module(f"dstl._fast.{name}{suffix}")
