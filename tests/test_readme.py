"""Every ```python example in README.md runs as a script; the keyed-state guide prints what it promises."""
from __future__ import annotations

import os
import re
import subprocess
import sys

import pytest

ROOT = os.path.abspath(os.path.join(os.path.dirname(__file__), ".."))
README = os.path.join(ROOT, "README.md")


def _sections():
    """(heading, code) for every python block, with the nearest '## ' heading above it."""
    with open(README, encoding="utf-8") as f:
        text = f.read()
    out = []
    for m in re.finditer(r"```python\n(.*?)```", text, re.S):
        headings = re.findall(r"^## (.+)$", text[: m.start()], re.M)
        out.append((headings[-1] if headings else "top", m.group(1)))
    return out


EXAMPLES = _sections()


def _run(code: str, tmp_path) -> subprocess.CompletedProcess:
    script = tmp_path / "example.py"
    script.write_text(code, encoding="utf-8")
    env = dict(os.environ, PYTHONPATH=ROOT, TMPDIR=str(tmp_path), PYSPARK_PYTHON=sys.executable)
    return subprocess.run([sys.executable, str(script)], capture_output=True, text=True, env=env,
                          timeout=300, cwd=str(tmp_path))


def test_readme_has_examples_for_every_layer():
    headings = {h.split(" ")[0] for h, _ in EXAMPLES}
    assert len(EXAMPLES) >= 8, headings


@pytest.mark.parametrize("heading, code", EXAMPLES, ids=[f"{i}-{h[:40]}" for i, (h, _) in enumerate(EXAMPLES)])
def test_readme_example_runs(heading, code, tmp_path):
    proc = _run(code, tmp_path)
    assert proc.returncode == 0, f"example under '## {heading}' failed:\n{proc.stderr[-3000:]}"


def test_keyed_state_guide_prints_what_it_promises(tmp_path):
    code = next(c for h, c in EXAMPLES if h.startswith("Keyed state"))
    proc = _run(code, tmp_path)
    assert proc.returncode == 0, proc.stderr[-3000:]
    promised = []  # "# <output>" lines after a print, or "print(...)  # <output>"
    for line in code.splitlines():
        inline = re.match(r"print\(.*\)\s+# (.*)$", line)
        if inline:
            promised.append(inline.group(1))
        elif line.startswith("# {") or line.startswith("# ["):
            promised.append(line[2:])
    assert promised, "the guide promises no output"
    assert proc.stdout.splitlines() == promised
