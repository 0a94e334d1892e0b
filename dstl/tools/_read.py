"""Shared helpers of the inspection commands: read a whole changelog file through fsspec."""
from __future__ import annotations

from typing import List, Tuple


def read_bytes(path: str) -> bytes:
    """The whole file at a local path or any fsspec URL (s3://..., file://..., memory://...)."""
    import fsspec

    with fsspec.open(path, "rb") as f:
        return f.read()


def parse_range(text: str) -> Tuple[int, int]:
    """`A-B`, `A` or `A..B` -> (A, B) inclusive."""
    t = text.strip().replace("..", "-")
    head, sep, tail = t.partition("-")
    try:
        start = int(head)
        end = int(tail) if sep else start
    except ValueError:
        raise ValueError(f"key-group range must look like A-B, got {text!r}") from None
    if start < 0 or end < start:
        raise ValueError(f"key-group range {text!r} is empty or negative")
    return start, end


def compact_groups(groups) -> str:
    """Key groups in group order, ascending runs shortened: (-1, 0, 1, 2, 7) -> "-1,0-2,7"."""
    parts: List[str] = []
    run_start = prev = None
    for g in groups:
        if prev is not None and g == prev + 1 and prev >= 0:
            prev = g
            continue
        if run_start is not None:
            parts.append(str(run_start) if run_start == prev else f"{run_start}-{prev}")
        run_start = prev = g
    if run_start is not None:
        parts.append(str(run_start) if run_start == prev else f"{run_start}-{prev}")
    return ",".join(parts)
