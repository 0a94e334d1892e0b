"""Flink-written golden files (tests/fixtures/flink): decode, re-encode, Snappy structure and CRCs."""
from __future__ import annotations

import io
import os
import struct

import pytest

from dstl import format as fmt
from dstl.format import compression
from dstl.types import KeyGroupRange

from conftest import FIXTURES
from format_helpers import IMPLS, canonicalise, load_cases, sha256, split_groups

CASES = load_cases(FIXTURES) if os.path.isdir(FIXTURES) else []
case_params = pytest.mark.parametrize("case", CASES, ids=[c["_json"] for c in CASES])


def _file_bytes(case, name):
    with open(os.path.join(case["_dir"], name), "rb") as f:
        return f.read()


def test_every_indexed_case_is_covered(flink_fixtures):
    assert len(CASES) >= 12
    assert {c["case"] for c in CASES} >= {"tiny-raw", "tiny-snappy", "snappy-random", "kg-hash-order"}


@case_params
def test_files_match_their_description(case):
    for name, meta in case["files"].items():
        data = _file_bytes(case, name)
        assert len(data) == meta["disk_size"]
        assert sha256(data) == meta["sha256"]
        assert data[0] == meta["compression_flag"] == case["compression_flag"]
        logical = fmt.to_logical(data, name)
        size = memoryview(logical).nbytes
        if "handle_state_size" in meta:  # absent for a file only the companion handle uses
            assert size == meta["handle_state_size"]
        # the change sets tile the logical stream exactly (docs/format.md §5.3, §5.8)
        infos = fmt.walk(logical)
        assert infos[0].offset == 0
        assert sum(i.encoded_size for i in infos) == size


@case_params
@pytest.mark.parametrize("impl", IMPLS, ids=[i.name for i in IMPLS])
def test_handle_decodes_to_the_listed_changes(case, impl):
    got = []
    logical_of = {}
    for entry, info in zip(case["handle"], case["change_sets"]):
        if entry["file"] not in logical_of:
            logical_of[entry["file"]] = fmt.to_logical(_file_bytes(case, entry["file"]))
        logical = logical_of[entry["file"]]
        changes, end = impl.decode.decode_change_set(logical, entry["offset"])
        kgs, offs, lens, end2 = impl.decode.decode_change_set_arrays(logical, entry["offset"])
        assert end == end2
        view = memoryview(logical)
        assert [c.key_group for c in changes] == kgs.tolist()
        assert [c.data for c in changes] == [bytes(view[o:o + n]) for o, n in zip(offs.tolist(), lens.tolist())]
        assert len(changes) == info["num_changes"]
        assert sum(len(c.data) for c in changes) == info["payload_bytes"]
        (walked,) = [w for w in impl.decode.walk(logical) if w.offset == entry["offset"]]
        assert list(walked.group_order) == info["group_order"]
        assert walked.num_groups == info["num_groups"]
        assert walked.encoded_size == end - entry["offset"]
        got.extend(changes)
    expected = case["changes"]
    assert len(got) == len(expected)
    for change, want in zip(got, expected):
        assert change.key_group == want["kg"]
        assert len(change.data) == want["len"]
        assert sha256(change.data) == want["sha256"]
        if "hex" in want:
            assert change.data.hex() == want["hex"]
    assert sum(len(c.data) for c in got) == case["state_size"]


@case_params
def test_decode_file_with_key_group_filter(case):
    """Filtering keeps metadata and the data changes inside the range, in stream order."""
    lo, hi = case["key_group_range"]
    mid = (lo + hi) // 2
    kgr = KeyGroupRange(lo, mid)
    for entry in case["handle"]:
        data = _file_bytes(case, entry["file"])
        everything = fmt.decode_file(data, entry["offset"])
        filtered = fmt.decode_file(data, entry["offset"], kgr)
        assert filtered == [c for c in everything if c.key_group == -1 or lo <= c.key_group <= mid]
        meta_only = fmt.decode_file(data, entry["offset"], KeyGroupRange.EMPTY)
        assert meta_only == [c for c in everything if c.key_group == -1]


@case_params
def test_reencoding_reproduces_flink_bytes(case):
    """Byte-identical where Flink's order is ascending, else identical after canonicalising groups."""
    for name, meta in case["files"].items():
        data = _file_bytes(case, name)
        logical = bytes(fmt.to_logical(data))
        bodies, canonical_logical = [], b""
        for info in fmt.walk(logical):
            original = logical[info.offset:info.offset + info.encoded_size]
            changes, _ = fmt.decode_change_set(logical, info.offset)
            ours = fmt.encode_change_set(changes)
            ascending = list(info.group_order) == sorted(info.group_order)
            if ascending:
                assert ours == original
            else:
                assert ours != original and ours == canonicalise(original)
            bodies.append(ours)
            canonical_logical += canonicalise(original)
        out = io.BytesIO()
        offsets, size = fmt.write_file(out, bodies, compression="snappy" if meta["compression_flag"] else None)
        assert size == len(logical)
        assert offsets == [i.offset for i in fmt.walk(logical)]
        assert bytes(fmt.to_logical(out.getvalue())) == canonical_logical
        if meta["compression_flag"] == 0 and canonical_logical == logical:
            assert out.getvalue() == data  # whole file identical, flag byte included


def _chunks(data):
    return compression.snappy_chunks(memoryview(data)[1:], 1)


@pytest.mark.parametrize("case", [c for c in CASES if c["compression_flag"] == 1], ids=lambda c: c["_json"])
def test_snappy_fixture_chunk_structure_and_crcs(case):
    for name in case["files"]:
        data = _file_bytes(case, name)
        chunks = _chunks(data)
        assert data[1:11] == compression.SNAPPY_IDENTIFIER and chunks[0][0] == 0xFF
        logical = bytes(fmt.to_logical(data))
        pos = 0
        for ctype, where, start, stop in chunks[1:]:
            assert ctype in (0x00, 0x01)
            payload = data[1 + start + 4:1 + stop]
            raw = bytes(compression.cramjam.snappy.decompress_raw(payload)) if ctype == 0 else payload
            assert len(raw) == min(65536, len(logical) - pos)  # boundaries every 65536 logical bytes
            assert raw == logical[pos:pos + len(raw)]
            stored = struct.unpack_from("<I", data, 1 + start)[0]
            assert stored == compression.mask_crc(compression.crc32c(raw))
            if ctype == 0:
                assert len(payload) / len(raw) <= 0.85
            else:
                assert len(compression.cramjam.snappy.compress_raw(raw)) / len(raw) > 0.85
            pos += len(raw)
        assert pos == len(logical)
        # our compressed form of the same logical stream: same boundaries and CRCs, decodes back
        ours = compression.compress_logical(logical, "snappy")
        ours_chunks = _chunks(ours)
        assert len(ours_chunks) == len(chunks)
        for (t1, _, s1, _), (t2, _, s2, _) in zip(chunks[1:], ours_chunks[1:]):
            assert data[1 + s1:1 + s1 + 4] == ours[1 + s2:1 + s2 + 4]  # CRC of identical blocks
        assert bytes(fmt.to_logical(ours)) == logical


def test_snappy_random_has_both_chunk_types(flink_fixtures):
    (case,) = [c for c in CASES if c["case"] == "snappy-random"]
    (name,) = case["files"]
    types = {t for t, *_ in _chunks(_file_bytes(case, name))}
    assert types == {0xFF, 0x00, 0x01}


def _replay(case):
    """The change sets Flink's writer saw, rebuilt from the recorded calls: {(writer, sqn): [(kg, value)]}."""
    by_sha = {}
    for name in case["files"]:
        logical = fmt.to_logical(_file_bytes(case, name))
        for info in fmt.walk(logical):
            for change in fmt.decode_change_set(logical, info.offset)[0]:
                by_sha[sha256(change.data)] = change.data
    sets, current = {}, {}
    for op in case["ops"]:
        writer = op.get("writer")
        if op["op"] in ("append", "append_meta"):
            value = bytes.fromhex(op["hex"]) if "hex" in op else by_sha[op["sha256"]]
            assert sha256(value) == op["sha256"]
            sets.setdefault((writer, current.get(writer, 0)), []).append((op["kg"], value))
        elif op["op"] == "next_sequence_number":
            current[writer] = op["returned"]
    return sets


@pytest.mark.parametrize("case", [c for c in CASES if c["case"] != "preemptive"], ids=lambda c: c["_json"])
def test_encoding_the_recorded_appends_gives_flinks_change_sets(case):
    """From the inputs (the append calls) to Flink's bytes: exact when ascending, else canonicalised."""
    sets = _replay(case)
    writer = case["writer"]["index"]
    for entry, info in zip(case["handle"], case["change_sets"]):
        logical = bytes(fmt.to_logical(_file_bytes(case, entry["file"])))
        (walked,) = [w for w in fmt.walk(logical) if w.offset == entry["offset"]]
        original = logical[walked.offset:walked.offset + walked.encoded_size]
        buf = fmt.ChangeBuffer()
        for kg, value in sets[(writer, entry["sqn"])]:
            buf.append(kg, value)
        ours = buf.seal()
        assert (list(walked.group_order) == sorted(walked.group_order)) == info["groups_ascending"]
        if info["groups_ascending"]:
            assert ours == original
        else:
            assert ours == canonicalise(original)
