"""The Row API (PySpark 4.1+'s `transformWithState`) on dstl: `StatefulStream(..., api="row")`.

The runner tests drive `run_processor` on a real `KeyedStateBackend` (no Spark session: both
implementations); one light Spark test runs `StatefulStream(api="row").run(df)`; the comparisons with
Spark's native `transformWithState` (the same processor object, the same file stream) are heavy and
run once, under the Cython build.
"""
from __future__ import annotations

import datetime as dt
import os
import subprocess
import sys
import textwrap

import numpy as np
import pandas as pd
import pyarrow as pa
import pytest
from pyspark.sql import Row
from pyspark.sql.streaming import StatefulProcessor

from conftest import heavy
from processors import (COUNT_OUTPUT, INITIAL_OUTPUT, SESSION_GAP_MS, SESSION_OUTPUT, TTL_OUTPUT,
                        CountingProcessor, RowCountingProcessor, RowSeededCounter, RowSessionProcessor,
                        RowTtlProcessor, SessionProcessor)
from state_helpers import FULL, MAXP, storage  # noqa: F401 - fixture
from streaming_util import (EVENTS_SCHEMA, make_batches, normalize, reference_counts, reference_sessions,
                            reference_ttl, run_dstl, run_native, write_json_stream)

COUNT_COLS = ["user", "events", "value_sum", "batches", "kinds", "top_kind_events", "batch_id"]
SESSION_COLS = ["user", "first_ms", "last_ms", "events", "fired_at_ms", "batch_id"]
TTL_COLS = ["user", "total", "previous", "batch_id"]


def _backend(storage, name="op"):
    from dstl.state.backend import KeyedStateBackend

    return KeyedStateBackend(storage, name, FULL, MAXP)


def _ctx(ts_ms, output, *, api="row", watermark=0, time_mode="None", initial=None, initial_schema=None,
         input_schema=EVENTS_SCHEMA + ", ts timestamp", tz="UTC"):
    from dstl.spark.task import arrow_output_schema as _arrow_output_schema
    from dstl.spark.processor import BatchContext
    from dstl.state.schema import parse_ddl

    return BatchContext(ts_ms, watermark, time_mode, initial, api=api, input_schema=parse_ddl(input_schema),
                        initial_schema=initial_schema, time_zone=tz,
                        output_arrow_schema=_arrow_output_schema(parse_ddl(output)))


def _with_ts(batch: pd.DataFrame) -> pd.DataFrame:
    """The events as a pandas-fed task gets them: `ts` naive, in the session time zone (UTC)."""
    out = batch.copy()
    out["ts"] = pd.to_datetime(out["ts_ms"], unit="ms")
    return out


def _same(actual: pd.DataFrame, expected: pd.DataFrame, columns, what: str) -> None:
    a, e = normalize(actual, columns), normalize(expected, columns)
    if not a.equals(e):
        merged = a.merge(e, how="outer", indicator=True)
        pytest.fail(f"{what}: {len(a)} vs {len(e)} rows; differing:\n"
                    f"{merged[merged['_merge'] != 'both'].head(20).to_string()}")


# --- the runner, without Spark ----------------------------------------------------------------------

def test_row_runner_counts_like_the_pandas_runner_and_builds_no_frame_per_key(storage, monkeypatch):
    from dstl.spark.processor import run_processor

    batches = make_batches(3, 600, 150)
    rows_b, pandas_b = _backend(storage, "rows"), _backend(storage, "pandas")
    built = []
    real_init = pd.DataFrame.__init__

    def counting_init(self, *a, **kw):  # every pandas DataFrame built while the row runner runs
        built.append(1)
        real_init(self, *a, **kw)

    outs = []
    for b, batch in enumerate(batches):
        rows = _with_ts(batch)
        monkeypatch.setattr(pd.DataFrame, "__init__", counting_init)
        try:
            out = run_processor(RowCountingProcessor(), rows, rows_b, _ctx(1000 + b, COUNT_OUTPUT), "user")
        finally:
            monkeypatch.setattr(pd.DataFrame, "__init__", real_init)
        assert isinstance(out, pa.RecordBatch) and out.schema.names == COUNT_COLS[:-1]
        # per subtask a handful of frames at most (the key-sorted input), never one per key
        assert len(built) <= 3, f"{len(built)} DataFrames built for {rows['user'].nunique()} keys"
        built.clear()
        outs.append(out.to_pandas().assign(batch_id=b))
        twin = run_processor(CountingProcessor(), rows, pandas_b, _ctx(1000 + b, COUNT_OUTPUT, api="pandas"), "user")
        _same(outs[-1], twin.assign(batch_id=b), COUNT_COLS, f"batch {b}: row runner vs pandas runner")
    _same(pd.concat(outs), reference_counts(batches), COUNT_COLS, "row runner vs pandas reference")


def test_row_runner_ttl_timers_and_initial_state(storage):
    from dstl.spark.processor import run_processor
    from dstl.state.schema import parse_ddl

    batches = make_batches(3, 400, 60)
    # TTL: `previous` (1 ms) has expired by the next batch, `total` (1 h) has not
    ttl_b, outs = _backend(storage, "ttl"), []
    for b, batch in enumerate(batches):
        out = run_processor(RowTtlProcessor(), _with_ts(batch), ttl_b,
                            _ctx(1_000_000 + 10 * b, TTL_OUTPUT, time_mode="ProcessingTime"), "user")
        outs.append(out.to_pandas().assign(batch_id=b))
    _same(pd.concat(outs), reference_ttl(batches), TTL_COLS, "Row TTL vs pandas reference")

    # event-time timers: the watermark of batch b is the max event time before it minus the delay
    batches = make_batches(3, 800, 500)
    delay, sess_b, outs, wm, fired = 10_000, _backend(storage, "sessions"), [], 0, 0
    for b, batch in enumerate(batches):
        ctx = _ctx(5_000 + b, SESSION_OUTPUT, time_mode="EventTime", watermark=wm)
        out = run_processor(RowSessionProcessor(), _with_ts(batch), sess_b, ctx, "user")
        if out is not None:
            outs.append(out.to_pandas().assign(batch_id=b))
        fired += ctx.metrics["timers_fired"]
        wm = max(wm, int(batch["ts_ms"].max()) - delay)
    expected = reference_sessions(batches, delay, SESSION_GAP_MS)
    assert fired == len(expected) > 0
    _same(pd.concat(outs), expected, SESSION_COLS, "Row sessions vs pandas reference")

    # initial state: one handleInitialState call per Row (two seed rows for ann add up), first batch only
    seed = pd.DataFrame({"user": ["ann", "ann", "bob"], "seed": [2, 3, 7]})
    seeded = _backend(storage, "seeded")
    ctx = _ctx(1, INITIAL_OUTPUT, initial=seed, initial_schema=parse_ddl("user string, seed long"))
    events = pd.DataFrame({"user": ["ann", "cy"], "kind": ["v", "v"], "value": [1, 1], "ts_ms": [0, 0]})
    out = run_processor(RowSeededCounter(), events, seeded, ctx, "user").to_pandas()
    assert sorted(map(tuple, out.to_numpy().tolist())) == [("ann", 6, 5), ("cy", 1, 0)]
    assert seeded.value_state("count").get("bob") == [7, 7]


class _Echo(StatefulProcessor):
    """Yields what `emit(key, rows)` returns; records the input Rows it saw."""

    def __init__(self, emit):
        self.emit, self.seen = emit, []

    def init(self, handle):
        pass

    def handleInputRows(self, key, rows, timerValues):
        rows = list(rows)
        self.seen.extend(rows)
        return self.emit(key, rows)

    def close(self):
        pass


def test_row_values_as_spark_row_mode_hands_them_out(storage):
    """Nulls (also in integer and float columns), aware timestamps in the session time zone, dates,
    arrays; output Rows matched by name: any order, a missing field null, an extra one ignored."""
    from dstl.spark.processor import run_processor

    rows = pd.DataFrame({
        "user": ["a", "a", "b"],
        "n": [1.0, np.nan, 3.0],                       # an integer column with a null arrives as float
        "x": [0.5, np.nan, 2.0],
        "ts": pd.to_datetime(["2026-01-01 01:00:00", None, "2026-06-01 12:00:00"]),
        "d": [dt.date(2026, 1, 2), None, dt.date(2026, 1, 3)],
        "tags": [np.array(["p", "q"], dtype=object), None, np.array([], dtype=object)],
    })
    schema = "user string, n long, x double, ts timestamp, d date, tags array<string>"
    proc = _Echo(lambda key, rs: [Row(total=sum(r.n or 0 for r in rs), user=key[0], junk=1)])
    out = run_processor(proc, rows, _backend(storage),
                        _ctx(1, "user string, total long, missing string", input_schema=schema,
                             tz="Europe/Berlin"), "user")
    assert out.to_pylist() == [{"user": "a", "total": 1, "missing": None},
                               {"user": "b", "total": 3, "missing": None}]
    a1, a2, b = proc.seen
    assert type(a1).__mro__[1] is Row and a1.__fields__ == ["user", "n", "x", "ts", "d", "tags"]
    assert a1.asDict()["user"] == "a" and a1["n"] == 1 and isinstance(a1.n, int)
    assert (a2.n, a2.x, a2.ts, a2.d, a2.tags) == (None, None, None, None, None)
    berlin = a1.ts.tzinfo
    assert str(berlin) == "Europe/Berlin" and a1.ts == dt.datetime(2026, 1, 1, 1, tzinfo=berlin)
    assert a1.ts.utcoffset() == dt.timedelta(hours=1) and b.ts.utcoffset() == dt.timedelta(hours=2)
    assert (a1.d, a1.tags, b.tags) == (dt.date(2026, 1, 2), ["p", "q"], [])


def test_row_api_mistakes_get_clear_errors(storage):
    from dstl.spark.processor import run_processor

    rows = pd.DataFrame({"user": ["a", "b"], "n": [1, 2]})

    def run(emit, api="row", output="user string, n long"):
        return run_processor(_Echo(emit), rows, _backend(storage, f"e{run.i}"),
                             _ctx(1, output, api=api, input_schema="user string, n long"), "user")
    run.i = 0

    with pytest.raises(TypeError, match=r"yielded a pandas DataFrame.*needs api='pandas'"):
        run(lambda k, rs: [pd.DataFrame({"user": [k[0]], "n": [1]})])
    with pytest.raises(TypeError, match=r"must yield pandas DataFrames, got Row.*needs api='row'"):
        run(lambda k, rs: [Row(user=k[0], n=1)], api="pandas")
    with pytest.raises(TypeError, match=r"must yield pyspark.sql.Row objects.*got tuple"):
        run(lambda k, rs: [(k[0], 1)])
    with pytest.raises(TypeError, match=r"needs field names"):
        run(lambda k, rs: [Row(k[0], 1)])
    with pytest.raises(TypeError, match=r"output field 'n' \(int64\): cannot take the value 'many'"):
        run(lambda k, rs: [Row(user=k[0], n="many")])
    # a processor passing its input Rows through: fields by name, the schema's subset kept
    out = run(lambda k, rs: rs, output="n long")
    assert out.to_pylist() == [{"n": 1}, {"n": 2}]


def test_api_argument_and_output_ddl_without_a_session(tmp_path):
    from dstl.spark import StatefulStream

    base = str(tmp_path / "job")
    assert StatefulStream(base, CountingProcessor(), COUNT_OUTPUT, key="user", parallelism=1).api == "pandas"
    assert StatefulStream(base, RowCountingProcessor(), COUNT_OUTPUT, key="user", parallelism=1,
                          api="ROW").api == "row"
    with pytest.raises(ValueError, match=r"api must be 'row' .* or 'pandas'.*got 'rows'"):
        StatefulStream(base, RowCountingProcessor(), COUNT_OUTPUT, key="user", parallelism=1, api="rows")
    with pytest.raises(ValueError, match=r"api='row' is for a StatefulProcessor"):
        StatefulStream(base, lambda rows, state: rows, COUNT_OUTPUT, key="user", parallelism=1, api="row")

    # a fresh interpreter: no SparkSession, no SparkContext, no JVM
    code = textwrap.dedent(f"""
        import sys
        sys.path.insert(0, {os.path.dirname(os.path.abspath(__file__))!r})
        from pyspark import SparkContext
        from dstl.spark import StatefulStream
        from processors import RowCountingProcessor
        s = StatefulStream({base!r}, RowCountingProcessor(), "user string, n long", key="user",
                           parallelism=2, api="row")
        print(s._output_struct.simpleString())
        late = StatefulStream({base!r}, RowCountingProcessor(), "user string NOT NULL, n long COMMENT 'x'",
                              key="user", parallelism=2, api="row")
        print(late._output_struct, SparkContext._active_spark_context)
    """)
    env = dict(os.environ, PYTHONPATH=os.pathsep.join([os.getcwd(), os.environ.get("PYTHONPATH", "")]))
    res = subprocess.run([sys.executable, "-c", code], capture_output=True, text=True, timeout=120, env=env)
    assert res.returncode == 0, res.stderr[-2000:]
    assert res.stdout.split("\n")[:2] == ["struct<user:string,n:bigint>", "None None"]


# --- on Spark -------------------------------------------------------------------------------------

@pytest.mark.spark
@heavy  # the runner tests above cover the Row API under both builds
def test_stream_run_with_row_api_ttl_and_initial_state(spark, tmp_path, monkeypatch):
    """`run(df)` per batch: TTL as the pandas reference says; initial state Rows on the first batch;
    a DDL only Spark parses (NOT NULL), given while no session was active: resolved at the first batch."""
    from pyspark.sql import SparkSession
    from pyspark.sql import functions as F

    from dstl.spark import StatefulStream
    from streaming_util import read_output

    with pytest.raises(ValueError, match=r"output_schema 'user strin' is not a valid DDL"):
        StatefulStream(str(tmp_path / "bad"), RowTtlProcessor(), "user strin", key="user", parallelism=1)
    batches = make_batches(2, 300, 40)
    ticks = iter(range(1_000_000, 2_000_000, 10))
    ttl = StatefulStream(str(tmp_path / "ttl"), RowTtlProcessor(), TTL_OUTPUT, key="user", parallelism=2,
                         time_mode="ProcessingTime", api="row", clock=lambda: next(ticks))
    seed = spark.createDataFrame([("u1", 5), ("u1", 1), ("zed", 9)], "user string, seed long")
    with monkeypatch.context() as m:  # as if constructed before any SparkSession existed
        m.setattr(SparkSession, "getActiveSession", classmethod(lambda cls: None))
        seeded = StatefulStream(str(tmp_path / "seeded"), RowSeededCounter(), "user string NOT NULL, "
                                "events long, seeded long COMMENT 'from the initial state'", key="user",
                                parallelism=3, api="row", initial_state=seed)
    assert seeded._output_struct is None
    for batch in batches:
        df = spark.createDataFrame(batch, EVENTS_SCHEMA).withColumn("ts", F.timestamp_millis("ts_ms"))
        assert ttl.run(df).rows_out == batch["user"].nunique()
        seeded.run(df)
    _same(read_output(str(tmp_path / "ttl" / "output")), reference_ttl(batches), TTL_COLS,
          "StatefulStream(RowTtlProcessor, api='row')")
    got = read_output(str(tmp_path / "seeded" / "output"))
    u1 = got[got["user"] == "u1"].sort_values("batch_id")
    n1 = [int((b["user"] == "u1").sum()) for b in batches]
    assert u1[["events", "seeded"]].to_numpy().tolist() == [[6 + n1[0], 6], [6 + n1[0] + n1[1], 6]]
    assert "zed" not in set(got["user"])  # state only: no input, no output
    assert seeded._output_struct.fields[0].nullable is False


@pytest.fixture(scope="module")
def stream_input(tmp_path_factory):
    batches = make_batches(3, 800, 500)
    directory = str(tmp_path_factory.mktemp("row-events"))
    write_json_stream(directory, batches)
    return directory, batches


@heavy
@pytest.mark.spark
@pytest.mark.slow
def test_same_row_processor_object_on_native_transform_with_state_and_on_stream(spark, stream_input, tmp_path):
    """ONE RowCountingProcessor object: Spark's native transformWithState and StatefulStream(api="row")
    over the same file stream commit the same rows, and both equal the pandas reference."""
    source, batches = stream_input
    processor = RowCountingProcessor()
    native = run_native(spark, source, processor, COUNT_OUTPUT, str(tmp_path / "native"), api="row")
    assert native.progress[-1]["stateOperators"][0]["operatorName"] == "transformWithStateInPySparkExec"
    ours = run_dstl(spark, source, processor, COUNT_OUTPUT, str(tmp_path / "job"), str(tmp_path / "ckpt"),
                    parallelism=3, api="row")
    _same(native.output, reference_counts(batches), COUNT_COLS, "native transformWithState vs pandas")
    _same(ours, native.output, COUNT_COLS, "StatefulStream(api='row') vs native transformWithState")


@heavy
@pytest.mark.spark
@pytest.mark.slow
def test_row_sessions_timers_and_timestamps_match_native(spark, stream_input, tmp_path):
    """Event-time timers and the `ts` timestamps of Row mode: the same RowSessionProcessor object on
    both engines (it fails if a Row's ts differs from its ts_ms)."""
    source, batches = stream_input
    processor = RowSessionProcessor()
    native = run_native(spark, source, processor, SESSION_OUTPUT, str(tmp_path / "native"), api="row",
                        time_mode="EventTime", output_mode="Append", watermark_delay="10 seconds")
    ours = run_dstl(spark, source, processor, SESSION_OUTPUT, str(tmp_path / "job"), str(tmp_path / "ckpt"),
                    parallelism=2, api="row", time_mode="EventTime", event_time_column="ts",
                    watermark_delay="10 seconds")
    expected = reference_sessions(batches, 10_000, SESSION_GAP_MS)
    assert len(expected)
    _same(native.output, expected, SESSION_COLS, "native Row sessions vs pandas")
    _same(ours, native.output, SESSION_COLS, "StatefulStream(RowSessionProcessor) vs native")


@heavy
@pytest.mark.spark
@pytest.mark.slow
def test_row_initial_state_matches_native(spark, stream_input, tmp_path):
    """handleInitialState with Rows: the same RowSeededCounter object and seed DataFrame on both."""
    source, batches = stream_input
    users = sorted(set(batches[0]["user"]))[:50] + ["nobody"]
    seed = spark.createDataFrame([(u, i % 4) for i, u in enumerate(users)] + [(users[0], 10)],
                                 "user string, seed long")
    processor = RowSeededCounter()
    native = run_native(spark, source, processor, INITIAL_OUTPUT, str(tmp_path / "native"), api="row",
                        initial_state=seed)
    ours = run_dstl(spark, source, processor, INITIAL_OUTPUT, str(tmp_path / "job"), str(tmp_path / "ckpt"),
                    parallelism=2, api="row", initial_state=seed)
    cols = ["user", "events", "seeded", "batch_id"]
    assert native.output["seeded"].sum() > 0
    _same(ours, native.output, cols, "StatefulStream(RowSeededCounter, initial_state) vs native")
