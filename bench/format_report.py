"""Prints the format benchmark: 1,000,000 changes of 100 bytes over key groups 0..127,
Cython vs the pure-Python twin in one process, medians of a few runs, and the ratios.

Usage: .venv/bin/python bench/format_report.py [--changes N] [--repeat R] [--twin-repeat R]
"""
from __future__ import annotations

import argparse
import os
import sys

sys.path.insert(0, os.path.dirname(__file__))
sys.path.insert(0, os.path.join(os.path.dirname(__file__), ".."))
import _format_data as fd  # noqa: E402

GB = 1e9


from _timing import median_seconds as _median  # noqa: E402


def measure(impl, w, body, repeat: int, warmup: int) -> dict:
    r = {}
    t_append = _median(lambda: fd.append_only(impl, w), repeat, warmup)
    r["per-record append (changes/s)"] = w.n / t_append
    r["per-record append + seal (changes/s)"] = w.n / _median(lambda: fd.append_and_seal(impl, w), repeat, warmup)
    r["append_many + seal, bytes source (GB/s)"] = w.payload_bytes / _median(
        lambda: fd.append_many_and_seal(impl, w), repeat, warmup) / GB
    r["append_many + seal, mutable numpy source (GB/s)"] = w.payload_bytes / _median(
        lambda: fd.append_many_copy_and_seal(impl, w), repeat, warmup) / GB
    r["decode objects (changes/s)"] = w.n / _median(lambda: fd.decode_objects(impl, body), repeat, warmup)
    r["decode vectorised (GB/s of payload)"] = w.payload_bytes / _median(
        lambda: fd.decode_arrays(impl, body), repeat, warmup) / GB
    return r


TARGETS = {
    "per-record append (changes/s)": 5e6,
    "append_many + seal, bytes source (GB/s)": 1.0,
    "append_many + seal, mutable numpy source (GB/s)": 1.0,
    "decode vectorised (GB/s of payload)": 2.0,
}
VECTORISED = ("append_many + seal, bytes source (GB/s)", "append_many + seal, mutable numpy source (GB/s)",
              "decode vectorised (GB/s of payload)")


def _fmt(value: float, label: str) -> str:
    return f"{value / 1e6:10.2f} M" if "changes/s" in label else f"{value:10.3f}  "


def main(argv=None) -> int:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--changes", type=int, default=fd.N_CHANGES)
    ap.add_argument("--repeat", type=int, default=5, help="timed runs of the Cython path (median)")
    ap.add_argument("--twin-repeat", type=int, default=3, help="timed runs of the pure-Python twin")
    args = ap.parse_args(argv)
    w = fd.Workload(args.changes)
    impls = fd.implementations()
    body = fd.append_many_and_seal(impls["python"], w)
    for name, impl in impls.items():  # both produce the same bytes before anything is timed
        assert fd.append_and_seal(impl, w) == body, name
        assert fd.append_many_copy_and_seal(impl, w) == body, name
    results = {}
    for name, impl in impls.items():
        repeat = args.repeat if name == "cython" else args.twin_repeat
        results[name] = measure(impl, w, body, repeat, warmup=1 if name == "cython" else 0)
    print(f"format workload: {w.n:,} changes x {fd.PAYLOAD} bytes ({w.payload_bytes / 1e6:.0f} MB payload), "
          f"key groups 0..{fd.KEY_GROUPS - 1}; medians of {args.repeat} (Cython) / {args.twin_repeat} (twin) runs")
    names = list(impls)
    header = f"{'operation':<50}" + "".join(f"{n:>14}" for n in names) + f"{'ratio':>9}{'target':>12}"
    print(header)
    print("-" * len(header))
    ok = True
    for label in results[names[0]]:
        row = f"{label:<50}" + "".join(f"{_fmt(results[n][label], label):>14}" for n in names)
        if "cython" in results:
            ratio = results["cython"][label] / results["python"][label]
            row += f"{ratio:8.1f}x"
            target = TARGETS.get(label)
            met = target is None or results["cython"][label] >= target
            if label in VECTORISED:
                met = met and ratio >= 10
            if target is not None or label in VECTORISED:
                goal = ">=" + (_fmt(target, label).strip() if target else "") + (" 10x" if label in VECTORISED else "")
                row += f"  {goal}: {'met' if met else 'MISSED'}"
                ok = ok and met
        print(row)
    if "cython" not in results:
        print("(Cython extension not built: only the twin was measured)")
    return 0 if ok else 1


if __name__ == "__main__":
    sys.exit(main())
