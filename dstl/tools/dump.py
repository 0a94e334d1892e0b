"""`dstl dump FILE --offset N`: the changes of one change set (key group, length, hex preview)."""
from __future__ import annotations

import argparse
import sys

from dstl.errors import CorruptChangelogError
from dstl.tools._read import parse_range, read_bytes


def add_arguments(parser: argparse.ArgumentParser) -> None:
    parser.add_argument("path", metavar="FILE", help="changelog file: local path or fsspec URL (s3://...)")
    parser.add_argument("--offset", type=int, default=0,
                        help="logical offset of the change set (default 0; see `dstl inspect`)")
    parser.add_argument("--all", action="store_true", help="dump every change set of the file")
    parser.add_argument("--key-groups", metavar="A-B", default=None,
                        help="only data changes in this inclusive key-group range (metadata is always shown)")
    parser.add_argument("--width", type=int, default=32, help="payload bytes shown per change (default 32)")


def _dump_one(out, logical, offset: int, kgr, width: int) -> int:
    from dstl.format import decode_change_set_arrays

    kgs, offs, lens, end = decode_change_set_arrays(logical, offset, kgr)
    view = memoryview(logical).cast("B") if not isinstance(logical, bytes) else logical
    out.write(f"change set at offset {offset} ({end - offset} bytes): {len(kgs)} changes shown\n")
    out.write(f"{'#':>6} {'key group':>9} {'length':>8}  payload\n")
    for i, (kg, start, n) in enumerate(zip(kgs.tolist(), offs.tolist(), lens.tolist())):
        shown = bytes(view[start:start + min(n, width)]).hex(" ")
        more = " ..." if n > width else ""
        label = "meta" if kg == -1 else str(kg)
        out.write(f"{i:>6} {label:>9} {n:>8}  {shown}{more}\n")
    return end


def run(args) -> int:
    from dstl.format import to_logical
    from dstl.types import KeyGroupRange

    try:
        kgr = KeyGroupRange(*parse_range(args.key_groups)) if args.key_groups else None
    except ValueError as exc:
        print(f"dstl dump: {exc}", file=sys.stderr)
        return 2
    try:
        data = read_bytes(args.path)
    except (OSError, ValueError) as exc:
        print(f"dstl dump: cannot read {args.path}: {exc}", file=sys.stderr)
        return 2
    try:
        logical = to_logical(data, args.path)
        size = memoryview(logical).nbytes
        pos = 0 if args.all else args.offset
        while True:
            pos = _dump_one(sys.stdout, logical, pos, kgr, max(args.width, 0))
            if not args.all or pos >= size:
                break
    except CorruptChangelogError as exc:
        print(f"dstl dump: {exc.with_file(args.path)}", file=sys.stderr)
        return 1
    return 0
