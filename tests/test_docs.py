"""The documentation works: every ```python example in README.md and docs/*.md runs, prints what it
promises, and every relative link and #anchor between the pages resolves.

Conventions (docs/contributing.md, "Writing docs"):
- a block fenced ```python runs as a script, from a fresh temporary working directory, under the
  implementation of this run (`make test` runs the suite with Cython and with DSTL_PUREPYTHON=1);
- a block fenced ```python no-run is shown but not run (reported as skipped);
- output shown as `print(...)  # <output>`, or as `# <output>` lines right under a print, is compared
  with what the block prints; text after the output, separated by " (", ": " or two spaces, is a
  remark.
"""
from __future__ import annotations

import glob
import os
import re
import subprocess
import sys
from typing import Dict, List, NamedTuple, Set

import pytest

from conftest import heavy

ROOT = os.path.abspath(os.path.join(os.path.dirname(__file__), ".."))
PAGES = ["README.md"] + sorted(os.path.relpath(p, ROOT) for p in glob.glob(os.path.join(ROOT, "docs", "*.md")))
# Pages and charts that other work adds: links to them are checked once they exist.
PENDING = {"docs/service.md", "docs/streaming.md", "docs/state-as-data.md", "docs/hot-paths.md",
           "bench/results/flink.png"}
FENCE = re.compile(r"^```([^\n`]*)\n(.*?)^```[ \t]*$", re.M | re.S)


class Block(NamedTuple):
    page: str
    index: int
    heading: str
    info: str   # the fence's info string: "python", "python no-run", "sh", ...
    code: str

    @property
    def id(self) -> str:
        return f"{self.page}#{self.index}-{self.heading[:30]}"


def _read(page: str) -> str:
    with open(os.path.join(ROOT, page), encoding="utf-8") as f:
        return f.read()


def blocks(page: str) -> List[Block]:
    text = _read(page)
    out = []
    for i, m in enumerate(FENCE.finditer(text)):
        outside = FENCE.sub("", text[: m.start()])
        headings = re.findall(r"^#{1,6} (.+)$", outside, re.M)
        out.append(Block(page, i, headings[-1] if headings else "top", m.group(1).strip(), m.group(2)))
    return out


ALL_BLOCKS = [b for page in PAGES for b in blocks(page)]
PYTHON = [b for b in ALL_BLOCKS if b.info.split()[:1] == ["python"]]


def promised_output(code: str) -> List[str]:
    """The output a block shows in comments next to its print calls."""
    promised: List[str] = []
    lines = code.splitlines()
    for n, line in enumerate(lines):
        if not re.match(r"\s*print\(", line):
            continue
        inline = re.search(r"\)\s+# (.*)$", line)
        if inline:
            promised.append(inline.group(1))
            continue
        for below in lines[n + 1:]:
            m = re.match(r"# (.*)$", below)
            if not m:
                break
            promised.append(m.group(1))
    return promised


def _matches(printed: str, promised: str) -> bool:
    if printed == promised:
        return True
    rest = promised[len(printed):] if promised.startswith(printed) else None
    return rest is not None and re.match(r"(\s+\(|:\s|\s{2,})", rest) is not None


def _starts_spark(code: str) -> bool:
    return any(word in code for word in ("pyspark", "SparkSession", "StatefulStream"))


def _run(code: str, tmp_path) -> subprocess.CompletedProcess:
    script = tmp_path / "example.py"
    script.write_text(code, encoding="utf-8")
    env = dict(os.environ, PYTHONPATH=ROOT, TMPDIR=str(tmp_path), PYSPARK_PYTHON=sys.executable,
               SPARK_LOCAL_IP="127.0.0.1")
    return subprocess.run([sys.executable, str(script)], capture_output=True, text=True, env=env,
                          timeout=600, cwd=str(tmp_path))


# an example that starts Spark is heavy: outside the fast tier, and run once, under the Cython build
# (the twins are tested on their own)
EXAMPLES = [pytest.param(b, id=b.id, marks=[heavy] if _starts_spark(b.code) else []) for b in PYTHON]


@pytest.mark.parametrize("block", EXAMPLES)
def test_example_runs_and_prints_what_it_promises(block: Block, tmp_path):
    if "no-run" in block.info.split()[1:]:
        pytest.skip(f"fenced `{block.info}`: shown, not run")
    proc = _run(block.code, tmp_path)
    assert proc.returncode == 0, f"example under '{block.heading}' in {block.page} failed:\n{proc.stderr[-3000:]}"
    promised = promised_output(block.code)
    if promised:
        printed = proc.stdout.splitlines()
        assert len(printed) == len(promised) and all(map(_matches, printed, promised)), (
            f"example under '{block.heading}' in {block.page} printed\n{proc.stdout}\nbut promises\n"
            + "\n".join(promised))


def test_fences_use_known_info_strings():
    """A typo such as ```pyhton or ```python norun would silently skip an example."""
    odd = [f"{b.page}: ```{b.info}" for b in ALL_BLOCKS
           if b.info.lower().startswith(("py", "pt")) and b.info not in ("python", "python no-run")]
    assert not odd, odd


def test_the_conventions_hold_on_a_sample():
    code = 'x = 1\nprint(x)  # 1 (one)\nprint([x])\n# [1]: a list\nprint("a")\n\n# not output\n'
    assert promised_output(code) == ["1 (one)", "[1]: a list"]
    assert _matches("1", "1 (one)") and _matches("[1]", "[1]: a list") and _matches("5 18 66", "5 18 66")
    assert not _matches("1", "12") and not _matches("[1]", "[1, 2]")
    sample = "# t\n\n## A\n\n```python no-run\nprint(1)\n```\n\n```sh\nmake test\n```\n"
    found = [(m.group(1), m.group(2)) for m in FENCE.finditer(sample)]
    assert found == [("python no-run", "print(1)\n"), ("sh", "make test\n")]


def test_there_are_examples_for_every_layer():
    pages = {b.page for b in PYTHON if "no-run" not in b.info}
    assert {"README.md", "docs/format.md", "docs/storage.md", "docs/state.md", "docs/spark.md",
            "docs/options.md", "docs/rescaling.md"} <= pages


# --- the front door -----------------------------------------------------------------------------

def test_readme_is_a_short_front_door():
    lines = _read("README.md").splitlines()
    assert len(lines) <= 300, f"README.md has {len(lines)} lines; move detail into docs/"
    top = "\n".join(lines[:12])
    assert "make demo" in top and "make test" in top


def test_readme_links_every_docs_page():
    readme = _read("README.md")
    missing = [p for p in PAGES[1:] if f"({p})" not in readme and f"({p}#" not in readme]
    assert not missing, f"README.md does not link {missing}"


# --- links and anchors ---------------------------------------------------------------------------

def slug(heading: str) -> str:
    """The anchor GitHub gives a heading."""
    text = re.sub(r"<[^>]+>", "", heading).strip().lower()
    text = re.sub(r"[^\w\- ]", "", text)
    return text.replace(" ", "-")


def anchors(page: str) -> Set[str]:
    seen: Dict[str, int] = {}
    out = set()
    for heading in re.findall(r"^#{1,6} (.+?)\s*#*$", FENCE.sub("", _read(page)), re.M):
        base = slug(heading)
        n = seen.get(base, 0)
        seen[base] = n + 1
        out.add(base if n == 0 else f"{base}-{n}")
    return out


def links(page: str) -> List[str]:
    text = FENCE.sub("", _read(page))
    text = re.sub(r"`[^`\n]*`", "", text)  # inline code is not a link
    return re.findall(r"!?\[[^\]]*\]\(([^)\s]+)\)", text)


LINKS = [(page, target) for page in PAGES for target in links(page)
         if not re.match(r"[a-z]+:", target)]


def test_pages_have_links_to_check():
    assert len(LINKS) > 30


@pytest.mark.parametrize("page, target", LINKS, ids=[f"{p}->{t}" for p, t in LINKS])
def test_link_resolves(page, target):
    path, _, anchor = target.partition("#")
    resolved = os.path.normpath(os.path.join(os.path.dirname(page), path)) if path else page
    if not os.path.exists(os.path.join(ROOT, resolved)):
        if resolved in PENDING:
            pytest.skip(f"{resolved} lands with other work")
        pytest.fail(f"{page} links to {target}, but {resolved} does not exist")
    if anchor:
        assert resolved.endswith(".md"), f"{page}: an anchor into a non-Markdown file: {target}"
        assert anchor in anchors(resolved), f"{page} links to {target}: {resolved} has no heading #{anchor}"


def test_slugs_follow_github():
    assert slug("5. Operator (non-keyed) state redistribution (FLIP-8)") == "5-operator-non-keyed-state-redistribution-flip-8"
    assert slug("Change payloads (`dstl.state.changes`)") == "change-payloads-dstlstatechanges"
    assert slug("Side by side with Flink's DSTL") == "side-by-side-with-flinks-dstl"


# --- references from the code ------------------------------------------------------------------

def _code_references():
    """(file, page, section or '') for every 'docs/<page>.md §N' in the code, tests and benchmarks."""
    refs = []
    for pattern in ("dstl/**/*.py", "dstl/**/*.pyx", "dstl/**/*.pyi", "tests/**/*.py", "bench/**/*.py", "scripts/*.py"):
        for path in glob.glob(os.path.join(ROOT, pattern), recursive=True):
            with open(path, encoding="utf-8") as f:
                text = f.read()
            for m in re.finditer(r"docs/([\w.-]+\.md)(?:,? §(\d+))?", text):
                refs.append((os.path.relpath(path, ROOT), "docs/" + m.group(1), m.group(2) or ""))
    return refs


def test_code_references_point_to_existing_sections():
    refs = _code_references()
    assert len(refs) > 50, "the docstrings cite docs/<page>.md §N; did the pattern change?"
    bad = []
    for path, page, section in refs:
        if page in PENDING and not os.path.exists(os.path.join(ROOT, page)):
            continue
        if not os.path.exists(os.path.join(ROOT, page)):
            bad.append(f"{path}: {page} does not exist")
        elif section and not re.search(rf"^## {section}\. ", _read(page), re.M):
            bad.append(f"{path}: {page} has no section §{section}")
    assert not bad, "\n".join(sorted(set(bad)))
