"""The cases tests/test_conformance.py runs natively and on dstl (a sample also under Spark
Connect, tests/connect_driver.py): a processor of tests/conform_processors.py, its input stream
batch by batch, and how the native query is set up."""
from __future__ import annotations

import datetime as dt

from conform_processors import (CompositeValues, DroppedStates, EventTimeCount, EventTimeMax,
                                FirstTimestamp, InitialStateTimers, ProcTimeTimers, TtlStates, TwoKeyTotals)
from conform_more_processors import (EVOLUTION, PROC_TIME_OUTPUT, STATE_API_OUTPUT, EventTimeSession,
                                     MinEventTime, chunks, proc_time, state_api)
from conformance_util import Case


def _t(seconds: int) -> str:
    return (dt.datetime(1970, 1, 1) + dt.timedelta(seconds=seconds)).isoformat()


def _records(by_key):
    """{key: [partial record, ...]} -> one batch's records, each with its key as `id`."""
    return [{"id": k, **r} for k, recs in by_key.items() for r in recs]


MIN_EVENTS = [[{"id": "a", "eventTime": _t(20)}], [{"id": "a", "eventTime": _t(4)}],
              [{"id": "a", "eventTime": _t(s)} for s in (2, 11, 13, 15)]]

TEMPS = [[{"id": "0", "temperature": 123}, {"id": "0", "temperature": 23}, {"id": "1", "temperature": 146},
          {"id": "1", "temperature": 246}],
         [{"id": "0", "temperature": 101}, {"id": "0", "temperature": 123}, {"id": "1", "temperature": 46},
          {"id": "3", "temperature": 12}]]

CASES = [
    # batch 1's ("a", 4 s) is before batch 1's eviction watermark (20 s) but not its late-events
    # watermark (batch 0's, 0): Spark keeps it; batch 2's ("a", 15 s) is at or before 20 s: late
    Case("event_time_max", EventTimeMax, EventTimeMax.OUTPUT, "id string, eventTime timestamp",
         [[{"id": "a", "eventTime": _t(20)}, {"id": "a", "eventTime": _t(25)}, {"id": "b", "eventTime": _t(30)}],
          [{"id": "a", "eventTime": _t(4)}, {"id": "c", "eventTime": _t(40)}],
          [{"id": "a", "eventTime": _t(15)}, {"id": "d", "eventTime": _t(55)}, {"id": "a", "eventTime": _t(50)}]],
         time_mode="EventTime", event_time="eventTime", delay="10 seconds"),
    Case("event_time_count", EventTimeCount, EventTimeCount.OUTPUT, "id string, eventTime timestamp",
         [[{"id": "a", "eventTime": _t(10)}, {"id": "b", "eventTime": _t(30)}],
          [{"id": "a", "eventTime": _t(5)}, {"id": "a", "eventTime": _t(20)}, {"id": "b", "eventTime": _t(40)}],
          [{"id": "a", "eventTime": _t(20)}, {"id": "b", "eventTime": _t(31)}, {"id": "b", "eventTime": _t(45)}]],
         time_mode="EventTime", event_time="eventTime", delay="10 seconds"),
    Case("dropped_states", DroppedStates, DroppedStates.OUTPUT, "id string, temperature int", TEMPS),
    Case("dropped_states_ttl", lambda p: DroppedStates(p, ttl_ms=30_000), DroppedStates.OUTPUT,
         "id string, temperature int", TEMPS, time_mode="ProcessingTime"),
    Case("proc_time_timers", ProcTimeTimers, ProcTimeTimers.OUTPUT, "id string, temperature int",
         TEMPS + [[{"id": "0", "temperature": 1}]], time_mode="ProcessingTime"),
    Case("initial_state_timers", InitialStateTimers, InitialStateTimers.OUTPUT, "id string, temperature int",
         TEMPS, time_mode="ProcessingTime",
         initial=[{"id": "0", "initVal": 789}, {"id": "3", "initVal": 987}, {"id": "3", "initVal": 1}],
         initial_schema="id string, initVal int"),
    Case("ttl_states", TtlStates, TtlStates.OUTPUT, "id string, temperature int", TEMPS + TEMPS,
         time_mode="ProcessingTime"),
    # timestamp output columns (what Spark's chaining test reads), in a session time zone that is not
    # the machine's (UTC): input timestamps and the naive datetimes a pandas processor writes are local
    # times of spark.sql.session.timeZone (a Row processor's, of the Python process's zone, as in Spark)
    Case("timestamp_output_tz", FirstTimestamp, FirstTimestamp.OUTPUT, "id string, eventTime timestamp",
         [[{"id": "a", "eventTime": _t(20)}, {"id": "b", "eventTime": _t(30)}],
          [{"id": "a", "eventTime": _t(44)}]], conf={"spark.sql.session.timeZone": "America/Los_Angeles"}),
    Case("two_key_columns", TwoKeyTotals, TwoKeyTotals.OUTPUT, "id1 string, id2 bigint, temperature int",
         [[{"id1": "a", "id2": 1, "temperature": 10}, {"id1": "a", "id2": 2, "temperature": 20},
           {"id1": "b", "id2": 1, "temperature": 30}, {"id1": "a", "id2": 1, "temperature": 5}],
          [{"id1": "a", "id2": 1, "temperature": 1}, {"id1": "c", "id2": 7, "temperature": 2}]],
         keys=("id1", "id2"), initial=[{"id1": "a", "id2": 1, "initVal": 100}, {"id1": "z", "id2": 9, "initVal": 5}],
         initial_schema="id1 string, id2 bigint, initVal int"),
    Case("composite_values", CompositeValues, CompositeValues.OUTPUT, "id string, temperature int",
         TEMPS + TEMPS[:1]),
    # eleven of Spark's helper processors in one query (tests/conform_more_processors.py's Multiplex),
    # in Append mode; the rows name their part ("list/0")
    Case("state_api", state_api, STATE_API_OUTPUT, "id string, temperature int, word string, cmd string",
         [_records({"missing/0": [{}], "list/0": [{"temperature": 5}, {"temperature": 7}], "list/1": [{"temperature": 3}],
                    "longlist/0": [{}], "longlist/1": [{}], "map/0": [{}, {}], "map/1": [{}], "large/0": [{}],
                    "topk/0": [{"temperature": t} for t in (10, 30, 20)], "topk/1": [{"temperature": 5}],
                    "words/0": [{"word": w} for w in "aba"], "words/1": [{"word": "c"}],
                    "cmds/0": [{"cmd": c} for c in ("value-exists", "value-set", "value-get", "list-exists",
                                                   "list-append", "list-append-array", "list-get", "map-exists",
                                                   "map-add", "map-keys")],
                    "nested/0": [{"temperature": 100}, {"temperature": 23}], "nested/1": [{"temperature": 146}],
                    "out/0": [{}, {}], "out/1": [{}], "notnull/0": [{}, {}]}),
          _records({"missing/0": [{}], "list/0": [{"temperature": 9}], "list/1": [{"temperature": 1}, {"temperature": 2}],
                    "longlist/0": [{}], "longlist/1": [{}], "map/0": [{}, {}], "map/1": [{}], "large/0": [{}, {}],
                    "topk/0": [{"temperature": 25}], "topk/1": [{"temperature": 50}, {"temperature": 1}],
                    "words/0": [{"word": w} for w in "bc"], "words/1": [{"word": "c"}],
                    "cmds/0": [{"cmd": c} for c in ("map-values", "map-iterator", "map-remove", "map-keys", "map-clear",
                                                   "map-exists", "value-clear", "value-exists", "list-clear",
                                                   "list-exists")],
                    "nested/0": [{"temperature": 1}], "nested/1": [{"temperature": 2}], "out/0": [{}, {}, {}],
                    "notnull/0": [{}]}),
          _records({"longlist/0": [{}], "longlist/1": [{}], "map/0": [{}], "nested/0": [{"temperature": 3}],
                    "cmds/0": [{"cmd": "value-get"}, {"cmd": "list-get"}]})],
         output_mode="Append"),
    # TTL'd list and map state, processing-time sessions, a running count seeded by initial state; in
    # Complete mode, which Spark's operator accepts and treats as Update (each batch's emitted rows)
    Case("proc_time_group", proc_time, PROC_TIME_OUTPUT, "id string, temperature int",
         [_records({"listttl/0": [{"temperature": 5}], "mapttl/0": [{}, {}], "session/0": [{"temperature": 1}],
                    "session/1": [{"temperature": 2}], "running/0": [{}, {}], "running/1": [{}]}),
          _records({"listttl/0": [{"temperature": 6}], "mapttl/0": [{}], "session/1": [{"temperature": 3}],
                    "running/0": [{}], "running/9": [{}]}),
          _records({"listttl/1": [{"temperature": 2}], "session/0": [{"temperature": 4}], "mapttl/1": [{}]})],
         time_mode="ProcessingTime", initial=[{"id": "running/0", "initial_count": 10},
                                              {"id": "running/9", "initial_count": 3}],
         initial_schema="id string, initial_count int", output_mode="Complete"),
    # a watermark on the input outside EventTime mode: no row is late ("a" at 2 s in batch 2)
    Case("min_event_time_none", MinEventTime, MinEventTime.OUTPUT, "id string, eventTime timestamp",
         MIN_EVENTS, event_time="eventTime", delay="10 seconds"),
    Case("min_event_time_proc", MinEventTime, MinEventTime.OUTPUT, "id string, eventTime timestamp",
         MIN_EVENTS, time_mode="ProcessingTime", event_time="eventTime", delay="10 seconds"),
    Case("event_time_sessions", EventTimeSession, EventTimeSession.OUTPUT, "id string, eventTime timestamp",
         [[{"id": "a", "eventTime": _t(10)}, {"id": "b", "eventTime": _t(12)}],
          [{"id": "a", "eventTime": _t(14)}, {"id": "c", "eventTime": _t(30)}],
          [{"id": "b", "eventTime": _t(31)}], [{"id": "a", "eventTime": _t(50)}]],
         time_mode="EventTime", event_time="eventTime", delay="2 seconds"),
    # pandas only: with spark.sql.execution.arrow.maxRecordsPerBatch=1 a key's rows come one per DataFrame
    Case("pandas_chunks", chunks, PROC_TIME_OUTPUT, "id string, temperature int",
         [_records({"plain/0": [{}, {}], "plain/1": [{}], "init/0": [{}, {}, {}], "init/1": [{}]}),
          _records({"plain/0": [{}], "init/0": [{}, {}]})],
         initial=[{"id": "init/0", "initVal": 789}, {"id": "init/3", "initVal": 987}],
         initial_schema="id string, initVal int", flavours=("pandas",),
         conf={"spark.sql.execution.arrow.maxRecordsPerBatch": "1"}),
    # one state's schema over five runs: added, removed, reordered fields, int -> long (Spark needs
    # its Avro state encoding for that)
    Case("schema_evolution", None, "", "id string, temperature int",
         [[{"id": "0", "temperature": 1}, {"id": "1", "temperature": 2}]] * 5, stages=EVOLUTION,
         conf={"spark.sql.streaming.stateStore.encodingFormat": "avro"}),
]
