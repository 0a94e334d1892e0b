"""Interop with Flink's DSTL files (docs/format.md; tests/fixtures/flink).

1. Files our storage writes are re-parsed by a minimal parser written here from docs/format.md alone.
2. Handles over Flink's fixture files read back exactly through `storage.create_reader()`.
3. Replaying each fixture's recorded calls through our storage gives the same handle layout
   (entries, offsets, file grouping, sizes) and the same logical bytes (docs/format.md §4.4).
"""
from __future__ import annotations

import hashlib
import json
import os
import random
import struct

import cramjam
import pytest

from dstl.format import decode_change_set, to_logical, walk
from dstl.changelog.handles import ChangelogStateHandleStreamImpl, StreamStateHandle
from dstl.changelog.storage import open_storage
from dstl.types import KeyGroupRange

T = 20


# -- an independent minimal parser -----------------------------------------------------------------

def _crc_table():
    table = []
    for i in range(256):
        c = i
        for _ in range(8):
            c = (c >> 1) ^ (0x82F63B78 if c & 1 else 0)
        table.append(c)
    return table


_TABLE = _crc_table()


def _crc32c(data: bytes) -> int:
    """CRC-32C (Castagnoli), table-driven; check value of b"123456789" is 0xE3069283."""
    crc, table = 0xFFFFFFFF, _TABLE
    for byte in data:
        crc = (crc >> 8) ^ table[(crc ^ byte) & 0xFF]
    return crc ^ 0xFFFFFFFF


def test_minimal_crc32c_check_value():
    assert _crc32c(b"123456789") == 0xE3069283


def _unframe_snappy(b: bytes) -> bytes:
    assert b[:10] == b"\xff\x06\x00\x00sNaPpY", "stream identifier first"
    pos, out = 10, bytearray()
    while pos < len(b):
        kind, length = b[pos], int.from_bytes(b[pos + 1:pos + 4], "little")
        body = b[pos + 4:pos + 4 + length]
        assert len(body) == length
        pos += 4 + length
        if kind in (0, 1):
            data = bytes(cramjam.snappy.decompress_raw(body[4:])) if kind == 0 else body[4:]
            assert 0 < len(data) <= 65536
            c = _crc32c(data)
            masked = ((((c >> 15) | (c << 17)) & 0xFFFFFFFF) + 0xA282EAD8) & 0xFFFFFFFF
            assert int.from_bytes(body[:4], "little") == masked, "CRC-32C of the chunk"
            out += data
        else:
            assert kind >= 0x80, f"unskippable chunk type {kind}"
    return bytes(out)


def parse_file(raw: bytes):
    """-> (logical stream, [(offset, [(kg, data), ...], group order)]) of a whole dstl/Flink file."""
    flag = raw[0]
    assert flag in (0, 1), f"flag {flag}"
    logical = raw[1:] if flag == 0 else _unframe_snappy(raw[1:])
    sets, pos = [], 0
    while pos < len(logical):
        start = pos
        (g,) = struct.unpack_from(">i", logical, pos)
        pos += 4
        changes, order = [], []
        for _ in range(g):
            n, kg = struct.unpack_from(">ii", logical, pos)
            pos += 8
            order.append(kg)
            assert n > 0, "the writer never writes empty groups"
            for _ in range(n):
                (ln,) = struct.unpack_from(">i", logical, pos)
                pos += 4
                changes.append((kg, logical[pos:pos + ln]))
                pos += ln
        sets.append((start, changes, order))
    assert pos == len(logical)
    return logical, sets


def canonical(changes):
    """Canonical group order (docs/format.md §4.2): metadata first, key groups ascending, append order kept."""
    return sorted(changes, key=lambda c: c[0])  # stable


@pytest.mark.parametrize("compression", [False, True], ids=["raw", "snappy"])
def test_our_files_parse_with_an_independent_parser(tmp_path, compression):
    rnd = random.Random(7)
    expected = {}
    with open_storage(str(tmp_path), upload_mode="thread", batch_persist_delay="200 ms",
                      compression_enabled=compression) as s:
        writers = [s.create_writer(f"op{i}", KeyGroupRange(i * 100, i * 100 + 99)) for i in range(3)]
        futures = []
        for i, w in enumerate(writers):
            sets = []
            for sqn in range(3):
                cur = [(-1, b"meta-%d-%d" % (i, sqn))]
                w.append_meta(cur[0][1])
                for _ in range(40):
                    kg = i * 100 + rnd.randrange(100)
                    data = bytes(rnd.getrandbits(8) for _ in range(rnd.randrange(0, 300)))
                    w.append(kg, data)
                    cur.append((kg, data))
                sets.append(canonical(cur))
                w.next_sequence_number()
            expected[i] = sets
            futures.append(w.persist(0, 1))
        handles = [f.result(T).job_manager_owned_snapshot for f in futures]
    files = {h.path for hd in handles for h, _ in hd.handles_and_offsets}
    assert len(files) == 1  # three writers batched into one file
    raw = open(files.pop(), "rb").read()
    assert raw[0] == (1 if compression else 0)
    logical, sets = parse_file(raw)
    by_offset = {off: (changes, order) for off, changes, order in sets}
    for i, h in enumerate(handles):
        assert h.handles_and_offsets[0][0].state_size == len(logical)
        for sqn, (_, off) in enumerate(h.handles_and_offsets):
            changes, order = by_offset[off]
            assert changes == expected[i][sqn]
            assert order == sorted(set(order)) and order[0] == -1  # canonical group order
        assert h.state_size == sum(len(d) for cs in expected[i] for _, d in cs)


# -- Flink's fixtures ------------------------------------------------------------------------------

def _cases(root):
    out = []
    for d in sorted(os.listdir(root)):
        for j in ("case.json", "case-2.json"):
            p = os.path.join(root, d, j)
            if os.path.exists(p):
                out.append(p)
    return out


def _handle(case_path):
    case = json.load(open(case_path))
    d = os.path.dirname(case_path)
    entries = [(StreamStateHandle(os.path.join(d, e["file"]), case["files"][e["file"]]["handle_state_size"]),
                e["offset"]) for e in case["handle"]]
    return case, ChangelogStateHandleStreamImpl(entries, KeyGroupRange(*case["key_group_range"]), case["state_size"])


def test_flink_handles_read_back_exactly(flink_fixtures):
    paths = _cases(flink_fixtures)
    assert len(paths) >= 10
    with open_storage(str(flink_fixtures), upload_mode="direct") as s:
        reader = s.create_reader()
        for p in paths:
            case, handle = _handle(p)
            got = [(c.key_group, bytes(c.data)) for c in reader.get_changes(handle)]
            want = case["changes"]
            assert len(got) == len(want), p
            for (kg, data), w in zip(got, want):
                assert kg == w["kg"] and len(data) == w["len"], p
                assert hashlib.sha256(data).hexdigest() == w["sha256"], p
            # the independent parser agrees with Flink's recorded layout
            for e, cs in zip(case["handle"], case["change_sets"]):
                _, sets = parse_file(open(os.path.join(os.path.dirname(p), e["file"]), "rb").read())
                [(changes, order)] = [(c, o) for off, c, o in sets if off == e["offset"]]
                assert order == cs["group_order"] and len(changes) == cs["num_changes"], p


def _values_of(case_dir):
    """sha256 -> payload of every change in the case's files (values are recovered from the files)."""
    out = {}
    for name in os.listdir(case_dir):
        if name.endswith(".json"):
            continue
        logical = to_logical(open(os.path.join(case_dir, name), "rb").read())
        for info in walk(logical):
            changes, _ = decode_change_set(logical, info.offset)
            for c in changes:
                out[hashlib.sha256(bytes(c.data)).hexdigest()] = bytes(c.data)
    return out


def _replay(case, case_dir, base):
    values = _values_of(case_dir)
    options = {"compression_enabled": case["compression"]}
    if case.get("preemptive_threshold_bytes"):
        options["preemptive_persist_threshold"] = case["preemptive_threshold_bytes"]
    if case.get("persist_delay_ms"):
        options.update(upload_mode="thread", batch_persist_delay=case["persist_delay_ms"])
    else:
        options.update(upload_mode="direct")
    results = []  # (writer, from, checkpoint id, future)
    s = open_storage(str(base), **options)
    writers = {}
    for op in case["ops"]:
        kind, wi = op["op"], op.get("writer")
        if kind == "create_writer":
            writers[wi] = s.create_writer(op["operator_id"], KeyGroupRange(*op["key_group_range"]))
        elif kind in ("append", "append_meta"):
            data = bytes.fromhex(op["hex"]) if "hex" in op else values[op["sha256"]]
            if kind == "append":
                writers[wi].append(op["kg"], data)
            else:
                writers[wi].append_meta(data)
        elif kind == "next_sequence_number":
            assert int(writers[wi].next_sequence_number()) == op["returned"]
        elif kind == "persist":
            results.append((wi, op["from"], op["checkpoint_id"], writers[wi].persist(op["from"], op["checkpoint_id"])))
        else:
            pytest.fail(f"unknown op {kind}")
    return s, results


@pytest.mark.parametrize("case_name", ["tiny-raw", "tiny-snappy", "multi-sqn", "persist-from-middle",
                                       "edge-values", "kg-hash-order", "preemptive", "snappy-random",
                                       "two-writers-one-file"])
def test_replaying_flink_calls_gives_flinks_layout(flink_fixtures, tmp_path, case_name):
    case_dir = os.path.join(flink_fixtures, case_name)
    mine = [p for p in _cases(flink_fixtures) if os.path.dirname(p) == case_dir]
    # replay the longest recorded call list (case-2.json may extend case.json)
    fullest = max((json.load(open(p)) for p in mine), key=lambda c: len(c["ops"]))
    s, results = _replay(fullest, case_dir, tmp_path)
    try:
        ours = {(wi, frm, cp): f.result(T).job_manager_owned_snapshot for wi, frm, cp, f in results}
        for p in mine:
            case = json.load(open(p))
            h = ours[(case["writer"]["index"], case["persist_from_sqn"], case["checkpoint_id"])]
            assert h.state_size == case["state_size"] and h.checkpointed_size == case["checkpointed_size"], p
            assert [off for _, off in h.handles_and_offsets] == [e["offset"] for e in case["handle"]], p
            # the same grouping of change sets into files
            pairs = {(sh.path, e["file"]) for (sh, _), e in zip(h.handles_and_offsets, case["handle"])}
            assert len({a for a, _ in pairs}) == len({b for _, b in pairs}) == len(pairs), p
            for ours_path, flink_file in pairs:
                info = case["files"][flink_file]
                mine = open(ours_path, "rb").read()
                theirs = open(os.path.join(case_dir, flink_file), "rb").read()
                assert mine[0] == info["compression_flag"]
                lm, sm = parse_file(mine)
                lt, st = parse_file(theirs)
                assert len(lm) == info["handle_state_size"], p
                assert [off for off, _, _ in sm] == [off for off, _, _ in st], p
                for (_, cm, _), (_, ct, _) in zip(sm, st):
                    assert cm == canonical(ct), p
                ascending = all(cs["groups_ascending"] for cs in case["change_sets"] if cs["file"] == flink_file)
                if ascending:
                    assert lm == lt, p  # byte-identical logical stream
                    if info["compression_flag"] == 0:
                        assert hashlib.sha256(mine).hexdigest() == info["sha256"], p
    finally:
        s.close()
