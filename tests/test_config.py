"""StorageConfig: keys in both spellings, Flink value syntax (docs/options.md §3), validation, round trip."""
from __future__ import annotations

import datetime
import pickle

import pytest

from dstl.config import (OPTIONS, PREFIX, PREFIX_2X, StorageConfig, parse_bool, parse_duration_ms,
                         parse_int, parse_memory_size)

BASE = {"dstl.dfs.base-path": "/tmp/dstl-base"}


def cfg(**suffix_values) -> StorageConfig:
    mapping = dict(BASE)
    for k, v in suffix_values.items():
        mapping[k] = v
    return StorageConfig.from_mapping(mapping)


# --- defaults -----------------------------------------------------------------------------------
def test_defaults_are_flinks():
    c = StorageConfig.from_mapping(BASE)
    assert c.base_path == "/tmp/dstl-base"
    assert c.compression_enabled is False and c.compression is None
    assert c.compression_codec == "snappy"
    assert c.preemptive_persist_threshold == 5 * 1024 * 1024
    assert c.persist_delay_ms == 10
    assert c.persist_size_threshold == 10 * 1024 * 1024
    assert c.upload_buffer_size == 1024 * 1024
    assert c.upload_num_threads == 5
    assert c.discard_num_threads == 1
    assert c.max_in_flight == 100 * 1024 * 1024
    assert c.retry_policy == "fixed"
    assert c.upload_timeout_ms == 1000
    assert c.max_attempts == 3
    assert c.next_attempt_delay_ms == 500
    assert c.cache_idle_timeout_ms == 600_000
    assert c.upload_mode == "process"  # docs/options.md default now that the upload service exists


def test_every_option_in_both_spellings():
    values = {
        "base-path": ("s3://bucket/x", "base_path", "s3://bucket/x"),
        "compression.enabled": ("TRUE", "compression_enabled", True),
        "compression.codec": ("zstd", "compression_codec", "zstd"),
        "preemptive-persist-threshold": ("64kb", "preemptive_persist_threshold", 65536),
        "batch.persist-delay": ("1s", "persist_delay_ms", 1000),
        "batch.persist-size-threshold": ("1 MB", "persist_size_threshold", 1048576),
        "upload.buffer-size": ("4k", "upload_buffer_size", 4096),
        "upload.num-threads": ("7", "upload_num_threads", 7),
        "discard.num-threads": (3, "discard_num_threads", 3),
        "upload.max-in-flight": ("2 gb", "max_in_flight", 2 << 30),
        "upload.retry-policy": ("none", "retry_policy", "none"),
        "upload.timeout": ("2 min", "upload_timeout_ms", 120_000),
        "upload.max-attempts": ("9", "max_attempts", 9),
        "upload.next-attempt-delay": ("0", "next_attempt_delay_ms", 0),
        "download.local-cache.idle-timeout-ms": ("155", "cache_idle_timeout_ms", 155),
        "upload.mode": ("direct", "upload_mode", "direct"),
    }
    assert set(values) == {o.suffix for o in OPTIONS}
    for prefix in (PREFIX, PREFIX_2X):
        mapping = {prefix + suffix: raw for suffix, (raw, _, _) in values.items()}
        c = StorageConfig.from_mapping(mapping)
        for suffix, (_, field, expected) in values.items():
            assert getattr(c, field) == expected, (prefix, suffix)
    assert StorageConfig.from_mapping({PREFIX_2X + s: v[0] for s, v in values.items()}).compression == "zstd"


def test_mixed_spellings_and_equal_duplicates_are_fine():
    c = StorageConfig.from_mapping({
        "state.changelog.dstl.dfs.base-path": "/x",
        "dstl.dfs.batch.persist-delay": "1s",
        "state.changelog.dstl.dfs.batch.persist-delay": "1000 ms",  # same parsed value
    })
    assert c.base_path == "/x" and c.persist_delay_ms == 1000


def test_conflicting_spellings_name_both_keys():
    with pytest.raises(ValueError) as e:
        StorageConfig.from_mapping({**BASE, "dstl.dfs.upload.max-attempts": 3,
                                    "state.changelog.dstl.dfs.upload.max-attempts": 4})
    assert "dstl.dfs.upload.max-attempts" in str(e.value)
    assert "state.changelog.dstl.dfs.upload.max-attempts" in str(e.value)


@pytest.mark.parametrize("key", [
    "dstl.dfs.upload.num-thread",           # typo
    "state.changelog.enabled",              # Flink, but not a dstl option
    "state.changelog.storage",
    "io.tmp.dirs",
    "DSTL.DFS.BASE-PATH",                   # keys are case-sensitive
    "state.changelog.dstl.dfs.",
    "dstl.dfs.",
    "dstl.dfs.upload_mode",
])
def test_unknown_key_is_named(key):
    with pytest.raises(ValueError) as e:
        StorageConfig.from_mapping({**BASE, key: "1"})
    assert repr(key) in str(e.value)


def test_missing_base_path():
    with pytest.raises(ValueError, match="base-path"):
        StorageConfig.from_mapping({"dstl.dfs.upload.num-threads": 2})
    with pytest.raises(ValueError, match="base-path"):
        StorageConfig.from_mapping({"dstl.dfs.base-path": "  "})


def test_not_a_mapping():
    with pytest.raises(TypeError):
        StorageConfig.from_mapping([("dstl.dfs.base-path", "/x")])


# --- Duration (OPTIONS §3) ----------------------------------------------------------------------
@pytest.mark.parametrize("text,ms", [
    ("10 ms", 10), ("1s", 1000), ("500ms", 500), ("10 min", 600_000), ("1 MIN", 60_000),
    ("2m", 120_000), ("155", 155), ("  155  ms ", 155), ("0", 0), ("3 d", 3 * 86_400_000),
    ("1 day", 86_400_000), ("2 hours", 7_200_000), ("1H", 3_600_000), ("5 secs", 5000),
    ("7 milliseconds", 7), ("1500 micros", 1), ("500 micros", 0), ("999999 ns", 0),
    ("2000000 nanos", 2), ("3000 \u00b5s", 3), ("1 Second", 1000), ("1MINUTES", 60_000),
    ("9223372036854775807", 2**63 - 1), ("9223372036854775807 ns", (2**63 - 1) // 1_000_000),
])
def test_duration_valid(text, ms):
    assert parse_duration_ms(text, "k") == ms
    assert cfg(**{"dstl.dfs.batch.persist-delay": text}).persist_delay_ms == ms


@pytest.mark.parametrize("text", [
    "", "   ", "-100 ms", "1.5s", "16 gjah", "16 16 ms", "ms", "+5 ms", "1e3", "5 mb",
    "9223372036854775808",              # digits overflow int64
    "9223372036854775807 s",            # milliseconds overflow int64
    "106751991167301 d",                # ms overflow
    "\u0662\u0665 ms",                  # Arabic-Indic digits are not ASCII digits
    "5 \u03bcs",                        # Greek mu is not the micro sign
])
def test_duration_invalid_names_key_and_value(text):
    with pytest.raises(ValueError) as e:
        cfg(**{"state.changelog.dstl.dfs.upload.timeout": text})
    assert "state.changelog.dstl.dfs.upload.timeout" in str(e.value)
    assert repr(text) in str(e.value)


def test_duration_python_values():
    assert parse_duration_ms(25, "k") == 25
    assert parse_duration_ms(datetime.timedelta(seconds=1.5), "k") == 1500
    assert parse_duration_ms(datetime.timedelta(microseconds=999), "k") == 0
    for bad in (True, 1.0, -1, datetime.timedelta(milliseconds=-1), None, b"10 ms"):
        with pytest.raises(ValueError, match="'k'"):
            parse_duration_ms(bad, "k")


def test_micro_sign_is_not_casefolded():
    # 'µ'.casefold() is Greek mu; Flink lower-cases, and 'µS' must still be the micro sign
    assert parse_duration_ms("2000 \u00b5S", "k") == 2


# --- MemorySize ---------------------------------------------------------------------------------
@pytest.mark.parametrize("text,size", [
    ("5mb", 5_242_880), ("1 MB", 1_048_576), ("1024", 1024), ("64kb", 65_536), ("0", 0),
    ("3 b", 3), ("2 bytes", 2), ("1k", 1024), ("1 KiBiBytes", 1024), ("1m", 1 << 20),
    ("1 mebibytes", 1 << 20), ("1g", 1 << 30), ("1 GB", 1 << 30), ("2 t", 2 << 40), ("1 TB", 1 << 40),
    (" 7   kb ", 7168), ("9223372036854775807", 2**63 - 1),
])
def test_memory_size_valid(text, size):
    assert parse_memory_size(text, "k") == size


@pytest.mark.parametrize("text", ["1.5mb", "-1", "5 xb", "mb", "", "  ", "8388608 tb", "1 mib", "10 ms"])
def test_memory_size_invalid(text):
    with pytest.raises(ValueError) as e:
        cfg(**{"dstl.dfs.preemptive-persist-threshold": text})
    assert "dstl.dfs.preemptive-persist-threshold" in str(e.value) and repr(text) in str(e.value)


def test_memory_size_python_values():
    assert parse_memory_size(4096, "k") == 4096
    for bad in (True, 4096.0, -5, None):
        with pytest.raises(ValueError, match="'k'"):
            parse_memory_size(bad, "k")


# --- bool, int, enum ----------------------------------------------------------------------------
def test_bool():
    for text, value in (("true", True), ("FALSE", False), ("True", True), (True, True), (False, False)):
        assert parse_bool(text, "k") is value
    for bad in ("yes", "1", 1, 0, "", None):
        with pytest.raises(ValueError, match="'k'"):
            parse_bool(bad, "k")


def test_int():
    assert parse_int("12", "k") == 12 and parse_int(12, "k") == 12 and parse_int(" 3 ", "k") == 3
    for bad in (True, "1.0", "ten", 2.0, "2147483648", 2**31, None):
        with pytest.raises(ValueError, match="'k'"):
            parse_int(bad, "k")


@pytest.mark.parametrize("key,bad", [
    ("dstl.dfs.upload.retry-policy", "FIXED"), ("dstl.dfs.upload.retry-policy", "exponential"),
    ("dstl.dfs.upload.mode", "Thread"), ("dstl.dfs.upload.mode", "threads"),
    ("dstl.dfs.compression.codec", "gzip"), ("dstl.dfs.compression.codec", "Snappy"),
    ("dstl.dfs.upload.mode", 1),
])
def test_enums_are_exact_lower_case(key, bad):
    with pytest.raises(ValueError) as e:
        cfg(**{key: bad})
    assert key in str(e.value) and repr(bad) in str(e.value)


def test_upload_modes():
    for mode in ("process", "thread", "direct"):
        assert cfg(**{"dstl.dfs.upload.mode": mode}).upload_mode == mode


# --- validation ---------------------------------------------------------------------------------
@pytest.mark.parametrize("key,value", [
    ("dstl.dfs.upload.buffer-size", 0),
    ("dstl.dfs.upload.buffer-size", "2 gb"),          # 2^31 > 2^31-1
    ("dstl.dfs.upload.num-threads", 0),
    ("dstl.dfs.discard.num-threads", "0"),
    ("dstl.dfs.upload.max-in-flight", "0 b"),
    ("dstl.dfs.upload.max-attempts", 0),
    ("dstl.dfs.upload.num-threads", -1),
])
def test_out_of_range_values_name_the_key(key, value):
    with pytest.raises(ValueError) as e:
        cfg(**{key: value})
    assert key in str(e.value)


def test_buffer_size_bounds():
    assert cfg(**{"dstl.dfs.upload.buffer-size": 1}).upload_buffer_size == 1
    assert cfg(**{"dstl.dfs.upload.buffer-size": 2**31 - 1}).upload_buffer_size == 2**31 - 1


def test_persist_size_threshold_must_not_exceed_max_in_flight():
    c = cfg(**{"dstl.dfs.batch.persist-size-threshold": "1mb", "dstl.dfs.upload.max-in-flight": "1mb"})
    assert c.persist_size_threshold == c.max_in_flight == 1 << 20
    with pytest.raises(ValueError) as e:
        cfg(**{"dstl.dfs.batch.persist-size-threshold": "2mb", "dstl.dfs.upload.max-in-flight": "1mb"})
    assert "batch.persist-size-threshold" in str(e.value) and "upload.max-in-flight" in str(e.value)
    with pytest.raises(ValueError):  # default threshold (10 mb) above a small limit
        cfg(**{"dstl.dfs.upload.max-in-flight": "5mb"})


def test_zero_values_allowed_where_documented():
    c = cfg(**{"dstl.dfs.preemptive-persist-threshold": 0, "dstl.dfs.batch.persist-delay": 0,
               "dstl.dfs.upload.timeout": "0 s", "dstl.dfs.upload.next-attempt-delay": 0,
               "dstl.dfs.download.local-cache.idle-timeout-ms": 0, "dstl.dfs.batch.persist-size-threshold": 0})
    assert (c.preemptive_persist_threshold, c.persist_delay_ms, c.upload_timeout_ms) == (0, 0, 0)
    assert (c.next_attempt_delay_ms, c.cache_idle_timeout_ms, c.persist_size_threshold) == (0, 0, 0)


def test_direct_construction_validates_and_parses():
    c = StorageConfig("/x", persist_delay_ms="1 s", max_in_flight="200mb")
    assert c.persist_delay_ms == 1000 and c.max_in_flight == 200 << 20
    with pytest.raises(ValueError, match="dstl.dfs.upload.max-attempts"):
        StorageConfig("/x", max_attempts=0)
    with pytest.raises(ValueError, match="dstl.dfs.upload.mode"):
        StorageConfig("/x", upload_mode="fast")
    with pytest.raises(Exception):
        c.max_attempts = 5  # frozen


# --- round trip and helpers ---------------------------------------------------------------------
def test_to_mapping_round_trip():
    c = StorageConfig.from_mapping({
        "state.changelog.dstl.dfs.base-path": "memory://x", "dstl.dfs.compression.enabled": "true",
        "dstl.dfs.compression.codec": "zstd", "dstl.dfs.batch.persist-delay": "3 s",
        "dstl.dfs.upload.max-in-flight": "1 gb", "dstl.dfs.upload.retry-policy": "none",
        "dstl.dfs.upload.mode": "direct", "dstl.dfs.upload.timeout": "1500 micros",
    })
    m = c.to_mapping()
    assert all(k.startswith("dstl.dfs.") and not k.startswith("state.") for k in m)
    assert len(m) == len(OPTIONS)
    assert m["dstl.dfs.batch.persist-delay"] == 3000 and m["dstl.dfs.upload.timeout"] == 1
    assert StorageConfig.from_mapping(m) == c
    s = c.to_mapping(as_strings=True)
    assert s["dstl.dfs.batch.persist-delay"] == "3000 ms" and s["dstl.dfs.upload.max-in-flight"] == "1073741824 b"
    assert all(isinstance(v, str) for v in s.values())
    assert StorageConfig.from_mapping(s) == c
    assert pickle.loads(pickle.dumps(c)) == c


def test_from_options_keyword_form():
    c = StorageConfig.from_options("/base", batch_persist_delay="20 ms", upload_mode="direct",
                                   download_local_cache_idle_timeout_ms=5, max_attempts=2)
    assert (c.base_path, c.persist_delay_ms, c.upload_mode, c.cache_idle_timeout_ms, c.max_attempts) == \
        ("/base", 20, "direct", 5, 2)
    with pytest.raises(ValueError, match="bogus_option"):
        StorageConfig.from_options("/base", bogus_option=1)
    with pytest.raises(ValueError, match="'dstl.dfs.upload.num-threads'"):
        StorageConfig.from_options("/base", upload_num_threads="many")


def test_of_and_replace():
    c = StorageConfig.of(BASE)
    assert StorageConfig.of(c) is c
    d = c.replace(upload_num_threads=2)
    assert d.upload_num_threads == 2 and c.upload_num_threads == 5
    with pytest.raises(ValueError):
        c.replace(upload_num_threads=0)


def test_pathlike_base_path(tmp_path):
    assert StorageConfig.from_mapping({"dstl.dfs.base-path": tmp_path}).base_path == str(tmp_path)
