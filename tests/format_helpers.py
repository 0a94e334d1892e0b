"""Helpers of the format tests: both implementations side by side, fixture loading, canonical order."""
from __future__ import annotations

import hashlib
import json
import os
import struct
from types import SimpleNamespace
from typing import List

import pytest

from conftest import expected_implementation

from dstl._fast import _buffer_py, _change_py, _decode_py


def _cython():
    try:
        from dstl._fast import _buffer, _change, _decode
    except ImportError:
        if expected_implementation() == "cython":
            raise  # the extension must be built for the Cython run
        return None
    return SimpleNamespace(name="cython", ChangeBuffer=_buffer.ChangeBuffer, decode=_decode,
                           StateChange=_change.StateChange)


PYTHON = SimpleNamespace(name="python", ChangeBuffer=_buffer_py.ChangeBuffer, decode=_decode_py,
                         StateChange=_change_py.StateChange)
CYTHON = _cython()
IMPLS = [PYTHON] + ([CYTHON] if CYTHON is not None else [])
impl_params = pytest.mark.parametrize("impl", IMPLS, ids=[i.name for i in IMPLS])


def load_cases(root: str) -> List[dict]:
    """Every case JSON listed in index.json, with `_dir` set to its folder."""
    with open(os.path.join(root, "index.json")) as f:
        index = json.load(f)
    cases = []
    for entry in index["cases"]:
        path = os.path.join(root, entry["json"])
        with open(path) as f:
            case = json.load(f)
        case["_dir"] = os.path.dirname(path)
        case["_json"] = entry["json"]
        cases.append(case)
    return cases


def sha256(data) -> str:
    return hashlib.sha256(bytes(data)).hexdigest()


def split_groups(body: bytes):
    """(kg, group bytes) per group of one well-formed change set body."""
    (g,) = struct.unpack_from(">i", body, 0)
    p, groups = 4, []
    for _ in range(g):
        n, kg = struct.unpack_from(">ii", body, p)
        q = p + 8
        for _ in range(n):
            (ln,) = struct.unpack_from(">i", body, q)
            q += 4 + ln
        groups.append((kg, body[p:q]))
        p = q
    return groups, p


def canonicalise(body: bytes) -> bytes:
    """The same change set with whole groups moved into canonical order (meta first, then ascending)."""
    groups, end = split_groups(body)
    ordered = sorted(groups, key=lambda item: item[0])  # stable: repeated groups keep their order
    return body[:4] + b"".join(g for _, g in ordered) + body[end:]
