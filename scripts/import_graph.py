"""The layer map of dstl, read from the real imports.

Parses every module under dstl/ with `ast` (nothing is imported or run), resolves each import to a
dstl module, assigns every module to a layer (LAYERS, bottom first) and reports:

  python scripts/import_graph.py                  # the Mermaid diagram on stdout
  python scripts/import_graph.py --format dot     # the same as Graphviz DOT (dot -Tsvg > layers.svg)
  python scripts/import_graph.py --check          # list upward imports and cycles; exit 1 if any
  python scripts/import_graph.py --write docs/contributing.md   # refresh the diagram in that page

A module may import only from its own layer or the layers below it, and no modules may import each
other in a circle (function-level and TYPE_CHECKING imports count: see `cycles`). tests/test_layers.py
runs the same checks, and checks that the diagram in docs/contributing.md is the one this script draws.
"""
from __future__ import annotations

import argparse
import ast
import os
import re
import sys
from collections import defaultdict
from functools import lru_cache
from typing import Dict, Iterator, List, NamedTuple, Optional, Set, Tuple

ROOT = os.path.abspath(os.path.join(os.path.dirname(__file__), ".."))
PACKAGE = "dstl"

# (layer, description, module prefixes), bottom first. A module belongs to the layer of the longest
# prefix that matches it ("dstl.a" matches dstl.a and dstl.a.*); EXACT places single modules.
LAYERS: List[Tuple[str, str, List[str]]] = [
    ("errors", "the error types, lazy re-exports", ["dstl.errors", "dstl._lazy"]),
    ("_fast", "Cython kernels and their pure-Python twins", ["dstl._fast"]),
    ("_impl", "picks the Cython module or its twin", ["dstl._impl"]),
    ("foundation", "value types (StateChange from _fast), options, metrics, timers, the runtime directory",
     ["dstl.types", "dstl.config", "dstl.metrics", "dstl._timer", "dstl.runtime_dir"]),
    ("format", "byte format, compression, key-group math", ["dstl.format", "dstl.keygroups"]),
    ("changelog.base", "handles, registry, file systems, checkpoint files", ["dstl.changelog"]),
    ("upload", "scheduler, retries, throttle, uploader, the upload service", ["dstl.changelog.upload"]),
    ("changelog", "writer, storage, reader",
     ["dstl.changelog.writer", "dstl.changelog.storage", "dstl.changelog.reader"]),
    ("state", "keyed and operator state, materialization, checkpoint metadata", ["dstl.state"]),
    ("spark", "the dstl.spark library API", ["dstl.spark"]),
    ("app", "the demo and pipeline application", ["dstl.app"]),
    ("tools", "dstl inspect, dump, gc, state, demo", ["dstl.tools"]),
    ("entry", "the dstl facade and command line", ["dstl.cli", "dstl.__main__"]),
]
EXACT: Dict[str, str] = {"dstl": "entry"}
RANK: Dict[str, int] = {name: i for i, (name, _, _) in enumerate(LAYERS)}


class Import(NamedTuple):
    source: str   # importing module
    target: str   # imported dstl module (a package means its __init__)
    line: int


def module_files(root: str = ROOT) -> Dict[str, str]:
    """Dotted module name -> path, for every .py file of the package (packages as their name)."""
    return dict(_module_files(os.path.abspath(root)))


@lru_cache(maxsize=None)
def _module_files(root: str) -> Tuple[Tuple[str, str], ...]:
    out: Dict[str, str] = {}
    for dirpath, dirnames, filenames in os.walk(os.path.join(root, PACKAGE)):
        dirnames[:] = sorted(d for d in dirnames if not d.startswith((".", "__pycache__")))
        for name in sorted(filenames):
            if not name.endswith(".py"):
                continue
            rel = os.path.relpath(os.path.join(dirpath, name), root)[:-3].split(os.sep)
            if rel[-1] == "__init__":
                rel = rel[:-1]
            out[".".join(rel)] = os.path.join(dirpath, name)
    return tuple(out.items())


def _resolve(name: str, modules: Set[str]) -> str:
    """The longest dstl module that `name` (a.b.c, maybe an attribute path) starts with."""
    parts = name.split(".")
    while parts and ".".join(parts) not in modules:
        parts.pop()
    return ".".join(parts) if parts else name


def imports_of(module: str, path: str, modules: Set[str]) -> Iterator[Import]:
    """Every dstl import in one file, function-level and TYPE_CHECKING imports included."""
    with open(path, encoding="utf-8") as f:
        tree = ast.parse(f.read(), filename=path)
    is_package = os.path.basename(path) == "__init__.py"
    package = module if is_package else module.rpartition(".")[0]
    for node in ast.walk(tree):
        if isinstance(node, ast.Import):
            for alias in node.names:
                # A bare `import dstl` (to find the package's directory) uses nothing of the facade,
                # whose __init__ has run anyway; `from dstl import name` does and is an edge.
                if alias.name.startswith(PACKAGE + "."):
                    yield Import(module, _resolve(alias.name, modules), node.lineno)
        elif isinstance(node, ast.ImportFrom):
            if node.level:
                base = package.split(".")[: len(package.split(".")) - (node.level - 1)]
                origin = ".".join(base + ([node.module] if node.module else []))
            else:
                origin = node.module or ""
            if not (origin == PACKAGE or origin.startswith(PACKAGE + ".")):
                continue
            for alias in node.names:  # `from dstl import format` imports the module dstl.format
                candidate = f"{origin}.{alias.name}"
                target = candidate if candidate in modules else _resolve(origin, modules)
                yield Import(module, target, node.lineno)


def all_imports(root: str = ROOT) -> List[Import]:
    files = module_files(root)
    names = set(files)
    return sorted({imp for m, p in files.items() for imp in imports_of(m, p, names)})


_CY_FROM = re.compile(r"^\s*from\s+(dstl(?:\.\w+)*)\s+c?import\s+\(?([\w\s,]+)")
_CY_IMPORT = re.compile(r"^\s*c?import\s+(dstl(?:\.\w+)+)")


def cython_imports(root: str = ROOT) -> List[Import]:
    """The dstl imports and cimports of the Cython sources (.pyx, and the .pxd a module shares with
    the modules that cimport it), read line by line (`ast` cannot parse Cython). A module's .pxd
    and .pyx are one module: `dstl._fast._buffer`."""
    root = os.path.abspath(root)
    sources: Dict[str, List[str]] = defaultdict(list)
    for dirpath, dirnames, filenames in os.walk(os.path.join(root, PACKAGE)):
        dirnames[:] = sorted(d for d in dirnames if not d.startswith((".", "__pycache__")))
        for name in sorted(filenames):
            if name.endswith((".pyx", ".pxd")):
                rel = os.path.relpath(os.path.join(dirpath, name), root)[:-4].split(os.sep)
                sources[".".join(rel)].append(os.path.join(dirpath, name))
    known = set(module_files(root)) | set(sources)
    out = set()
    for module, paths in sources.items():
        for path in paths:
            with open(path, encoding="utf-8") as f:
                for line_no, line in enumerate(f, 1):
                    m = _CY_FROM.match(line)
                    if m:
                        origin = m.group(1)
                        for name in (n.strip().split()[0] for n in m.group(2).split(",") if n.strip()):
                            candidate = f"{origin}.{name}"
                            out.add(Import(module, candidate if candidate in known else _resolve(origin, known),
                                           line_no))
                        continue
                    m = _CY_IMPORT.match(line)
                    if m:
                        out.add(Import(module, _resolve(m.group(1), known), line_no))
    return sorted(out)


def layer_of(module: str) -> Optional[str]:
    """The layer a module belongs to, or None when no layer claims it."""
    if module in EXACT:
        return EXACT[module]
    best: Optional[Tuple[int, str]] = None
    for name, _, prefixes in LAYERS:
        for prefix in prefixes:
            if module == prefix or module.startswith(prefix + "."):
                if best is None or len(prefix) > best[0]:
                    best = (len(prefix), name)
    return best[1] if best else None


def is_facade_reexport(imp: Import, root: str = ROOT) -> bool:
    """A package's __init__ importing its own submodules re-exports them: not a layer edge."""
    path = module_files(root).get(imp.source, "")
    return path.endswith("__init__.py") and imp.target.startswith(imp.source + ".")


def upward_imports(imports: List[Import], root: str = ROOT) -> List[Import]:
    """Imports from a lower layer into a higher one."""
    out = []
    for imp in imports:
        src, dst = layer_of(imp.source), layer_of(imp.target)
        if src and dst and RANK[dst] > RANK[src] and not is_facade_reexport(imp, root):
            out.append(imp)
    return out


def cycles(imports: List[Import]) -> List[List[str]]:
    """The groups of modules that import each other in a circle (strongly connected components of
    two or more modules), each sorted, in sorted order.

    Every import counts, function-level and TYPE_CHECKING ones too: a lazy import or a type hint
    only defers the dependency, and a circle of them still means neither module can be understood,
    tested or moved without the other."""
    graph: Dict[str, Set[str]] = defaultdict(set)
    for imp in imports:
        if imp.source != imp.target:
            graph[imp.source].add(imp.target)
    # Tarjan's algorithm, iterative (no recursion limit on long chains)
    index: Dict[str, int] = {}
    low: Dict[str, int] = {}
    stack: List[str] = []
    on_stack: Set[str] = set()
    found: List[List[str]] = []
    for root in sorted(graph):
        if root in index:
            continue
        work = [(root, iter(sorted(graph[root])))]
        index[root] = low[root] = len(index)
        stack.append(root)
        on_stack.add(root)
        while work:
            node, children = work[-1]
            child = next(children, None)
            if child is not None:
                if child not in index:
                    index[child] = low[child] = len(index)
                    stack.append(child)
                    on_stack.add(child)
                    work.append((child, iter(sorted(graph.get(child, ())))))
                elif child in on_stack:
                    low[node] = min(low[node], index[child])
                continue
            work.pop()
            if work:
                parent = work[-1][0]
                low[parent] = min(low[parent], low[node])
            if low[node] == index[node]:
                group = []
                while True:
                    member = stack.pop()
                    on_stack.discard(member)
                    group.append(member)
                    if member == node:
                        break
                if len(group) > 1:
                    found.append(sorted(group))
    return sorted(found)


def layer_edges(imports: List[Import], root: str = ROOT) -> Dict[Tuple[str, str], int]:
    """(importing layer, imported layer) -> number of imports, without a layer's own imports."""
    edges: Dict[Tuple[str, str], int] = defaultdict(int)
    for imp in imports:
        src, dst = layer_of(imp.source), layer_of(imp.target)
        if src and dst and src != dst and not is_facade_reexport(imp, root):
            edges[(src, dst)] += 1
    return dict(edges)


def _members(root: str) -> Dict[str, List[str]]:
    members: Dict[str, List[str]] = defaultdict(list)
    for module in module_files(root):
        layer = layer_of(module)
        if layer:
            members[layer].append(module)
    return members


def _short(layer: str, modules: List[str]) -> str:
    """Module names of a layer, shortened: 'writer, storage, reader' or 'dstl.state.*'."""
    prefixes = [p for name, _, ps in LAYERS if name == layer for p in ps]
    if len(prefixes) == 1 and len(modules) > 3:
        return prefixes[0].replace("dstl.", "", 1) + "/"
    return ", ".join(sorted({m.split(".")[-1] for m in modules}))


def mermaid(root: str = ROOT) -> str:
    """A Mermaid flowchart: one node per layer, top layer first, an arrow per importing pair."""
    imports = all_imports(root)
    members = _members(root)
    bad = {(layer_of(i.source), layer_of(i.target)) for i in upward_imports(imports, root)}
    lines = ["flowchart TD"]
    for name, description, _ in reversed(LAYERS):
        if name in members:
            ident = name.replace(".", "_").lstrip("_")
            lines.append(f'    {ident}["<b>{name}</b><br/>{description}<br/><i>{_short(name, members[name])}</i>"]')
    red = []
    for n, ((src, dst), count) in enumerate(sorted(layer_edges(imports, root).items(),
                                                    key=lambda e: (-RANK[e[0][0]], -RANK[e[0][1]]))):
        a, b = src.replace(".", "_").lstrip("_"), dst.replace(".", "_").lstrip("_")
        lines.append(f"    {a} --> {b}")
        if (src, dst) in bad:
            red.append(str(n))
    if red:  # upward imports are drawn in red
        lines.append(f"    linkStyle {','.join(red)} stroke:#d00,stroke-width:3px")
    return "\n".join(lines) + "\n"


def dot(root: str = ROOT) -> str:
    """The same graph in Graphviz DOT."""
    imports = all_imports(root)
    members = _members(root)
    bad = {(layer_of(i.source), layer_of(i.target)) for i in upward_imports(imports, root)}
    lines = ["digraph dstl_layers {", "  rankdir=TB; node [shape=box, fontname=Helvetica];"]
    for name, description, _ in reversed(LAYERS):
        if name in members:
            lines.append(f'  "{name}" [label="{name}\\n{description}\\n{_short(name, members[name])}"];')
    for (src, dst), count in sorted(layer_edges(imports, root).items()):
        colour = ', color="#dd0000", penwidth=3' if (src, dst) in bad else ""
        lines.append(f'  "{src}" -> "{dst}" [tooltip="{count} imports"{colour}];')
    lines.append("}")
    return "\n".join(lines) + "\n"


START, END = "<!-- import-graph:start -->", "<!-- import-graph:end -->"


def embed(text: str, diagram: str) -> str:
    """Replace the fenced Mermaid block between the START and END markers of a Markdown page."""
    head, sep, rest = text.partition(START)
    if not sep or END not in rest:
        raise ValueError(f"the page has no {START} ... {END} markers")
    return f"{head}{START}\n```mermaid\n{diagram}```\n{END}{rest.partition(END)[2]}"


def main(argv: Optional[List[str]] = None) -> int:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--format", choices=("mermaid", "dot"), default="mermaid")
    parser.add_argument("--check", action="store_true", help="list upward imports; exit 1 if any")
    parser.add_argument("--write", metavar="PAGE", help="refresh the diagram between the markers of PAGE")
    args = parser.parse_args(argv)
    if args.check:
        unplaced = sorted(m for m in module_files() if layer_of(m) is None)
        imports = all_imports()
        bad = upward_imports(imports)
        circles = cycles(imports + cython_imports())
        for m in unplaced:
            print(f"{m}: belongs to no layer (add it to LAYERS in scripts/import_graph.py)")
        for imp in bad:
            print(f"{imp.source}:{imp.line}: {layer_of(imp.source)} imports {imp.target} ({layer_of(imp.target)})")
        for group in circles:
            print(f"import cycle: {', '.join(group)}")
        return 1 if bad or unplaced or circles else 0
    diagram = mermaid() if args.format == "mermaid" else dot()
    if args.write:
        with open(args.write, encoding="utf-8") as f:
            text = f.read()
        with open(args.write, "w", encoding="utf-8") as f:
            f.write(embed(text, diagram))
        return 0
    sys.stdout.write(diagram)
    return 0


if __name__ == "__main__":
    sys.exit(main())
