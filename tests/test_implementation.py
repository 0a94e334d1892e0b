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
        for name in _impl.MODULES:
            importlib.import_module(f"dstl._fast.{name}")
    else:
        assert _impl.FORCED_PURE


def test_every_facade_uses_the_selected_module():
    """One selector (`_impl.kernel`) picks every Cython module or its twin beside it."""
    from dstl import format as fmt, keygroups
    from dstl.state import columns

    suffix = "" if expected_implementation() == "cython" else "_py"
    assert fmt.ChangeBuffer.__module__ == f"dstl._fast._buffer{suffix}"
    assert type(fmt.ChangeBuffer().seal_body()).__module__ == f"dstl._fast._sealed{suffix}"
    assert fmt.WriterCore.__module__ == f"dstl._fast._writer{suffix}"
    assert fmt.write_bodies.__module__ == fmt.write_bodies_at.__module__ == f"dstl._fast._filewrite{suffix}"
    assert fmt.spare_bytes.__module__ == fmt.release_spares.__module__ == f"dstl._fast._spares{suffix}"
    assert fmt.decode_change_set.__module__ == f"dstl._fast._decode{suffix}"
    assert keygroups._kernels.__name__ == f"dstl._fast._hash{suffix}"
    assert columns._kernel.__name__ == f"dstl._fast._statecols{suffix}"
    for name in _impl.MODULES:
        assert _impl.kernel(name).__name__ == f"dstl._fast.{name}{suffix}"


def test_no_stale_build_outside_the_listed_modules():
    """Every compiled module in dstl/_fast has its .pyx there and is listed in `_impl.MODULES`: a
    stale build of a module that was split or renamed (an old `_buffer` holding what now lives in
    `_sealed`, `_filewrite` and `_writer`) cannot stand in for a missing one unnoticed."""
    import glob
    import os

    here = os.path.join(os.path.dirname(_impl.__file__), "_fast")
    built = {os.path.basename(p).split(".")[0] for p in glob.glob(os.path.join(here, "*.so"))
             + glob.glob(os.path.join(here, "*.pyd"))}
    assert built <= set(_impl.MODULES), f"compiled modules without a listed .pyx: {sorted(built - set(_impl.MODULES))}"
    if expected_implementation() == "cython":
        assert built == set(_impl.MODULES)


def test_every_cython_module_has_a_twin_file_beside_it():
    import glob
    import os

    here = os.path.dirname(_impl.__file__)
    pyx = sorted(os.path.basename(p)[:-4] for p in glob.glob(os.path.join(here, "_fast", "*.pyx")))
    assert pyx == sorted(_impl.MODULES)
    for name in pyx:
        assert os.path.isfile(os.path.join(here, "_fast", f"{name}_py.py")), name


def test_subpackages_are_attributes_of_dstl():
    import subprocess
    import sys

    code = ("import dstl; from dstl.types import StateChange; "
            "print(dstl.format.decode_file.__name__, dstl.state.__name__, dstl.spark.__name__, "
            "dstl.keygroups.assign_to_key_group(1, 128))")
    out = subprocess.run([sys.executable, "-c", code], capture_output=True, text=True, check=True)
    assert out.stdout.split() == ["decode_file", "dstl.state", "dstl.spark", str(dstl.keygroups.assign_to_key_group(1, 128))]


def test_every_cython_module_has_a_type_stub():
    import os

    here = os.path.join(os.path.dirname(_impl.__file__), "_fast")
    missing = [m for m in _impl.MODULES if not os.path.isfile(os.path.join(here, f"{m}.pyi"))]
    assert missing == []
