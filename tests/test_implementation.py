"""The suite runs twice (Cython, then DSTL_PUREPYTHON=1): assert which implementation is loaded."""
import importlib

import dstl
from dstl import _impl

from conftest import expected_implementation


def test_the_expected_implementation_is_loaded():
    assert dstl.IMPLEMENTATION == expected_implementation()


def test_cython_extension_is_built_when_expected():
    if expected_implementation() == "cython":
        # the extension must really be importable, not a silent fallback
        for name in ("_buffer", "_decode", "_hash"):
            importlib.import_module(f"dstl._fast.{name}")
    else:
        assert _impl.FORCED_PURE
