"""Reading handles back (SEMANTICS §11): Flink fixtures, filtering, errors, the download cache, S3."""
from __future__ import annotations

import hashlib
import json
import os
import shutil
import threading
import time
import uuid

import fsspec
import pytest

from dstl import format as fmt
from dstl.errors import CorruptChangelogError
from dstl.changelog.handles import ChangelogStateHandleStreamImpl, StreamStateHandle
from dstl.changelog.reader import DownloadCache, StateChangelogReader
from dstl.types import KeyGroupRange, StateChange, StateChangeSet
from conftest import FIXTURES
from faultyfs import FAULTS, faulty, faulty_url  # noqa: F401  (faulty is a fixture)


def _cases(root):
    index = json.load(open(os.path.join(root, "index.json")))
    return [c["json"] for c in index["cases"]]


CASES = _cases(FIXTURES)


def fixture_handle(root: str, case_json: str, base: str = None):
    """The handle a case describes; `base` replaces the case directory (e.g. a faulty:// or s3 URL)."""
    path = os.path.join(root, case_json)
    d = json.load(open(path))
    case_dir = os.path.dirname(path)
    where = base if base is not None else case_dir
    entries = [(StreamStateHandle(f"{where}/{e['file']}", d["files"][e["file"]]["handle_state_size"]), e["offset"])
               for e in d["handle"]]
    handle = ChangelogStateHandleStreamImpl(entries, KeyGroupRange(*d["key_group_range"]), d["state_size"],
                                            d["checkpointed_size"])
    return handle, d


def digest(changes):
    return [(c.key_group, len(c.data), hashlib.sha256(c.data).hexdigest()) for c in changes]


def expected(d, kgr=None):
    out = [(c["kg"], c["len"], c["sha256"]) for c in d["changes"]]
    if kgr is not None:
        out = [c for c in out if c[0] == -1 or kgr.contains(c[0])]
    return out


def arrays_to_changes(items):
    out = []
    for buf, kgs, offs, lens in items:
        mv = memoryview(buf)
        assert len(kgs) == len(offs) == len(lens)
        out.extend(StateChange(int(k), bytes(mv[int(o):int(o) + int(n)])) for k, o, n in zip(kgs, offs, lens))
    return out


# --- Flink fixtures -----------------------------------------------------------------------------
@pytest.mark.parametrize("case_json", CASES)
def test_flink_fixtures_read_back_exactly(flink_fixtures, case_json):
    handle, d = fixture_handle(flink_fixtures, case_json)
    reader = StateChangelogReader()
    with reader.get_changes(handle) as it:
        changes = list(it)
    assert digest(changes) == expected(d)
    for c, e in zip(changes, d["changes"]):
        if "hex" in e:
            assert c.data.hex() == e["hex"]
    assert digest(arrays_to_changes(reader.get_changes_arrays(handle))) == expected(d)


@pytest.mark.parametrize("case_json", ["kg-hash-order/case.json", "multi-sqn/case.json",
                                       "snappy-random/case.json", "edge-values/case.json"])
def test_fixture_intersection_filters_data_and_keeps_metadata(flink_fixtures, case_json):
    handle, d = fixture_handle(flink_fixtures, case_json)
    r = handle.key_group_range
    mid = (r.start + r.end) // 2
    reader = StateChangelogReader()
    for sub in (KeyGroupRange(r.start, mid), KeyGroupRange(mid + 1, r.end), KeyGroupRange(mid, mid)):
        part = handle.get_intersection(sub)
        if part is None:
            continue
        got = digest(reader.read_all(part))
        assert got == expected(d, part.key_group_range)
        assert any(kg == -1 for kg, _, _ in got) == any(c["kg"] == -1 for c in d["changes"])
        assert digest(arrays_to_changes(reader.get_changes_arrays(part))) == got


def test_fixtures_through_a_remote_filesystem_use_the_cache(flink_fixtures, faulty, tmp_path):
    cache = DownloadCache(60_000, directory=str(tmp_path / "cache"))
    reader = StateChangelogReader(cache)
    try:
        for case_json in CASES:
            case_dir = os.path.dirname(os.path.join(flink_fixtures, case_json))
            handle, d = fixture_handle(flink_fixtures, case_json, base=faulty_url(case_dir))
            assert cache.applies_to(handle.handles_and_offsets[0][0])
            assert digest(reader.read_all(handle)) == expected(d)
            opens = FAULTS.read_opens
            assert digest(arrays_to_changes(reader.get_changes_arrays(handle))) == expected(d)
            assert FAULTS.read_opens == opens  # second read: no download, served from the cache
        files = {h.path for case_json in CASES
                 for h, _ in fixture_handle(flink_fixtures, case_json,
                                            base=faulty_url(os.path.dirname(os.path.join(flink_fixtures, case_json))))[0].handles_and_offsets}
        assert cache.downloads == len(files) == FAULTS.read_opens
        assert sorted(cache.cached_paths()) == sorted(files)
        assert all(cache.ref_count(p) == 1 for p in files)  # only the cache's own reference left
    finally:
        cache.close()
    assert not os.path.exists(cache.directory)


# --- our own files: every compression, and S3 ---------------------------------------------------
def _write_own_file(fs_url_dir: str, compression):
    log_id = uuid.uuid4()
    sets = [
        StateChangeSet(log_id, 0, [StateChange.meta(b"meta-0"), StateChange(3, b"a" * 10), StateChange(1, b"b")]),
        StateChangeSet(log_id, 1, [StateChange(2, b"")] + [StateChange(kg % 8, bytes([kg]) * kg) for kg in range(40)]),
        StateChangeSet(log_id, 2, [StateChange.meta(b"")]),
    ]
    data, where = fmt.encode_file(sets, compression=compression)
    url = f"{fs_url_dir}/{uuid.uuid4()}"
    with fsspec.open(url, "wb") as f:
        f.write(data)
    logical_size = len(memoryview(fmt.to_logical(data)))
    stream = StreamStateHandle(url, logical_size)
    handle = ChangelogStateHandleStreamImpl([(stream, off) for off, _ in where], KeyGroupRange(0, 7),
                                            sum(s for _, s in where))
    want = []
    for s in sets:  # canonical order within a change set: metadata, then key groups ascending
        want.extend(sorted(s.changes, key=lambda c: c.key_group))
    return handle, want


@pytest.mark.parametrize("compression", [None, "snappy", "zstd"])
def test_own_files_every_compression_local_and_memory(tmp_path, compression):
    for base in (str(tmp_path), f"memory://dstl-reader-{uuid.uuid4().hex}"):
        handle, want = _write_own_file(base, compression)
        reader = StateChangelogReader()
        assert reader.read_all(handle) == want
        assert arrays_to_changes(reader.get_changes_arrays(handle)) == want
        part = handle.get_intersection(KeyGroupRange(5, 6))
        assert reader.read_all(part) == [c for c in want if c.key_group in (-1, 5, 6)]


@pytest.mark.parametrize("compression", [None, "snappy"])
def test_s3_second_read_is_served_from_the_cache(s3_bucket, tmp_path, compression, flink_fixtures):
    handle, want = _write_own_file(f"{s3_bucket}/job/dstl", compression)
    # and a Flink-written file uploaded to S3 unchanged
    src = os.path.join(flink_fixtures, "snappy-random")
    for name in os.listdir(src):
        if not name.endswith(".json"):
            fsspec.filesystem("s3").put_file(os.path.join(src, name), f"{s3_bucket}/flink/{name}")
    flink_handle, d = fixture_handle(flink_fixtures, "snappy-random/case.json", base=f"{s3_bucket}/flink")

    assert StateChangelogReader().read_all(handle) == want  # no cache: straight from S3
    cache = DownloadCache(60_000, directory=str(tmp_path))
    reader = StateChangelogReader(cache)
    try:
        assert reader.read_all(handle) == want
        assert digest(reader.read_all(flink_handle)) == expected(d)
        assert cache.downloads == 2
        # Remove the objects: the second read can only come from the local cache.
        s3 = fsspec.filesystem("s3")
        s3.rm(f"{s3_bucket}/job", recursive=True)
        s3.rm(f"{s3_bucket}/flink", recursive=True)
        s3.invalidate_cache()
        with pytest.raises(FileNotFoundError):
            StateChangelogReader().read_all(handle)
        assert reader.read_all(handle) == want
        assert digest(reader.read_all(flink_handle)) == expected(d)
        assert cache.downloads == 2 and cache.hits >= 2
        cached_files = os.listdir(cache.directory)
        assert len(cached_files) == 2
    finally:
        cache.close()
    assert not os.path.exists(cache.directory)


# --- iterator behaviour and errors --------------------------------------------------------------
def test_iterator_close_mid_way_and_twice(flink_fixtures, faulty):
    case_dir = os.path.join(flink_fixtures, "multi-sqn")
    handle, d = fixture_handle(flink_fixtures, "multi-sqn/case.json", base=faulty_url(case_dir))
    cache = DownloadCache(60_000)
    try:
        reader = StateChangelogReader(cache)
        it = reader.get_changes(handle)
        first = [next(it) for _ in range(3)]
        assert digest(first) == expected(d)[:3]
        path = handle.handles_and_offsets[0][0].path
        assert cache.ref_count(path) == 2  # the iterator holds the file open
        it.close()
        assert cache.ref_count(path) == 1
        it.close()
        assert list(it) == []
    finally:
        cache.close()


def test_local_iterator_releases_its_map(flink_fixtures):
    handle, d = fixture_handle(flink_fixtures, "preemptive/case.json")
    it = StateChangelogReader().get_changes(handle)
    assert digest([next(it)]) == expected(d)[:1]
    it.close()
    it.close()
    with pytest.raises(StopIteration):
        next(it)


def test_corrupt_files_name_the_file(tmp_path, flink_fixtures):
    src = os.path.join(flink_fixtures, "tiny-raw")
    name = [n for n in os.listdir(src) if not n.endswith(".json")][0]
    data = bytearray(open(os.path.join(src, name), "rb").read())
    bad = tmp_path / "bad-raw"
    data[1:5] = (0x7FFFFFFF).to_bytes(4, "big")  # absurd group count
    bad.write_bytes(bytes(data))
    h = ChangelogStateHandleStreamImpl([(StreamStateHandle(str(bad), len(data) - 1), 0)], KeyGroupRange(0, 9), 0)
    with pytest.raises(CorruptChangelogError) as e:
        StateChangelogReader().read_all(h)
    assert str(bad) in str(e.value)

    src = os.path.join(flink_fixtures, "tiny-snappy")
    name = [n for n in os.listdir(src) if not n.endswith(".json")][0]
    data = bytearray(open(os.path.join(src, name), "rb").read())
    data[-1] ^= 0xFF  # breaks the chunk CRC
    bad2 = tmp_path / "bad-snappy"
    bad2.write_bytes(bytes(data))
    h2 = ChangelogStateHandleStreamImpl([(StreamStateHandle(str(bad2), 1), 0)], KeyGroupRange(0, 9), 0)
    with pytest.raises(CorruptChangelogError) as e:
        StateChangelogReader().read_all(h2)
    assert str(bad2) in str(e.value)

    good, d = fixture_handle(flink_fixtures, "tiny-raw/case.json")
    stream = good.handles_and_offsets[0][0]
    beyond = ChangelogStateHandleStreamImpl([(stream, stream.size + 10)], KeyGroupRange(0, 9), 0)
    with pytest.raises(CorruptChangelogError) as e:
        StateChangelogReader().read_all(beyond)
    assert stream.path in str(e.value)


def test_missing_file_and_wrong_handle_type(tmp_path):
    h = ChangelogStateHandleStreamImpl([(StreamStateHandle(str(tmp_path / "nope"), 3), 0)], KeyGroupRange(0, 1), 0)
    with pytest.raises(FileNotFoundError):
        StateChangelogReader().read_all(h)
    with pytest.raises(TypeError):
        StateChangelogReader().get_changes("not a handle")


def test_empty_handle_and_empty_file(tmp_path):
    assert StateChangelogReader().read_all(ChangelogStateHandleStreamImpl([], KeyGroupRange(0, 1), 0)) == []
    empty = tmp_path / "empty"
    empty.write_bytes(b"")
    h = ChangelogStateHandleStreamImpl([(StreamStateHandle(str(empty), 0), 0)], KeyGroupRange(0, 1), 0)
    with pytest.raises(CorruptChangelogError):
        StateChangelogReader().read_all(h)


# --- the download cache -------------------------------------------------------------------------
def _remote_copy(flink_fixtures, tmp_path, case="multi-sqn"):
    dst = tmp_path / "remote" / case
    shutil.copytree(os.path.join(flink_fixtures, case), dst)
    return fixture_handle(str(tmp_path / "remote"), f"{case}/case.json", base=faulty_url(dst))


def _wait_until(cond, timeout=10.0):
    deadline = time.monotonic() + timeout
    while time.monotonic() < deadline:
        if cond():
            return True
        time.sleep(0.01)
    return False


def test_cache_idle_timeout_deletes_the_temp_file(flink_fixtures, tmp_path, faulty):
    handle, d = _remote_copy(flink_fixtures, tmp_path)
    cache = DownloadCache(150, directory=str(tmp_path / "c"))
    try:
        reader = StateChangelogReader(cache)
        assert digest(reader.read_all(handle)) == expected(d)
        assert len(cache.cached_paths()) == 1 and len(os.listdir(cache.directory)) == 1
        assert _wait_until(lambda: not cache.cached_paths())
        assert os.listdir(cache.directory) == []
        # expired: the next read downloads again
        assert digest(reader.read_all(handle)) == expected(d)
        assert cache.downloads == 2 and FAULTS.read_opens == 2
    finally:
        cache.close()


def test_cache_entry_in_use_is_not_expired(flink_fixtures, tmp_path, faulty):
    handle, d = _remote_copy(flink_fixtures, tmp_path)
    cache = DownloadCache(0)  # expire as soon as idle
    try:
        reader = StateChangelogReader(cache)
        it = reader.get_changes(handle)
        next(it)
        time.sleep(0.1)
        assert len(cache.cached_paths()) == 1  # held by the open iterator
        rest = list(it)
        assert digest(rest) == expected(d)[1:]
        assert _wait_until(lambda: not cache.cached_paths())
    finally:
        cache.close()


def test_cache_close_deletes_everything_and_later_opens_fail(flink_fixtures, tmp_path, faulty):
    handle, d = _remote_copy(flink_fixtures, tmp_path)
    cache = DownloadCache(60_000)
    reader = StateChangelogReader(cache)
    it = reader.get_changes(handle)
    next(it)  # a stream is open while the cache closes
    directory = cache.directory
    assert os.listdir(directory)
    cache.close()
    cache.close()
    assert not os.path.exists(directory) and cache.closed
    it.close()
    with pytest.raises(RuntimeError, match="closed"):
        reader.read_all(handle)


def test_cache_concurrent_opens_download_once(flink_fixtures, tmp_path, faulty):
    handle, d = _remote_copy(flink_fixtures, tmp_path, "snappy-random")
    FAULTS.hang_reads(0.3)  # the first download is slow, so the others pile up behind it
    cache = DownloadCache(60_000)
    results, errors = [], []

    def read():
        try:
            results.append(digest(StateChangelogReader(cache).read_all(handle)))
        except BaseException as exc:  # pragma: no cover - reported below
            errors.append(exc)

    try:
        threads = [threading.Thread(target=read) for _ in range(6)]
        for t in threads:
            t.start()
        for t in threads:
            t.join(30)
        assert not errors and len(results) == 6 and all(r == expected(d) for r in results)
        assert cache.downloads == 1 and FAULTS.read_opens == 1
    finally:
        cache.close()


def test_cache_download_failure_is_reported_and_retried_next_time(flink_fixtures, tmp_path, faulty):
    handle, d = _remote_copy(flink_fixtures, tmp_path)
    cache = DownloadCache(60_000)
    try:
        reader = StateChangelogReader(cache)
        FAULTS.fail_reads(1)
        with pytest.raises(OSError, match="faulty"):
            reader.read_all(handle)
        assert cache.cached_paths() == [] and os.listdir(cache.directory) == []
        assert digest(reader.read_all(handle)) == expected(d)
        assert cache.downloads == 1 and FAULTS.read_opens == 2
    finally:
        cache.close()


def test_cache_corrupt_download_is_not_cached(tmp_path, faulty):
    bad = tmp_path / "bad"
    bad.write_bytes(b"\x07garbage")  # unknown flag
    h = ChangelogStateHandleStreamImpl([(StreamStateHandle(faulty_url(bad), 7), 0)], KeyGroupRange(0, 1), 0)
    cache = DownloadCache(60_000)
    try:
        with pytest.raises(CorruptChangelogError):
            StateChangelogReader(cache).read_all(h)
        assert cache.cached_paths() == []
    finally:
        cache.close()


def test_cache_bypassed_for_local_files(flink_fixtures):
    handle, d = fixture_handle(flink_fixtures, "tiny-snappy/case.json")
    cache = DownloadCache(60_000)
    try:
        assert not cache.applies_to(handle.handles_and_offsets[0][0])
        assert digest(StateChangelogReader(cache).read_all(handle)) == expected(d)
        assert cache.downloads == 0 and os.listdir(cache.directory) == []
    finally:
        cache.close()


def test_cache_validates_timeout():
    for bad in (-1, 1.5, True, None):
        with pytest.raises(ValueError):
            DownloadCache(bad)


def test_cache_closed_during_a_download(flink_fixtures, tmp_path, faulty):
    handle, d = _remote_copy(flink_fixtures, tmp_path)
    FAULTS.hang_reads(10)  # the download blocks until released
    cache = DownloadCache(60_000)
    errors = []

    def read():
        try:
            StateChangelogReader(cache).read_all(handle)
        except BaseException as exc:
            errors.append(exc)

    t = threading.Thread(target=read)
    t.start()
    assert _wait_until(lambda: FAULTS.read_opens == 1)
    cache.close()
    FAULTS.release_hangs()
    t.join(10)
    assert not t.is_alive()
    assert len(errors) == 1 and isinstance(errors[0], RuntimeError) and "closed" in str(errors[0])
    assert not os.path.exists(cache.directory)


def test_cache_bypassed_for_the_memory_filesystem():
    handle, want = _write_own_file(f"memory://dstl-reader-{uuid.uuid4().hex}", "zstd")
    cache = DownloadCache(60_000)
    try:
        assert not cache.applies_to(handle.handles_and_offsets[0][0])
        assert StateChangelogReader(cache).read_all(handle) == want
        assert cache.downloads == 0
    finally:
        cache.close()


def test_generator_protocol_next_and_for_share_one_position(flink_fixtures):
    handle, d = fixture_handle(flink_fixtures, "multi-sqn/case.json")
    it = StateChangelogReader().get_changes(handle)
    first = next(it)
    rest = [c for c in it]
    assert digest([first] + rest) == expected(d)
    with pytest.raises(StopIteration):
        next(it)
    it.close()


def test_interleaved_files_switch_sources_and_release_them(tmp_path, faulty):
    local_dir = tmp_path / "remote"
    local_dir.mkdir()
    h1, want1 = _write_own_file(faulty_url(local_dir), None)
    h2, want2 = _write_own_file(faulty_url(local_dir), "snappy")
    e1, e2 = h1.handles_and_offsets, h2.handles_and_offsets
    mixed = ChangelogStateHandleStreamImpl([e1[0], e2[0], e1[1], e2[1], e2[2], e1[2]], KeyGroupRange(0, 7), 0)

    def sets(want_all, handle):  # expected changes per entry of `handle`
        per, i = [], 0
        reader = StateChangelogReader()
        for entry in handle.handles_and_offsets:
            single = ChangelogStateHandleStreamImpl([entry], KeyGroupRange(0, 7), 0)
            got = reader.read_all(single)
            per.append(got)
            i += len(got)
        assert [c for p in per for c in p] == want_all
        return per

    s1, s2 = sets(want1, h1), sets(want2, h2)
    want = s1[0] + s2[0] + s1[1] + s2[1] + s2[2] + s1[2]
    cache = DownloadCache(60_000)
    try:
        reader = StateChangelogReader(cache)
        assert reader.read_all(mixed) == want
        assert arrays_to_changes(reader.get_changes_arrays(mixed)) == want
        assert cache.downloads == 2
        assert all(cache.ref_count(h.path) == 1 for h in (e1[0][0], e2[0][0]))
    finally:
        cache.close()
    assert StateChangelogReader().read_all(mixed) == want  # without a cache too


def test_cache_copies_large_raw_files_in_chunks(tmp_path, faulty):
    import uuid as _uuid

    big = os.urandom(9 << 20)  # spans three 4 MiB copy chunks
    sets = [StateChangeSet(_uuid.uuid4(), 0, [StateChange.meta(b"m"), StateChange(1, big), StateChange(2, b"x")])]
    data, where = fmt.encode_file(sets)
    (tmp_path / "big").write_bytes(data)
    stream = StreamStateHandle(faulty_url(tmp_path / "big"), len(data) - 1)
    h = ChangelogStateHandleStreamImpl([(stream, where[0][0])], KeyGroupRange(0, 1), where[0][1])
    cache = DownloadCache(60_000)
    try:
        got = StateChangelogReader(cache).read_all(h)
        assert [c.key_group for c in got] == [-1, 1] and got[1].data == big  # kg 2 filtered out
        cached = os.path.join(cache.directory, os.listdir(cache.directory)[0])
        assert os.path.getsize(cached) == len(data) - 1  # the logical stream: flag byte dropped
    finally:
        cache.close()


def test_cache_stress_with_immediate_expiry(flink_fixtures, tmp_path, faulty):
    handles = [_remote_copy(flink_fixtures, tmp_path, case) for case in ("multi-sqn", "tiny-snappy", "preemptive")]
    cache = DownloadCache(0)  # every idle moment may delete the temp file
    errors = []

    def worker(seed):
        import random

        rng = random.Random(seed)
        reader = StateChangelogReader(cache)
        try:
            for _ in range(15):
                handle, d = rng.choice(handles)
                assert digest(reader.read_all(handle)) == expected(d)
        except BaseException as exc:
            errors.append(exc)

    try:
        threads = [threading.Thread(target=worker, args=(i,)) for i in range(6)]
        for t in threads:
            t.start()
        for t in threads:
            t.join(60)
        assert not errors, errors[:3]
        assert _wait_until(lambda: not cache.cached_paths())
        assert os.listdir(cache.directory) == []
        assert cache.downloads >= 3
    finally:
        cache.close()
