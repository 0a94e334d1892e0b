"""Several key columns in the state readers: `read_changes` and `read_timers` (Spark and pandas)
and `read_state_pandas` show a composite key as its values, a JSON list such as `["a", 1]`, as
`read_state` and `dstl state show` do (tests/test_stream_keys.py), and take it back as `key=`."""
from __future__ import annotations

import pandas as pd
import pytest

from conform_processors import TwoKeyTimers
from conftest import heavy

pytestmark = [pytest.mark.spark, heavy]


def test_readers_show_composite_keys(spark, tmp_path):
    from dstl.spark import StatefulStream, read_changes, read_timers
    from dstl.state import read_changes_pandas, read_state_pandas, read_timers_pandas

    base = str(tmp_path / "job")
    ticks = iter([1_000_000, 2_000_000])
    s = StatefulStream(base, TwoKeyTimers(False), TwoKeyTimers.OUTPUT, key=["id1", "id2"], parallelism=2,
                       api="row", time_mode="ProcessingTime", clock=lambda: next(ticks))
    for rows in ([("a", 1, 10), ("a", 2, 20), ("a", 1, 5)], [("a", 1, 1), ("b", 7, 2)]):
        s.run(spark.createDataFrame(pd.DataFrame(rows, columns=["id1", "id2", "t"]), "id1 string, id2 bigint, t int"))
    s.close()

    # batch 1 (at 2_000_000) fired the timers batch 0 set: one per key is left
    want_timers = [('["a", 1]', 2_060_000), ('["b", 7]', 2_060_000)]
    timers = read_timers(spark, base).toPandas()
    assert sorted(zip(timers["key"], timers["timestamp_ms"])) == want_timers
    local = read_timers_pandas(base)
    assert sorted(zip(local["key"], local["timestamp_ms"])) == want_timers
    assert read_timers_pandas(base, key=("a", 1))["timestamp_ms"].tolist() == [2_060_000]
    assert read_timers_pandas(base, key=("a", 2)).empty
    assert read_timers_pandas(base, key='["b", 7]')["key"].tolist() == ['["b", 7]']

    want_counts = [('["a", 1]', '[3]'), ('["b", 7]', '[1]')]  # what batch 1 (checkpoint 2) changed
    changes = read_changes(spark, base, 1, 2).toPandas()
    counts = changes[changes["state"] == "count"]
    assert sorted(zip(counts["key"], counts["value"])) == want_counts
    local = read_changes_pandas(base, 1, 2, state_name="count")
    assert sorted(zip(local["key"], local["value"])) == want_counts
    assert read_changes_pandas(base, 1, 2, key=["a", 1], state_name="count")["value"].tolist() == ["[3]"]

    state = read_state_pandas(base, "count")
    assert sorted(zip(state["key"], state["n"])) == [('["a", 1]', 3), ('["a", 2]', 1), ('["b", 7]', 1)]
