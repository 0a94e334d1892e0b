"""The module tables and the size table of docs/contributing.md, read from the tree.

  python scripts/module_tables.py --write docs/contributing.md   # refresh both tables and the layer
                                                                 # diagram (scripts/import_graph.py)
  python scripts/module_tables.py --check docs/contributing.md   # list what differs; exit 1 if any

Each package under dstl/ gets a table of its modules (.py and .pyx), each described by the first
sentence of its docstring; the size table lists every module over LIMIT lines with its count. The
reason a large file is allowed stays hand-written: it is kept, by path, from the page's current table,
and a file without one gets NO_REASON, which tests/test_contributing_tables.py rejects.
"""
from __future__ import annotations

import argparse
import ast
import os
import re
import sys
from collections import defaultdict
from typing import Dict, List, Optional, Tuple

sys.path.insert(0, os.path.dirname(os.path.abspath(__file__)))
import import_graph  # noqa: E402  (the sibling script: --write refreshes its diagram too)

ROOT = os.path.abspath(os.path.join(os.path.dirname(__file__), ".."))
PACKAGE = "dstl"
LIMIT = 500
NO_REASON = "(reason to be written)"
MODULES = ("<!-- module-tables:start -->", "<!-- module-tables:end -->")
SIZES = ("<!-- file-sizes:start -->", "<!-- file-sizes:end -->")
_CYTHON_DOC = re.compile(r'\A(?:\s*#[^\n]*\n)*\s*(?:[rR]?)("""|\'\'\')(.*?)\1', re.S)


def source_files(root: str = ROOT) -> List[str]:
    """Every .py and .pyx file of the package, relative to `root`, sorted by package then name."""
    out = []
    for dirpath, dirnames, filenames in os.walk(os.path.join(root, PACKAGE)):
        dirnames[:] = sorted(d for d in dirnames if not d.startswith((".", "__pycache__")))
        out.extend(os.path.relpath(os.path.join(dirpath, n), root).replace(os.sep, "/")
                   for n in filenames if n.endswith((".py", ".pyx")))
    return sorted(out, key=lambda p: (os.path.dirname(p), os.path.basename(p)))


def summary(path: str, root: str = ROOT) -> str:
    """The first sentence of a module's docstring, on one line ("" without one). A .pyx is read as
    text (`ast` cannot parse Cython): its docstring is the first triple-quoted string."""
    with open(os.path.join(root, path), encoding="utf-8") as f:
        text = f.read()
    if path.endswith(".py"):
        doc = ast.get_docstring(ast.parse(text, filename=path)) or ""
    else:
        m = _CYTHON_DOC.match(text)
        doc = m.group(2) if m else ""
    paragraph = " ".join(doc.strip().split("\n\n")[0].split())
    m = re.match(r"(.+?[.!?])(\s|$)", paragraph)
    sentence = m.group(1) if m else paragraph
    return sentence.replace("|", "\\|")


def line_count(path: str, root: str = ROOT) -> int:
    with open(os.path.join(root, path), encoding="utf-8") as f:
        return sum(1 for _ in f)


def module_tables(root: str = ROOT) -> str:
    """One Markdown table per package directory: module file and what it holds."""
    by_dir: Dict[str, List[str]] = defaultdict(list)
    for path in source_files(root):
        by_dir[os.path.dirname(path)].append(path)
    parts = []
    for directory in sorted(by_dir):
        parts.append(f"**`{directory}/`**\n\n| module | what it holds |\n|---|---|")
        for path in by_dir[directory]:
            parts.append(f"| `{os.path.basename(path)}` | {summary(path, root) or '-'} |")
        parts.append("")
    return "\n".join(parts)


_SIZE_ROW = re.compile(r"^\| `([^`]+)` \| (\d+) \| (.*) \|$")


def reasons(page_text: str) -> Dict[str, str]:
    """path -> the hand-written reason, from the size table between the SIZES markers of a page."""
    body = _between(page_text, SIZES)
    return {m.group(1): m.group(3) for m in map(_SIZE_ROW.match, body.splitlines()) if m}


def size_table(known: Dict[str, str], root: str = ROOT) -> str:
    """The files over LIMIT lines, largest first, each with its reason from `known` (or NO_REASON)."""
    big = sorted(((line_count(p, root), p) for p in source_files(root)), key=lambda e: (-e[0], e[1]))
    rows = ["| file | lines | why |", "|---|---|---|"]
    rows += [f"| `{p}` | {n} | {known.get(p, NO_REASON)} |" for n, p in big if n > LIMIT]
    return "\n".join(rows) + "\n"


def _between(text: str, markers: Tuple[str, str]) -> str:
    start, end = markers
    head, sep, rest = text.partition(start)
    if not sep or end not in rest:
        raise ValueError(f"the page has no {start} ... {end} markers")
    return rest.partition(end)[0]


def _replace(text: str, markers: Tuple[str, str], body: str) -> str:
    _between(text, markers)
    start, end = markers
    head, _, rest = text.partition(start)
    return f"{head}{start}\n{body}{end}{rest.partition(end)[2]}"


def refreshed(page_text: str, root: str = ROOT) -> str:
    """The page with both tables as the tree has them now."""
    text = _replace(page_text, MODULES, module_tables(root))
    return _replace(text, SIZES, size_table(reasons(page_text), root))


def differences(page_text: str, root: str = ROOT) -> List[str]:
    """The table lines the page has and the tree does not ('-'), and the other way round ('+')."""
    out = []
    for markers in (MODULES, SIZES):
        have = _between(page_text, markers).splitlines()
        want = _between(refreshed(page_text, root), markers).splitlines()
        out += [f"- {line}" for line in have if line not in want]
        out += [f"+ {line}" for line in want if line not in have]
    return out


def main(argv: Optional[List[str]] = None, root: str = ROOT) -> int:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    group = parser.add_mutually_exclusive_group(required=True)
    group.add_argument("--write", metavar="PAGE", help="refresh the tables between the markers of PAGE")
    group.add_argument("--check", metavar="PAGE", help="list what differs from the tree; exit 1 if any")
    args = parser.parse_args(argv)
    page = args.write or args.check
    with open(page, encoding="utf-8") as f:
        text = f.read()
    if args.check:
        diff = differences(text, root)
        print("\n".join(diff) if diff else f"{page}: the tables match the tree")
        return 1 if diff else 0
    text = refreshed(text, root)
    if import_graph.START in text:
        text = import_graph.embed(text, import_graph.mermaid(root))
    with open(page, "w", encoding="utf-8") as f:
        f.write(text)
    return 0


if __name__ == "__main__":
    sys.exit(main())
