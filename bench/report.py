"""Runs every benchmark report script (bench/*_report.py) one after another and prints their output.

Usage: .venv/bin/python bench/report.py [NAME ...]   e.g. `format storage` runs only those two.
Each report measures its own ratios inside one run; the machine is shared, so quote medians.
"""
from __future__ import annotations

import glob
import os
import subprocess
import sys

HERE = os.path.dirname(os.path.abspath(__file__))


def main(argv) -> int:
    scripts = sorted(glob.glob(os.path.join(HERE, "*_report.py")))
    wanted = set(argv)
    failed = []
    for script in scripts:
        name = os.path.basename(script)[: -len("_report.py")]
        if wanted and name not in wanted:
            continue
        print(f"\n===== {name} =====", flush=True)
        rc = subprocess.call([sys.executable, script], cwd=os.path.dirname(HERE))
        if rc:
            failed.append(name)
    if failed:
        print(f"\nfailed reports: {', '.join(failed)}", file=sys.stderr)
    return 1 if failed else 0


if __name__ == "__main__":
    sys.exit(main(sys.argv[1:]))
