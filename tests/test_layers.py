"""The layer rules of docs/contributing.md hold in the real imports, and its diagram is current.

The imports are read with `ast` by scripts/import_graph.py (nothing is imported), function-level and
TYPE_CHECKING imports included; no modules may import each other in a circle.
"""
from __future__ import annotations

import importlib.util
import os
import warnings

import pytest

ROOT = os.path.abspath(os.path.join(os.path.dirname(__file__), ".."))


def _load_script():
    spec = importlib.util.spec_from_file_location("import_graph", os.path.join(ROOT, "scripts", "import_graph.py"))
    module = importlib.util.module_from_spec(spec)
    spec.loader.exec_module(module)
    return module


graph = _load_script()
IMPORTS = graph.all_imports(ROOT)
CYTHON_IMPORTS = graph.cython_imports(ROOT)  # .pyx/.pxd imports and cimports, read line by line


def _from(prefix: str):
    return [i for i in IMPORTS if i.source == prefix or i.source.startswith(prefix + ".")]


def _into(imports, *prefixes: str):
    return [f"{i.source}:{i.line} imports {i.target}" for i in imports
            if any(i.target == p or i.target.startswith(p + ".") for p in prefixes)]


def test_the_scan_sees_the_package():
    """Guards the other tests against passing on an empty or mis-resolved scan."""
    modules = graph.module_files(ROOT)
    assert len(modules) > 40 and "dstl.state" in modules
    assert any(i.source.startswith("dstl.state.") and i.target.startswith("dstl.changelog.") for i in IMPORTS)
    assert any(i.target.startswith("dstl._fast.") for i in IMPORTS)


def test_every_module_belongs_to_a_layer():
    unplaced = sorted(m for m in graph.module_files(ROOT) if graph.layer_of(m) is None)
    assert not unplaced, f"add these to LAYERS in scripts/import_graph.py: {unplaced}"


# Upward imports that exist on main and are being removed by open work, as (importer, imported).
# Only these exact pairs are tolerated; delete an entry once its import is gone (a warning says so).
KNOWN_VIOLATIONS: set = set()  # issue 9's two (registry_proc -> state.metadata, tools.gc) are gone


def _known(imp) -> bool:
    return (imp.source, imp.target) in KNOWN_VIOLATIONS


def test_no_upward_imports():
    upward = graph.upward_imports(IMPORTS, ROOT)
    bad = [f"{i.source}:{i.line} ({graph.layer_of(i.source)}) imports {i.target} ({graph.layer_of(i.target)})"
           for i in upward if not _known(i)]
    assert not bad, "imports must point down the layers:\n" + "\n".join(bad)
    gone = KNOWN_VIOLATIONS - {(i.source, i.target) for i in upward}
    if gone:
        warnings.warn(f"remove from KNOWN_VIOLATIONS in tests/test_layers.py, they are fixed: {sorted(gone)}")


def test_the_cython_scan_sees_the_cimports():
    """Guards the cycle check against passing on an empty or mis-resolved Cython scan."""
    pairs = {(i.source, i.target) for i in CYTHON_IMPORTS}
    assert ("dstl._fast._writer", "dstl._fast._buffer") in pairs      # cimport ChangeBuffer
    assert ("dstl._fast._keyed", "dstl._fast._writer") in pairs       # cimport WriterCore
    assert ("dstl._fast._buffer", "dstl._fast._buffer_common") in pairs
    assert ("dstl._fast._sealed", "dstl._fast._cutil") in pairs       # a .pxd-only module


def test_fast_knows_nothing_above_the_format_twins():
    """The kernels may use each other, their twins and the error types only."""
    bad = [f"{i.source}:{i.line} imports {i.target}" for i in _from("dstl._fast") + CYTHON_IMPORTS
           if not (i.target.startswith("dstl._fast") or i.target == "dstl.errors")]
    assert not bad, "\n".join(bad)


def test_upload_imports_neither_tools_nor_state():
    imports = [i for i in _from("dstl.changelog.upload") if not _known(i)]
    bad = _into(imports, "dstl.tools", "dstl.state", "dstl.spark", "dstl.app")
    assert not bad, "\n".join(bad)


def test_the_spark_library_does_not_import_the_application():
    bad = _into(_from("dstl.spark"), "dstl.app")
    assert not bad, "\n".join(bad)


def test_the_rules_catch_a_violation(tmp_path):
    """The checker itself: a planted upward import and a planted app import are both reported."""
    pkg = tmp_path / "dstl"
    for sub in ("", "state", "spark", "app", "changelog", "changelog/upload"):
        (pkg / sub).mkdir(parents=True, exist_ok=True)
        (pkg / sub / "__init__.py").write_text("")
    (pkg / "types.py").write_text("from dstl.state import backend\n")
    (pkg / "state" / "backend.py").write_text("from dstl import types\n")
    (pkg / "spark" / "keyed.py").write_text("from ..app import pipeline\n")
    (pkg / "app" / "pipeline.py").write_text("import dstl.spark.keyed\n")
    (pkg / "changelog" / "upload" / "task.py").write_text("def f():\n    from dstl.state.backend import x\n")
    imports = graph.all_imports(str(tmp_path))
    bad = {(i.source, i.target) for i in graph.upward_imports(imports, str(tmp_path))}
    assert bad == {("dstl.types", "dstl.state.backend"), ("dstl.spark.keyed", "dstl.app.pipeline"),
                   ("dstl.changelog.upload.task", "dstl.state.backend")}


def test_no_import_cycles():
    """No dstl modules import each other in a circle.

    Function-level and TYPE_CHECKING imports count (the scan reads them all): a lazy import or a
    type-hint import does not run at import time, but it is still a dependency, and a circle of
    them means the modules cannot be read, tested or moved apart. Where a lower module needs to
    name a higher one's type, it names a Protocol below both instead (dstl.state.host.StateHost
    for the keyed state kinds and their backend)."""
    circles = graph.cycles(IMPORTS + CYTHON_IMPORTS)
    assert not circles, "modules that import each other in a circle:\n" + "\n".join(
        ", ".join(group) for group in circles)


def test_the_cycle_check_catches_a_cycle(tmp_path):
    """The checker itself: a circle closed by a TYPE_CHECKING import, one closed by a function-level
    import, a three-module circle and a cimport circle between a .pyx and a .pxd are reported; a
    one-way chain and a self-import are not."""
    pkg = tmp_path / "dstl"
    (pkg / "state").mkdir(parents=True)
    (pkg / "__init__.py").write_text("")
    (pkg / "state" / "__init__.py").write_text("")
    (pkg / "state" / "backend.py").write_text("from dstl.state.base import State\n")
    (pkg / "state" / "base.py").write_text(
        "from typing import TYPE_CHECKING\nif TYPE_CHECKING:\n    from dstl.state.backend import Backend\n")
    (pkg / "state" / "lazy_a.py").write_text("from dstl.state import lazy_b\n")
    (pkg / "state" / "lazy_b.py").write_text("def f():\n    from . import lazy_a\n")
    (pkg / "state" / "x.py").write_text("import dstl.state.y\n")
    (pkg / "state" / "y.py").write_text("from .z import thing\n")
    (pkg / "state" / "z.py").write_text("from dstl.state.x import other\n")
    (pkg / "state" / "chain.py").write_text("from dstl.state import backend\nfrom dstl.state import chain\n")
    (pkg / "_fast").mkdir()
    (pkg / "_fast" / "__init__.py").write_text("")
    (pkg / "_fast" / "_a.pyx").write_text("from dstl._fast._b cimport B, helper\n")
    (pkg / "_fast" / "_b.pxd").write_text("from dstl._fast._a cimport A\n")
    (pkg / "_fast" / "_c.pyx").write_text("from dstl._fast._a cimport A\nimport dstl._fast._b\n")
    imports = graph.all_imports(str(tmp_path)) + graph.cython_imports(str(tmp_path))
    assert graph.cycles(imports) == [
        ["dstl._fast._a", "dstl._fast._b"],
        ["dstl.state.backend", "dstl.state.base"],
        ["dstl.state.lazy_a", "dstl.state.lazy_b"],
        ["dstl.state.x", "dstl.state.y", "dstl.state.z"],
    ]


@pytest.mark.parametrize("page", ["docs/contributing.md"])
def test_the_diagram_in_the_docs_is_current(page):
    with open(os.path.join(ROOT, page), encoding="utf-8") as f:
        text = f.read()
    assert graph.embed(text, graph.mermaid(ROOT)) == text, (
        f"the layer diagram in {page} is stale: run `python scripts/import_graph.py --write {page}`")


def test_the_script_draws_dot_and_mermaid():
    import subprocess
    import sys

    script = os.path.join(ROOT, "scripts", "import_graph.py")
    out = subprocess.run([sys.executable, script, "--format", "dot"], capture_output=True, text=True, check=True).stdout
    assert out.startswith("digraph") and all(f'"{name}" [label=' in out for name, _, _ in graph.LAYERS)
    mermaid = subprocess.run([sys.executable, script], capture_output=True, text=True, check=True).stdout
    assert mermaid == graph.mermaid(ROOT) and "state --> changelog_base" in mermaid
