"""docs/contributing.md's module tables and size table are the tree's (scripts/module_tables.py)."""
from __future__ import annotations

import importlib.util
import os
import subprocess
import sys

import pytest

ROOT = os.path.abspath(os.path.join(os.path.dirname(__file__), ".."))
PAGE = "docs/contributing.md"
SCRIPT = os.path.join(ROOT, "scripts", "module_tables.py")


def _load_script():
    spec = importlib.util.spec_from_file_location("module_tables", SCRIPT)
    module = importlib.util.module_from_spec(spec)
    spec.loader.exec_module(module)
    return module


tables = _load_script()


def _page() -> str:
    with open(os.path.join(ROOT, PAGE), encoding="utf-8") as f:
        return f.read()


def test_the_tables_in_the_docs_are_the_trees():
    diff = tables.differences(_page(), ROOT)
    assert not diff, (f"the module or size tables in {PAGE} differ from the tree ('-' the page, '+' the "
                      f"tree); run `python scripts/module_tables.py --write {PAGE}`:\n" + "\n".join(diff))


def test_every_large_file_says_why_it_is_large():
    missing = [p for p, why in tables.reasons(_page()).items() if why == tables.NO_REASON or not why.strip()]
    assert not missing, f"give these files over {tables.LIMIT} lines a reason in {PAGE}: {missing}"


def _tree(tmp_path, files):
    for rel, text in files.items():
        path = tmp_path / rel
        path.parent.mkdir(parents=True, exist_ok=True)
        path.write_text(text, encoding="utf-8")
    return str(tmp_path)


PAGE_TEXT = ("# page\n<!-- file-sizes:start -->\n| file | lines | why |\n|---|---|---|\n"
             "| `dstl/big.py` | 3 | it is a table |\n<!-- file-sizes:end -->\n"
             "<!-- module-tables:start -->\n<!-- module-tables:end -->\nafter\n")


def test_a_new_module_a_grown_file_and_a_changed_docstring_are_each_named(tmp_path):
    big = '"""A big module.\n\nMore."""\n' + "x = 1\n" * 600
    root = _tree(tmp_path, {
        "dstl/__init__.py": '"""The package: its facade. Second sentence."""\n',
        "dstl/big.py": big,
        "dstl/sub/__init__.py": "",
        "dstl/sub/kern.pyx": '# cython: language_level=3\n"""Cython kernel | fast.\n"""\ncdef int x = 1\n',
    })
    page = tables.refreshed(PAGE_TEXT, root)
    assert page.endswith("<!-- module-tables:end -->\nafter\n")
    assert "| `dstl/big.py` | 603 | it is a table |" in page        # the count is the tree's, the reason kept
    assert "| `__init__.py` | The package: its facade. |" in page  # the first sentence only
    assert "| `kern.pyx` | Cython kernel \\| fast. |" in page         # a .pyx docstring, a pipe escaped
    assert "| `__init__.py` | - |" in page                          # no docstring
    assert tables.differences(page, root) == []

    (tmp_path / "dstl" / "sub" / "new.py").write_text('"""A new module."""\n' + "y = 2\n" * 501)
    (tmp_path / "dstl" / "__init__.py").write_text('"""The facade, renamed."""\n')
    assert sorted(tables.differences(page, root)) == sorted([
        "+ | `new.py` | A new module. |",
        "- | `__init__.py` | The package: its facade. |",
        "+ | `__init__.py` | The facade, renamed. |",
        f"+ | `dstl/sub/new.py` | 502 | {tables.NO_REASON} |",
    ])

    # the command line: --check names the differences and fails, --write makes them agree
    page_path = tmp_path / "page.md"
    page_path.write_text(page, encoding="utf-8")
    assert tables.main(["--check", str(page_path)], root) == 1
    assert tables.main(["--write", str(page_path)], root) == 0
    assert tables.main(["--check", str(page_path)], root) == 0


def test_a_page_without_the_markers_is_refused():
    with pytest.raises(ValueError, match="the page has no <!-- module-tables:start -->"):
        tables.refreshed("# no markers\n", ROOT)


def test_the_script_checks_the_real_page():
    proc = subprocess.run([sys.executable, SCRIPT, "--check", os.path.join(ROOT, PAGE)],
                          capture_output=True, text=True)
    assert proc.returncode == 0, proc.stdout + proc.stderr
    assert "the tables match the tree" in proc.stdout
