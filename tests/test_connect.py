"""dstl under Spark Connect (`SparkSession.builder.remote("local[2]")`): StatefulStream as
`foreachBatch` and through `.run(df)`, `read_state`, `read_changes`, `read_timers`, `bootstrap_state`.

tests/connect_driver.py runs every scenario once, in its own process (one local Connect server for
the module, stopped with it), with the in-process classic SparkContext hidden, so any use of
`sparkContext`, `_jvm` or an RDD fails there. This module checks what it left behind against pandas
references and the local readers. Heavy (a Connect server): Cython build only; the same dstl logic
runs under both implementations in the classic-session tests.
"""
from __future__ import annotations

import json
import os
import subprocess
import sys

import pandas as pd
import pytest

from conftest import heavy
from driver_util import bytecode_spark_home
from eventlog_util import batch_plan_nodes, batch_stages, successful
from streaming_util import make_batches, normalize, read_output, reference_counts

pytestmark = [pytest.mark.spark, pytest.mark.slow, heavy]

HERE = os.path.dirname(os.path.abspath(__file__))
COUNT_COLS = ["user", "events", "value_sum", "batches", "kinds", "top_kind_events", "batch_id"]


@pytest.fixture(scope="module")
def connect_run(tmp_path_factory):
    """Run tests/connect_driver.py once; its work directory and result.json."""
    work = str(tmp_path_factory.mktemp("connect"))
    root = os.path.dirname(HERE)
    env = dict(os.environ, PYSPARK_PYTHON=sys.executable, SPARK_LOCAL_IP="127.0.0.1",
               # an ephemeral port for the local Connect server: parallel runs cannot collide
               SPARK_TESTING="1",
               PYTHONPATH=os.pathsep.join(p for p in (root, os.environ.get("PYTHONPATH")) if p))
    env.pop("SPARK_REMOTE", None)
    # the Python processes the server starts per query import the installed pyspark, compiled: they
    # must connect back within Spark's fixed 10 s
    home = bytecode_spark_home(str(tmp_path_factory.mktemp("spark-home")))
    if home:
        env["SPARK_HOME"] = home
    proc = subprocess.Popen([sys.executable, os.path.join(HERE, "connect_driver.py"), work], env=env,
                            stdout=subprocess.PIPE, stderr=subprocess.STDOUT, text=True)
    try:
        out, _ = proc.communicate(timeout=900)
    except subprocess.TimeoutExpired:
        proc.kill()
        out, _ = proc.communicate()
        pytest.fail(f"the Connect driver did not finish in 15 min:\n{out[-3000:]}")
    path = os.path.join(work, "result.json")
    if proc.returncode != 0 or not os.path.exists(path):
        pytest.fail(f"the Connect driver failed ({proc.returncode}):\n{out[-5000:]}")
    with open(path) as f:
        result = json.load(f)
    return work, result


def _scenario(connect_run, name):
    work, result = connect_run
    assert result["session"] == "pyspark.sql.connect.session"
    got = result[name]
    if not got["ok"]:
        pytest.fail(f"{name} under Spark Connect: {got['error']}\n{got['trace']}")
    return work, got


def _same(actual, expected, columns, what):
    a, e = normalize(actual, columns), normalize(expected, columns)
    if not a.equals(e):
        merged = a.merge(e, how="outer", indicator=True)
        pytest.fail(f"{what}: {len(a)} vs {len(e)} rows, differing:\n{merged[merged['_merge'] != 'both'].head(10)}")


BATCHES = make_batches(3, 600, 200)  # what the driver feeds


def test_session_seam_classic_and_connect(connect_run, spark):
    """dstl.spark.session under both kinds of session: the classic one uses the context, the Connect
    one never touches it (the driver hid it) and answers from the configuration."""
    from dstl.spark import session as S

    assert not S.is_connect(spark)
    assert S.default_parallelism(spark) == spark.sparkContext.defaultParallelism
    assert S._worker_env(spark) is spark.sparkContext.environment
    assert S.executor_count(spark) == 1
    _, got = _scenario(connect_run, "seam")
    assert got["is_connect"] is True and got["worker_env"] is None
    assert got["default_parallelism"] == 2  # spark.sql.shuffle.partitions of the driver's session
    assert got["executor_count"] in (1, None)


def test_foreach_batch_with_the_row_api_under_connect(connect_run):
    work, got = _scenario(connect_run, "foreach_batch_row_api")
    _same(read_output(os.path.join(work, "fb", "output")), reference_counts(BATCHES), COUNT_COLS,
          "foreachBatch(StatefulStream(api='row')) under Connect")
    # the scale-out routing holds: every batch one stage of 2 subtasks, each later one continued
    # from its worker's memory or restored (which one depends on the idle Python worker a task
    # gets, as with a classic session), never lost
    placement = got["placement"]
    assert len(placement) == 3
    assert all(p and p["subtasks"] == 2 and p["warm"] + p["restored"] == 2 for p in placement[1:])
    # Spark's lastProgress with dstl's entry for its batch, read back from the checkpoint on the client
    (op,) = got["merged_operators"]
    assert op["operatorName"] == "dstlStatefulStream" and op["numShufflePartitions"] == 2
    assert op["customMetrics"]["dstlRowsIn"] == len(BATCHES[got["merged_batch"]]) and op["numRowsTotal"] > 0


def test_run_and_rescale_under_connect(connect_run):
    work, got = _scenario(connect_run, "run_pandas_api_and_rescale")
    assert got["batch_ids"] == [0, 1, 2]
    assert got["rescale_restored"] == 3 and got["subtasks"] == [0, 1, 2]
    assert got["routes"] == ["shuffle"] * 3  # a Spark DataFrame batch is shuffled, never broadcast
    _same(read_output(os.path.join(work, "run", "output")), reference_counts(BATCHES), COUNT_COLS,
          "StatefulStream.run under Connect, rescaled 2 -> 3")


def check_connect_records(events, scope, reports, parallelism):
    """What Spark ran for each batch of the `run` scenario, from the server's event log: one stage of
    P tasks, one per subtask, each PROCESS_LOCAL on the executor its report names, all the batch's
    rows in; a plan that shuffles the batch into a sort-merge join and broadcasts nothing."""
    stages, plans = batch_stages(events, scope), batch_plan_nodes(events, scope)
    assert sorted(stages) == sorted(plans) == sorted(parallelism), (sorted(stages), sorted(plans))
    for n, p in parallelism.items():
        nodes = plans[n]
        assert nodes and not [x for x in nodes if "Broadcast" in x], (n, sorted(set(nodes)))
        assert "SortMergeJoin" in nodes and any(x.startswith("Exchange") for x in nodes), (n, sorted(set(nodes)))
        runs = stages[n]
        ok = successful(runs)
        assert sorted(ok) == list(range(p)), (n, runs)  # every partition ran: nothing coalesced or split
        assert len([r for r in runs if r.success]) == p, (n, runs)
        assert all(r.locality == "PROCESS_LOCAL" for r in ok.values()), (n, runs)
        assert sorted(rep["subtask"] for rep in reports[n]) == list(range(p)), (n, reports[n])
        for rep in reports[n]:
            assert rep["executor"] == ok[rep["subtask"]].executor, (n, rep)
        assert sum(rep["rows_in"] for rep in reports[n]) == len(BATCHES[n])


def test_what_spark_ran_for_each_batch_under_connect(connect_run):
    """Spark's own records of the `run` scenario under Connect (P=2 twice, then 3): the batches are
    found by the job tag dstl sets under Connect, scoped by the scenario's own tag."""
    _, got = _scenario(connect_run, "run_pandas_api_and_rescale")
    reports = {int(b): reps for b, reps in got["reports"].items()}
    check_connect_records(got["events"], got["scope"], reports, {0: 2, 1: 2, 2: 3})


def test_read_state_and_changes_under_connect(connect_run):
    from dstl.state import read_changes_pandas, read_state_pandas

    work, got = _scenario(connect_run, "readers")
    base = os.path.join(work, "run")
    local = read_state_pandas(base, "totals")
    remote = pd.DataFrame(got["state"])
    assert len(remote) == len(local) == pd.concat(BATCHES)["user"].nunique()
    cols = ["key", "events", "value_sum"]
    pd.testing.assert_frame_equal(remote[cols].sort_values("key").reset_index(drop=True),
                                  local[cols].sort_values("key").reset_index(drop=True), check_dtype=False)
    assert got["changes"] == len(read_changes_pandas(base, 1, 3)) > 0
    assert "update" in got["change_ops"]


def test_read_timers_under_connect(connect_run):
    from dstl.state import read_timers_pandas

    work, got = _scenario(connect_run, "timers")
    local = read_timers_pandas(os.path.join(work, "sessions"))
    remote = pd.DataFrame(got["timers"])
    assert len(remote) == len(local) > 0
    assert sorted(zip(remote["key"], remote["timestamp_ms"])) == sorted(zip(local["key"], local["timestamp_ms"]))


def test_bootstrap_state_under_connect(connect_run):
    work, got = _scenario(connect_run, "bootstrap")
    assert (got["checkpoint"], got["batch_id"], got["next_checkpoint"]) == (1, 0, 2)
    out = read_output(os.path.join(work, "boot", "output")).set_index("user")
    b0 = BATCHES[0]
    assert len(got["seeds"]) == 2
    for user, (events, value_sum) in got["seeds"].items():
        mine = b0[b0["user"] == user]
        assert len(mine) and (out.loc[user, "events"], out.loc[user, "value_sum"]) == (
            events + len(mine), value_sum + int(mine["value"].sum()))


def test_same_rows_as_spark_under_connect(connect_run):
    """A sample of tests/test_conformance.py (event time with late rows; two key columns with an
    initial state) run natively and on dstl, both under Spark Connect."""
    _, got = _scenario(connect_run, "conformance")
    for name in ("event_time_max", "two_key_columns"):
        native, ours = got[name]["native"], got[name]["dstl"]
        assert native, f"{name}: no native output under Connect"
        assert ours == native, f"{name} under Connect: native {native} != dstl {ours}"
