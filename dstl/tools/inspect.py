"""`dstl inspect FILE_OR_URL`: the compression and the change sets of a changelog file."""
from __future__ import annotations

import argparse
import json
import sys

from dstl.format.compression import FLAG_RAW, FLAG_SNAPPY, FLAG_ZSTD, snappy_chunks
from dstl.errors import CorruptChangelogError
from dstl.tools._read import compact_groups, read_bytes

_CODEC = {FLAG_RAW: "raw", FLAG_SNAPPY: "snappy", FLAG_ZSTD: "zstd"}


def add_arguments(parser: argparse.ArgumentParser) -> None:
    parser.add_argument("path", metavar="FILE_OR_URL", help="changelog file: local path or fsspec URL (s3://...)")
    parser.add_argument("--json", action="store_true", help="print one JSON object instead of a table")


def describe(data, path: str) -> dict:
    """What `inspect` prints, as a dict (raises CorruptChangelogError for a malformed file)."""
    from dstl.format import to_logical, walk

    info = {"file": path, "file_size": len(data)}
    if len(data) == 0:
        info.update(compression="none (0-byte file)", flag=None, logical_size=0, change_sets=[])
        return info
    flag = data[0]
    info["flag"] = flag
    info["compression"] = _CODEC.get(flag, f"unknown (0x{flag:02X})")
    logical = to_logical(data, path)
    info["logical_size"] = memoryview(logical).nbytes
    if flag == FLAG_SNAPPY:
        chunks = snappy_chunks(memoryview(data)[1:], 1, path)
        info["snappy_chunks"] = {
            "compressed": sum(1 for c in chunks if c[0] == 0x00),
            "uncompressed": sum(1 for c in chunks if c[0] == 0x01),
            "skippable": sum(1 for c in chunks if c[0] >= 0x80 and c[0] != 0xFF),
        }
    try:
        sets = walk(logical)
    except CorruptChangelogError as exc:
        raise exc.with_file(path) from None
    info["change_sets"] = [
        {"offset": s.offset, "encoded_size": s.encoded_size, "groups": s.num_groups,
         "changes": s.num_changes, "size": s.size, "key_groups": list(s.group_order)}
        for s in sets
    ]
    return info


def run(args) -> int:
    try:
        data = read_bytes(args.path)
    except (OSError, ValueError) as exc:
        print(f"dstl inspect: cannot read {args.path}: {exc}", file=sys.stderr)
        return 2
    try:
        info = describe(data, args.path)
    except CorruptChangelogError as exc:
        print(f"dstl inspect: {exc}", file=sys.stderr)
        return 1
    if args.json:
        print(json.dumps(info, indent=1))
        return 0
    out = sys.stdout
    flag = info["flag"]
    out.write(f"file: {info['file']}\n")
    out.write(f"compression: {info['compression']}" + (f" (flag {flag})\n" if flag is not None else "\n"))
    out.write(f"file size: {info['file_size']} bytes\n")
    out.write(f"logical size: {info['logical_size']} bytes (stream handle state size)\n")
    if "snappy_chunks" in info:
        c = info["snappy_chunks"]
        out.write(f"snappy chunks: {c['compressed']} compressed, {c['uncompressed']} uncompressed, "
                  f"{c['skippable']} skippable; every CRC-32C verified\n")
    sets = info["change_sets"]
    total = sum(s["size"] for s in sets)
    changes = sum(s["changes"] for s in sets)
    out.write(f"change sets: {len(sets)} ({changes} changes, {total} payload bytes)\n")
    if sets:
        out.write(f"{'offset':>12} {'encoded':>10} {'groups':>7} {'changes':>8} {'payload':>10}  key groups (group order)\n")
        for s in sets:
            out.write(f"{s['offset']:>12} {s['encoded_size']:>10} {s['groups']:>7} {s['changes']:>8} "
                      f"{s['size']:>10}  {compact_groups(s['key_groups'])}\n")
    return 0
