"""The runnable example of docs/readme/state.md runs and prints what it says."""
from __future__ import annotations

import os
import re
import subprocess
import sys

DOC = os.path.join(os.path.dirname(__file__), "..", "docs", "readme", "state.md")


def test_state_guide_example_runs(tmp_path):
    with open(DOC, encoding="utf-8") as f:
        code = re.search(r"```python\n(.*?)```", f.read(), re.S).group(1)
    script = tmp_path / "example.py"
    script.write_text(code, encoding="utf-8")
    env = dict(os.environ, PYTHONPATH=os.path.abspath(os.path.join(os.path.dirname(__file__), "..")))
    proc = subprocess.run([sys.executable, str(script)], capture_output=True, text=True, env=env,
                          timeout=120, cwd=str(tmp_path))
    assert proc.returncode == 0, proc.stderr[-3000:]
    printed = proc.stdout.splitlines()
    promised = []  # "# <output>" lines after a print, or "print(...)  # <output>"
    for line in code.splitlines():
        inline = re.match(r"print\(.*\)\s+# (.*)$", line)
        if inline:
            promised.append(inline.group(1))
        elif line.startswith("# {") or line.startswith("# ["):
            promised.append(line[2:])
    assert printed == promised
