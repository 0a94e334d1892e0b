"""Prints rows/s of vectorised key-group assignment (10 million int64 and Arrow string keys by default),
Cython kernels vs the pure-Python twin, medians of a few runs, and the ratio between them.

Usage: .venv/bin/python bench/keygroups_report.py [--rows N] [--repeat R]
"""
from __future__ import annotations

import argparse
import os
import sys

sys.path.insert(0, os.path.dirname(__file__))
sys.path.insert(0, os.path.join(os.path.dirname(__file__), ".."))
from _keygroups_data import int_keys, kernels, string_keys  # noqa: E402

from dstl import keygroups  # noqa: E402
from _timing import median_seconds  # noqa: E402

GOAL_INT_ROWS_PER_S = 50e6


def _median_seconds(fn, repeat: int) -> float:
    return median_seconds(fn, repeat, warmup=0)


def main(argv=None) -> int:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--rows", type=int, default=10_000_000)
    ap.add_argument("--repeat", type=int, default=3)
    ap.add_argument("--max-parallelism", type=int, default=128)
    args = ap.parse_args(argv)
    n, mp = args.rows, args.max_parallelism
    inputs = {
        "int64 (numpy)": int_keys(n),
        "string (pyarrow)": string_keys(n),
    }
    impls = kernels()
    saved = keygroups._kernels
    results = {}
    reference = {}
    try:
        for label, data in inputs.items():
            for name, module in impls.items():
                keygroups._kernels = module
                out = keygroups.assign_key_groups(data, mp)  # warm-up, and a result to compare
                if label in reference and not (reference[label] == out).all():
                    raise SystemExit(f"{label}: {name} disagrees with the other implementation")
                reference[label] = out
                results[(label, name)] = n / _median_seconds(lambda: keygroups.assign_key_groups(data, mp),
                                                            args.repeat)
    finally:
        keygroups._kernels = saved
    print(f"key-group assignment, {n:,} rows, max parallelism {mp}, median of {args.repeat} runs")
    print()
    print("| keys | " + " | ".join(f"{name} (M rows/s)" for name in impls) + " | cython / python |")
    print("|---|" + "---|" * len(impls) + "---|")
    for label in inputs:
        row = [f"{results[(label, name)] / 1e6:.1f}" for name in impls]
        ratio = (f"{results[(label, 'cython')] / results[(label, 'python')]:.1f}x"
                 if "cython" in impls else "n/a")
        print(f"| {label} | " + " | ".join(row) + f" | {ratio} |")
    if "cython" in impls:
        rate = results[("int64 (numpy)", "cython")]
        verdict = "met" if rate >= GOAL_INT_ROWS_PER_S else "NOT met"
        print(f"\ngoal >= {GOAL_INT_ROWS_PER_S / 1e6:.0f} M int keys/s (Cython): {verdict} ({rate / 1e6:.1f} M/s)")
    else:
        print("\nthe Cython extension is not built: only the twin was measured")
    return 0


if __name__ == "__main__":
    sys.exit(main())
