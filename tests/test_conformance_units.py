"""Spark's rules that dstl follows, checked without a Spark query (both implementations): the two
event-time watermarks and the multiple-watermark policy, the late-row filter, deleted states that
raise on use, a state defined twice, nested struct values as Rows. The same behaviours against
Spark's own operator: tests/test_conformance.py (heavy).
"""
from __future__ import annotations

import datetime as dt
import decimal

import pandas as pd
import pytest
from pyspark.errors import PySparkRuntimeError
from pyspark.sql import Row
from pyspark.sql.streaming import StatefulProcessor

from state_helpers import FULL, MAXP, storage  # noqa: F401 - fixture


def _backend(storage):
    from dstl.state.backend import KeyedStateBackend

    return KeyedStateBackend(storage, "op", FULL, MAXP)


# --- watermarks -------------------------------------------------------------------------------------

def test_two_watermarks_follow_spark_batch_by_batch():
    from dstl.spark.watermark import Watermarks

    b0 = Watermarks.from_properties(None, ["t"], "min")
    assert (b0.eviction_ms, b0.late_ms) == (0, 0)
    b1 = b0.advance({"t": 30_000}, {"t": 10_000})
    # batch 1 evicts with the watermark batch 0 produced, and drops late rows with batch 0's own (0)
    assert (b1.eviction_ms, b1.late_ms) == (20_000, 0)
    b2 = b1.advance({"t": 25_000}, {"t": 10_000})       # a lower maximum never moves a watermark back
    assert (b2.eviction_ms, b2.late_ms) == (20_000, 20_000)
    b3 = b2.advance({"t": None}, {"t": 10_000})         # a batch without rows keeps it
    assert (b3.eviction_ms, b3.late_ms, b3.columns) == (20_000, 20_000, {"t": 20_000})
    # the checkpoint of batch 2 (whose successor is b3) carries both, and b3 comes back from it
    props = b3.properties(b2)
    assert (props["watermark_ms"], props["batch_watermark_ms"]) == (20_000, 20_000)
    again = Watermarks.from_properties(props, ["t"], "max")
    assert (again.eviction_ms, again.late_ms, again.columns, again.policy) == (20_000, 20_000, {"t": 20_000}, "min")


@pytest.mark.parametrize("policy, expected", [("min", 5_000), ("max", 40_000)])
def test_multiple_watermark_policy(policy, expected):
    from dstl.spark.watermark import Watermarks

    w = Watermarks.from_properties(None, ["a", "b"], policy)
    nxt = w.advance({"a": 50_000, "b": 10_000}, {"a": 10_000, "b": 5_000})
    assert nxt.columns == {"a": 40_000, "b": 5_000} and nxt.eviction_ms == expected
    # a column that has never seen a row counts as 0 under min
    lone = Watermarks.from_properties(None, ["a", "b"], policy).advance({"a": 50_000}, {"a": 0, "b": 0})
    assert lone.eviction_ms == (0 if policy == "min" else 50_000)


def test_policy_and_event_time_column_arguments_are_checked(tmp_path):
    from dstl.spark import StatefulStream
    from dstl.spark.watermark import normalize_policy

    assert normalize_policy(" MAX ") == "max"
    with pytest.raises(ValueError, match="multiple watermark policy must be 'min' or 'max'"):
        normalize_policy("avg")
    proc = _Counter()
    with pytest.raises(ValueError, match="2 delays for 1 event-time columns"):
        StatefulStream(str(tmp_path), proc, "id string, n long", key="id", parallelism=1, time_mode="EventTime",
                       event_time_column="t", watermark_delay=["1 second", "2 seconds"])
    with pytest.raises(ValueError, match="list of distinct names"):
        StatefulStream(str(tmp_path), proc, "id string, n long", key="id", parallelism=1, time_mode="EventTime",
                       event_time_column=["t", "t"])
    s = StatefulStream(str(tmp_path), proc, "id string, n long", key="id", parallelism=1, time_mode="EventTime",
                       event_time_column=["t", "u"], watermark_delay=["1 second", "2 seconds"],
                       watermark_policy="Max")
    assert s.watermark_delays_ms == {"t": 1000, "u": 2000} and s.watermark_policy == "max"


class _Counter(StatefulProcessor):
    def init(self, handle):
        self.n = handle.getValueState("n", "n long")

    def handleInputRows(self, key, rows, timerValues):
        n = (self.n.get()[0] if self.n.exists() else 0) + sum(len(p) for p in rows)
        self.n.update((n,))
        yield pd.DataFrame({"id": [key[0]], "n": [n]})

    def close(self):
        pass


def test_late_rows_are_those_at_or_before_the_late_events_watermark(storage):
    from dstl.spark import task as K
    from dstl.spark.processor import BatchContext, make_task_fn

    ctx = BatchContext(1_000, 50_000, "EventTime", late_watermark_ms=20_000)
    fn = make_task_fn(_Counter(), "id", ctx, event_cols=["e0", "e1"])
    rows = pd.DataFrame({"id": ["a", "a", "b", "b"], "e0": [19_000, 20_000, 20_001, None],
                         "e1": [70_000, 1, 2, 3]})
    K._TASK["metrics"] = {}
    out = fn(rows, _backend(storage))
    m = K._TASK["metrics"]
    # 20 000 is at the watermark: late; a null event time never is; maxima count the late rows too
    assert m["late_rows"] == 2 and m["max_event_ms"] == {"0": 20_001, "1": 70_000}
    assert sorted(zip(out["id"], out["n"])) == [("b", 2)]


# --- state lifecycle --------------------------------------------------------------------------------

class _Deleting(StatefulProcessor):
    def __init__(self, twice=False):
        self.twice = twice

    def init(self, handle):
        self.v = handle.getValueState("v", "x long")
        self.l = handle.getListState("l", "x long")
        self.m = handle.getMapState("m", "k string", "x long")
        self.keep = handle.getValueState("keep", "x long")
        for name in ("v", "l", "m"):
            handle.deleteIfExists(name)
        handle.deleteIfExists("never-declared")  # nothing to delete: no error, as in Spark
        if self.twice:
            handle.getValueState("v", "x long")

    def handleInputRows(self, key, rows, timerValues):
        calls = {"v.exists": self.v.exists, "v.get": self.v.get, "v.update": lambda: self.v.update((1,)),
                 "v.clear": self.v.clear, "l.exists": self.l.exists, "l.get": self.l.get,
                 "l.appendValue": lambda: self.l.appendValue((1,)), "l.put": lambda: self.l.put([(1,)]),
                 "m.exists": self.m.exists, "m.getValue": lambda: self.m.getValue(("k",)),
                 "m.updateValue": lambda: self.m.updateValue(("k",), (1,)), "m.keys": self.m.keys}
        raised = {}
        for name, call in calls.items():
            with pytest.raises(PySparkRuntimeError) as info:
                call()
            raised[name] = str(info.value)
        self.keep.update((len(raised),))
        yield pd.DataFrame({"id": [key[0]], "msg": [raised["v.exists"]], "n": [len(raised)]})

    def close(self):
        pass


def test_a_deleted_state_raises_on_every_call_as_spark_does(storage):
    from dstl.spark.task import arrow_output_schema as _arrow_output_schema
    from dstl.spark.processor import BatchContext, run_processor
    from dstl.state.schema import parse_ddl

    backend = _backend(storage)
    ctx = BatchContext(1_000, 0, output_arrow_schema=_arrow_output_schema(parse_ddl("id string, msg string, n long")))
    out = run_processor(_Deleting(), pd.DataFrame({"id": ["a", "b"]}), backend, ctx, "id")
    assert out["n"].tolist() == [12, 12]
    assert out["msg"][0].startswith("Error checking value state exists: "
                                    "[STATE_STORE_UNSUPPORTED_OPERATION_ON_MISSING_COLUMN_FAMILY]")
    assert "column family=v" in out["msg"][0]
    with pytest.raises(PySparkRuntimeError, match="STATEFUL_PROCESSOR_DUPLICATE_STATE_VARIABLE_DEFINED.*name v "):
        run_processor(_Deleting(twice=True), pd.DataFrame({"id": ["a"]}), backend, ctx, "id")


def test_deleted_values_are_gone_for_every_key(storage):
    from dstl.spark.processor import ProcessorHandle

    backend = _backend(storage)
    h = ProcessorHandle(backend)
    v = h.getValueState("v", "x long")
    for k in ("a", "b", "c"):
        h._key = k
        v.update((1,))
    h.deleteIfExists("v")
    h2 = ProcessorHandle(backend)  # the next batch's init defines it again: empty
    v2 = h2.getValueState("v", "x long")
    for k in ("a", "b", "c"):
        h2._key = k
        assert not v2.exists()


# --- values as Spark returns them ---------------------------------------------------------------------

def test_nested_structs_come_back_as_rows_with_every_type(storage):
    from dstl.spark.processor import ProcessorHandle

    ddl = ("p struct<name:string, tags:array<struct<k:string,v:string>>, attrs:map<string,array<int>>, "
           "at:timestamp, ntz:timestamp_ntz, day:date, amount:decimal(10,2), raw:binary, inner:struct<x:int>>")
    h = ProcessorHandle(_backend(storage))
    h._key = "a"
    v = h.getValueState("v", ddl)
    lst = h.getListState("l", ddl)
    m = h.getMapState("m", "k string", ddl)
    value = {"name": "n", "tags": [{"k": "env", "v": "prod"}, Row(k="r", v=None)], "attrs": {"a": [1, None]},
             "at": dt.datetime(2026, 1, 2, 3, 4, 5, 6), "ntz": dt.datetime(2026, 1, 2), "day": dt.date(2026, 1, 2),
             "amount": decimal.Decimal("12.34"), "raw": b"\x00\x01", "inner": None}
    v.update((value,))
    lst.appendValue((Row(**value),))
    m.updateValue(("k",), (value,))
    (got,) = v.get()
    assert isinstance(got, Row) and got.tags == [Row(k="env", v="prod"), Row(k="r", v=None)]
    assert got.tags[0].asDict() == {"k": "env", "v": "prod"}
    assert got.asDict() == {**value, "tags": got.tags}
    assert [x[0] for x in lst.get()] == [got] and m.getValue(("k",)) == (got,)


# --- several key columns ------------------------------------------------------------------------------

@pytest.mark.parametrize("api", ["pandas", "row"])
def test_two_key_columns_reach_the_processor_as_spark_passes_them(storage, api):
    from conform_processors import TwoKeyTotals
    from dstl.spark.task import arrow_output_schema as _arrow_output_schema
    from dstl.spark.keys import KEY_COL, pack_columns
    from dstl.spark.processor import BatchContext, run_processor
    from dstl.state.schema import parse_ddl

    rows = pd.DataFrame({"id1": ["a", "a", "b", "a"], "id2": [1, 2, 1, 1], "temperature": [10, 20, 30, 5]})
    rows[KEY_COL] = pack_columns([rows["id1"], rows["id2"]])
    init = pd.DataFrame({"id1": ["a"], "id2": [1], "initVal": [100]})
    init[KEY_COL] = pack_columns([init["id1"], init["id2"]])
    ctx = BatchContext(1_000, 0, api=api, key_columns=["id1", "id2"], initial_state=init,
                       input_schema=parse_ddl("id1 string, id2 bigint, temperature int"),
                       initial_schema=parse_ddl("id1 string, id2 bigint, initVal int"), time_zone="UTC",
                       output_arrow_schema=_arrow_output_schema(parse_ddl(TwoKeyTotals.OUTPUT)))
    out = run_processor(TwoKeyTotals(api == "pandas"), rows, _backend(storage), ctx, KEY_COL)
    if api == "row":
        out = out.to_pandas()
    assert sorted(zip(out["id1"], out["id2"], out["value"])) == [("a", 1, "115"), ("a", 2, "20"), ("b", 1, "30")]


def test_composite_keys_pack_deterministically_and_spread_over_key_groups():
    from dstl.keygroups import assign_key_groups
    from dstl.spark.keys import normalize_keys, pack_columns, pack_key, unpack_key

    assert normalize_keys("a") == ["a"] and normalize_keys(("a", "b")) == ["a", "b"]
    with pytest.raises(ValueError, match="list of distinct names"):
        normalize_keys(["a", "a"])
    # msgpack of the list of values: the documented rule (docs/rescaling.md §7)
    assert pack_key(["a", 1]) == b"\x92\xa1a\x01" and unpack_key(b"\x92\xa1a\x01") == ("a", 1)
    # an integer column with nulls arrives as floats: packed as the integers, a null gives no key
    assert pack_columns([pd.Series(["a", "b"]), pd.Series([1.0, None])]) == [b"\x92\xa1a\x01", None]
    # an integer column widened by its nulls packs as the integers of one without nulls (initial state)
    assert pack_columns([pd.Series(["a"]), pd.Series([7.0])]) == pack_columns([pd.Series(["a"]), pd.Series([7])])
    keys = pack_columns([pd.Series([f"u{i % 50}" for i in range(1000)]), pd.Series(list(range(1000)))])
    groups = assign_key_groups(pd.Series(keys, dtype=object), 128)
    assert (assign_key_groups(pd.Series(keys, dtype=object), 128) == groups).all()
    assert len(set(groups.tolist())) > 100


# --- pandas flavour: session time zone and DataFrames per key ---------------------------------------

def test_naive_output_timestamps_are_session_local_as_spark_takes_them():
    from pyspark.sql.types import StringType, StructField, StructType, TimestampNTZType, TimestampType

    from dstl.spark.task import arrow_output_schema as _arrow_output_schema
    from dstl.spark.processor import BatchContext, session_timestamps

    schema = StructType([StructField("id", StringType()), StructField("t", TimestampType()),
                         StructField("z", TimestampType()), StructField("n", TimestampNTZType())])
    ctx = BatchContext(0, 0, output_arrow_schema=_arrow_output_schema(schema), time_zone="America/Los_Angeles")
    pdf = pd.DataFrame({"id": ["a"], "t": [pd.Timestamp("2026-03-29 01:30")],
                        "z": [pd.Timestamp("2026-03-29 01:30", tz="Europe/Oslo")],
                        "n": [pd.Timestamp("2026-03-29 01:30")]})
    out = session_timestamps(pdf, ctx)
    assert out["t"][0] == pd.Timestamp("2026-03-29 08:30", tz="UTC")   # PDT is UTC-7
    assert out["z"][0] == pd.Timestamp("2026-03-29 00:30", tz="UTC")   # an aware value keeps its instant (CET)
    assert out["n"][0] == pd.Timestamp("2026-03-29 01:30")              # TimestampNTZ: as written
    # without a session time zone (a context built by hand) nothing changes
    plain = pd.DataFrame({"t": [pd.Timestamp("2026-03-29 01:30")]})
    assert session_timestamps(plain, BatchContext(0, 0))["t"][0] == pd.Timestamp("2026-03-29 01:30")


@pytest.mark.parametrize("cap,sizes", [(2, [2, 2, 1]), (5, [5]), (10_000, [5]), (0, [5]), (-1, [5])])
def test_a_keys_rows_come_in_dataframes_of_max_records_per_batch(storage, cap, sizes):
    from dstl.spark.processor import BatchContext, make_task_fn

    class Chunks(StatefulProcessor):
        def init(self, handle):
            pass

        def handleInputRows(self, key, rows, timerValues):
            frames = list(rows)
            assert all(list(f.index) == list(range(len(f))) for f in frames)
            yield pd.DataFrame({"id": [key[0]], "sizes": [",".join(str(len(f)) for f in frames)],
                                "v": [",".join(str(v) for f in frames for v in f["v"])]})

        def close(self):
            pass

    ctx = BatchContext(1_000, 0, max_records_per_batch=cap)
    out = make_task_fn(Chunks(), "id", ctx)(pd.DataFrame({"id": ["a"] * 5 + ["b"], "v": range(6)}),
                                            _backend(storage))
    got = dict(zip(out["id"], zip(out["sizes"], out["v"])))
    assert got == {"a": (",".join(map(str, sizes)), "0,1,2,3,4"), "b": ("1", "5")}
