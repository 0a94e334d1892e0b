"""The cases tests/test_conformance.py runs natively and on dstl (a sample also under Spark
Connect, tests/connect_driver.py): a processor of tests/conform_processors.py, its input stream
batch by batch, and how the native query is set up."""
from __future__ import annotations

import datetime as dt

from conform_processors import (CompositeValues, DroppedStates, EventTimeCount, EventTimeMax,
                                FirstTimestamp, InitialStateTimers, ProcTimeTimers, TtlStates, TwoKeyTotals)
from conformance_util import Case


def _t(seconds: int) -> str:
    return (dt.datetime(1970, 1, 1) + dt.timedelta(seconds=seconds)).isoformat()


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
    Case("timestamp_output", FirstTimestamp, FirstTimestamp.OUTPUT, "id string, eventTime timestamp",
         [[{"id": "a", "eventTime": _t(20)}, {"id": "b", "eventTime": _t(30)}],
          [{"id": "a", "eventTime": _t(44)}]]),
    # the same in a session time zone that is not the machine's (UTC): input timestamps and the naive
    # datetimes a processor writes are local times of spark.sql.session.timeZone
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
]
