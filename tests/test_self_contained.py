"""The repository stands on its own: no test, doc or module reads or points outside it."""
from __future__ import annotations

import json
import os
import re
import subprocess

ROOT = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))
# a path that climbs out of the checkout, or the old location of the specs and golden files
OUTSIDE = re.compile(r'"\.\.",\s*"\.\."|\.\./\.\.|\.\./shared\b|shared[/](spec|fixtures)|"shar[e]d",\s*"fixtures"')


def _tracked(*patterns: str) -> list:
    out = subprocess.run(["git", "ls-files", *patterns], cwd=ROOT, capture_output=True, text=True)
    if out.returncode != 0:  # not a git checkout (an sdist): walk the tree instead
        found = []
        for top in ("dstl", "tests", "bench", "docs"):
            for d, _, files in os.walk(os.path.join(ROOT, top)):
                found += [os.path.relpath(os.path.join(d, f), ROOT) for f in files]
        return [f for f in found if f.endswith((".py", ".pyx", ".md"))]
    return out.stdout.split()


def test_no_source_test_or_doc_points_outside_the_repository():
    offenders = []
    for rel in _tracked("*.py", "*.pyx", "*.pxd", "*.md", "Makefile", ".ci/*"):
        if rel == "tests/test_self_contained.py":
            continue
        with open(os.path.join(ROOT, rel), encoding="utf-8", errors="replace") as f:
            for n, line in enumerate(f, 1):
                if OUTSIDE.search(line):
                    offenders.append(f"{rel}:{n}: {line.strip()[:100]}")
    assert offenders == [], "files that read or point outside the repository:\n" + "\n".join(offenders)


def test_flink_golden_files_live_in_the_repository(flink_fixtures):
    assert os.path.commonpath([flink_fixtures, ROOT]) == ROOT
    index = json.load(open(os.path.join(flink_fixtures, "index.json")))
    assert len(index["cases"]) >= 9
    for case in index["cases"]:
        spec = json.load(open(os.path.join(flink_fixtures, case["json"])))
        folder = os.path.dirname(os.path.join(flink_fixtures, case["json"]))
        assert os.path.isfile(os.path.join(flink_fixtures, "README.md"))
        assert os.listdir(folder), f"{case['json']}: no changelog file beside it"
        assert spec, case["json"]


def test_the_pattern_catches_what_it_should():
    assert OUTSIDE.search('os.path.join(here, "..", "..", "spec")')
    assert OUTSIDE.search("see ../" + "share" + "d/spec/FORMAT.md")
    assert not OUTSIDE.search('os.path.join(here, "fixtures", "flink")')
