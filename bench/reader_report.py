"""Prints reader throughput for 1,000,000 × 100-byte changes (medians of a few runs) and the ratio of
the vectorised reader to a bare in-memory decode of the same bytes (the reader's own overhead).

Usage: .venv/bin/python bench/reader_report.py [--changes N] [--repeat R]
"""
from __future__ import annotations

import argparse
import os
import shutil
import sys

sys.path.insert(0, os.path.dirname(__file__))
import _reader_data as rd  # noqa: E402


from _timing import median_seconds as median_time  # noqa: E402  (one warm-up: page cache, imports)


def main() -> int:
    ap = argparse.ArgumentParser()
    ap.add_argument("--changes", type=int, default=1_000_000)
    ap.add_argument("--repeat", type=int, default=3)
    args = ap.parse_args()
    from dstl import IMPLEMENTATION

    n, d = args.changes, rd.tmpdir()
    try:
        handles = {c or "raw": rd.write_file(d, n, c) for c in (None, "snappy")}
        mb = n * rd.VALUE / 1e6
        print(f"reader benchmark: {n:,} changes x {rd.VALUE} B, implementation {IMPLEMENTATION}")
        logical = rd.load_logical(handles["raw"])
        floor = median_time(lambda: rd.decode_in_memory(handles["raw"], logical), args.repeat)
        rows = [("bare in-memory decode (arrays)", floor)]
        for kind in ("raw", "snappy"):
            rows.append((f"reader arrays, {kind} file", median_time(lambda: rd.read_arrays(handles[kind]), args.repeat)))
            rows.append((f"reader objects, {kind} file", median_time(lambda: rd.read_objects(handles[kind]), args.repeat)))
        for label, t in rows:
            print(f"  {label:34s} {t * 1000:9.1f} ms  {mb / t:9.1f} MB/s  {n / t / 1e6:7.2f} M changes/s")
        print(f"  reader arrays (raw file) at {floor / rows[1][1]:.2f} of the bare in-memory decode speed; "
              f"objects at {floor / rows[2][1]:.2f}")
    finally:
        shutil.rmtree(d, ignore_errors=True)
    return 0


if __name__ == "__main__":
    sys.exit(main())
