"""The same StatefulProcessor, the same JSON file stream: Spark's native transformWithStateInPandas
(RocksDB state) and dstl's StatefulStream must commit the same output.

Each native run is also checked against a pandas computation (tests/streaming_util.py), so a
difference points at the engine that is wrong. Heavy (a native query per processor): Cython build
only; the pure-Python twins run the same dstl logic in the lighter StatefulStream tests.
"""
from __future__ import annotations

import os

import pandas as pd
import pytest

from conftest import heavy
from processors import (COUNT_OUTPUT, SESSION_GAP_MS, SESSION_OUTPUT, TTL_OUTPUT, CountingProcessor,
                        SessionProcessor, TtlProcessor, count_fn)
from streaming_util import (EVENTS_SCHEMA, make_batches, normalize, reference_counts, reference_sessions,
                            reference_ttl, run_dstl, run_native, write_json_stream)

pytestmark = [pytest.mark.spark, pytest.mark.slow, heavy]



def _has_stateful_stream() -> bool:
    try:
        from dstl.spark import StatefulStream  # noqa: F401
    except (ImportError, AttributeError):
        return False
    return True


# StatefulStream (issue 11) is built on another branch; until both are on main, the native half runs
needs_stream = pytest.mark.skipif(not _has_stateful_stream(), reason="dstl.spark.StatefulStream is not in this tree yet")

N_BATCHES, EVENTS_PER_BATCH, N_KEYS = 3, 800, 500
WATERMARK_DELAY = "10 seconds"
WATERMARK_DELAY_MS = 10_000

COUNT_COLS = ["user", "events", "value_sum", "batches", "kinds", "top_kind_events", "batch_id"]
TTL_COLS = ["user", "total", "previous", "batch_id"]
SESSION_COLS = ["user", "first_ms", "last_ms", "events", "fired_at_ms", "batch_id"]


@pytest.fixture(scope="module")
def stream_input(tmp_path_factory):
    """The file stream: 3 JSON files (one per micro-batch) and the same events as pandas."""
    batches = make_batches(N_BATCHES, EVENTS_PER_BATCH, N_KEYS)
    directory = str(tmp_path_factory.mktemp("events"))
    write_json_stream(directory, batches)
    return directory, batches


@pytest.fixture(scope="module")
def native(spark, stream_input, tmp_path_factory):
    """Native runs, one per processor, done once for the module and cached by name."""
    source, _ = stream_input
    runs = {}

    def get(name):
        if name not in runs:
            ckpt = str(tmp_path_factory.mktemp(f"native-{name}"))
            if name == "count":
                runs[name] = run_native(spark, source, CountingProcessor(), COUNT_OUTPUT, ckpt)
            elif name == "ttl":
                runs[name] = run_native(spark, source, TtlProcessor(), TTL_OUTPUT, ckpt, time_mode="ProcessingTime")
            else:
                runs[name] = run_native(spark, source, SessionProcessor(), SESSION_OUTPUT, ckpt,
                                        time_mode="EventTime", output_mode="Append",
                                        watermark_delay=WATERMARK_DELAY)
        return runs[name]

    return get


def _assert_same(actual: pd.DataFrame, expected: pd.DataFrame, columns, what: str) -> None:
    a, e = normalize(actual, columns), normalize(expected, columns)
    if not a.equals(e):
        merged = a.merge(e, how="outer", indicator=True)
        diff = merged[merged["_merge"] != "both"]
        pytest.fail(f"{what}: {len(a)} vs {len(e)} rows, {len(diff)} differ:\n{diff.head(20).to_string()}")


# --- the native side against pandas: the harness and the references are right -------------------

def test_native_counting_matches_pandas(native, stream_input):
    run = native("count")
    _assert_same(run.output, reference_counts(stream_input[1]), COUNT_COLS, "native counting vs pandas")
    assert sorted(run.output["batch_id"].unique()) == list(range(N_BATCHES))
    # all three state kinds ran in Spark's state store
    assert run.progress[-1]["stateOperators"][0]["operatorName"] == "transformWithStateInPandasExec"


def test_native_ttl_matches_pandas(native, stream_input):
    _assert_same(native("ttl").output, reference_ttl(stream_input[1]), TTL_COLS, "native TTL vs pandas")


def test_native_sessions_match_pandas(native, stream_input):
    run = native("session")
    expected = reference_sessions(stream_input[1], WATERMARK_DELAY_MS, SESSION_GAP_MS)
    _assert_same(run.output, expected, SESSION_COLS, "native sessions vs pandas")
    # the input makes both timer cases happen: sessions closed in batch 1 and in batch 2
    assert set(expected["batch_id"]) == {1, 2}
    # and keys that got input in the batch whose watermark had passed their old timer (input first,
    # so the session goes on): their sessions span more than one batch
    assert ((expected["last_ms"] - expected["first_ms"]) > 60_000).any()


# --- dstl's StatefulStream against the native output ------------------------------------------------

@needs_stream
def test_stream_counting_processor_matches_native(spark, native, stream_input, tmp_path):
    source, _ = stream_input
    out = run_dstl(spark, source, CountingProcessor(), COUNT_OUTPUT, str(tmp_path / "job"),
                   str(tmp_path / "ckpt"), parallelism=2)
    _assert_same(out, native("count").output, COUNT_COLS, "StatefulStream(CountingProcessor) vs native")


@needs_stream
def test_stream_vectorised_fn_matches_native(spark, native, stream_input, tmp_path):
    source, _ = stream_input
    out = run_dstl(spark, source, count_fn, COUNT_OUTPUT, str(tmp_path / "job"), str(tmp_path / "ckpt"),
                   parallelism=3)
    _assert_same(out, native("count").output, COUNT_COLS, "StatefulStream(count_fn) vs native")


@needs_stream
def test_stream_ttl_processor_matches_native(spark, native, stream_input, tmp_path):
    source, _ = stream_input
    out = run_dstl(spark, source, TtlProcessor(), TTL_OUTPUT, str(tmp_path / "job"), str(tmp_path / "ckpt"),
                   parallelism=2, time_mode="ProcessingTime")
    _assert_same(out, native("ttl").output, TTL_COLS, "StatefulStream(TtlProcessor) vs native")


@needs_stream
def test_stream_session_processor_matches_native(spark, native, stream_input, tmp_path):
    source, _ = stream_input
    out = run_dstl(spark, source, SessionProcessor(), SESSION_OUTPUT, str(tmp_path / "job"),
                   str(tmp_path / "ckpt"), parallelism=3, time_mode="EventTime", event_time_column="ts",
                   watermark_delay=WATERMARK_DELAY)
    _assert_same(out, native("session").output, SESSION_COLS, "StatefulStream(SessionProcessor) vs native")


@needs_stream
def test_stream_run_on_static_dataframes_matches_native(spark, native, stream_input, tmp_path):
    """`stream.run(df)` once per file: one checkpoint per call, the same rows as the native stream."""
    from pyspark.sql import functions as F

    from dstl.spark import StatefulStream
    from streaming_util import read_output

    source, _ = stream_input
    stream = StatefulStream(str(tmp_path / "job"), CountingProcessor(), COUNT_OUTPUT, key="user", parallelism=2)
    for b in range(N_BATCHES):
        df = (spark.read.schema(EVENTS_SCHEMA).json(os.path.join(source, f"batch-{b:05d}.json"))
              .withColumn("ts", F.timestamp_millis("ts_ms")))
        stream.run(df)
    out = read_output(str(tmp_path / "job" / "output"))
    _assert_same(out, native("count").output, COUNT_COLS, "StatefulStream.run(static) vs native")
