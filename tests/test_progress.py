"""Per-batch progress records (dstl.spark.progress), their exporters, and `dstl state ls`'s column.

The record's parts are checked without Spark under both builds (real task reports, a real backend
and storage, a real prometheus_client registry); one fast Spark test runs a StatefulStream twice and
reads the record from the stream, its listener and the checkpoint; the heavy test reads Spark's own
`query.lastProgress` merged with dstl's entry on a real streaming query.
"""
from __future__ import annotations

import json
import pickle
import sys

import pandas as pd
import pytest

from conftest import heavy
from state_helpers import FULL, MAXP, storage  # noqa: F401 - fixture

pytest.importorskip("pyspark")

from pyspark import cloudpickle  # noqa: E402

from dstl.spark import progress as P  # noqa: E402
from dstl.spark import task_figures as F  # noqa: E402
from dstl.spark.report import TaskReport  # noqa: E402

cloudpickle.register_pickle_by_value(sys.modules[__name__])


def _report(i, *, continued=False, restored=False, metrics=None, **kw):
    base = dict(subtask=i, attempt=0, token="t", snapshot=b"", staged=None, rows_in=10 * (i + 1),
                rows_out=i + 1, restored=restored, restore_ms=7.0 if restored else 0.0, process_ms=2.4,
                snapshot_ms=1.6, state_size=100, pid=1, host="h", cache_hits=0, cache_misses=0,
                metrics=json.dumps(metrics or {}), continued=continued, executor="driver")
    base.update(kw)
    return TaskReport(**base)


def test_figures_sum_the_task_reports_into_a_state_operator_progress():
    reports = [_report(0, continued=True, metrics={F.ROWS_TOTAL: 5, "timers_fired": 2, "late_rows": 1,
                                                   F.UPLOAD_REQUESTS: 3, F.UPLOAD_BYTES: 400,
                                                   F.UPLOAD_LATENCY_MAX: 900}),
               _report(1, restored=True, metrics={F.ROWS_TOTAL: 6, F.UPLOAD_REQUESTS: 1, F.UPLOAD_BYTES: 50,
                                                  F.UPLOAD_LATENCY_MAX: 1200})]
    figures = P.checkpoint_figures(reports)
    assert figures["numRowsTotal"] == 11 and figures["numExpiredTimers"] == 2
    assert figures["numRowsDroppedByWatermark"] == 1 and figures["dstlRowsIn"] == 30 and figures["dstlRowsOut"] == 3
    assert figures["dstlSubtasksWarm"] == 1 and figures["dstlSubtasksRestored"] == 1
    assert figures["dstlRestoreLatencyMsMax"] == 7 and figures["allUpdatesTimeMs"] == 5
    assert figures[F.UPLOAD_REQUESTS] == 4 and figures[F.UPLOAD_BYTES] == 450 and figures[F.UPLOAD_LATENCY_MAX] == 1200
    assert all(isinstance(v, int) for v in figures.values())  # Spark's customMetrics are longs

    op = P.state_operator(figures, parallelism=2)
    assert set(op) == {"operatorName", "numRowsTotal", "numRowsUpdated", "numRowsRemoved", "allUpdatesTimeMs",
                       "allRemovalsTimeMs", "commitTimeMs", "memoryUsedBytes", "numRowsDroppedByWatermark",
                       "numShufflePartitions", "numStateStoreInstances", "customMetrics"}
    assert op["operatorName"] == P.OPERATOR_NAME and op["numShufflePartitions"] == 2
    assert op["numStateStoreInstances"] == 2 and op["numRowsTotal"] == 11 and op["commitTimeMs"] == 3
    assert op["customMetrics"]["numExpiredTimers"] == 2 and "numRowsTotal" not in op["customMetrics"]
    # a task that did not report its rows (an older worker): unknown, not zero
    assert P.checkpoint_figures([_report(0)])["numRowsTotal"] == -1


def test_a_task_counts_the_users_state_rows_and_what_its_storage_uploaded(storage):  # noqa: F811
    from dstl.state.backend import KeyedStateBackend
    from dstl.state.timers import TIMER_STATE

    backend = KeyedStateBackend(storage, "op", FULL, MAXP)
    mark = F.upload_mark(storage)
    backend.value_state("total").update_many(["a", "b", "c"], [1, 2, 3])
    backend.map_state("seen").put("a", "x", 1)
    backend.value_state(TIMER_STATE).update("a", 5)  # dstl's own: not a user row
    assert F.state_rows(backend) == 4
    backend.snapshot(1).result()
    delta = F.upload_delta(storage, mark)
    assert delta[F.UPLOAD_REQUESTS] >= 1 and delta[F.UPLOAD_BYTES] > 0 and delta[F.UPLOAD_LATENCY_MAX] > 0
    assert F.UPLOAD_FAILURES not in delta  # zeros are left out
    assert F.upload_delta(storage, F.upload_mark(storage)) == {}
    backend.close()


def test_the_log_keeps_recent_records_tells_listeners_and_survives_a_failing_one(caplog):
    log = P.ProgressLog(maxlen=3)
    seen = []

    def bad(record):
        raise RuntimeError("listener broke")

    log.add_listener(bad)
    log.add_listener(seen.append)
    with pytest.raises(TypeError, match="must be a function"):
        log.add_listener(42)
    for b in range(5):
        log.publish({"batchId": b, "stateOperators": []})
    assert [r["batchId"] for r in seen] == [0, 1, 2, 3, 4]
    assert [r["batchId"] for r in log.recent] == [2, 3, 4] and log.last["batchId"] == 4
    assert log.find(3)["batchId"] == 3 and log.find(0) is None
    assert "listener broke" in caplog.text and "progress listener" in caplog.text
    log.remove_listener(bad)
    log.publish({"batchId": 5, "stateOperators": []})
    assert seen[-1]["batchId"] == 5
    copy = pickle.loads(pickle.dumps(log))  # shipped with a stream: empty, no listeners
    assert copy.last is None and copy._listeners == []


def test_merged_appends_dstls_entry_to_sparks_progress():
    class Stream:
        progress = P.ProgressLog()

    entry = P.state_operator({"numRowsTotal": 3}, 2)
    Stream.progress.publish({"batchId": 7, "stateOperators": [entry]})
    spark_progress = {"id": "q", "batchId": 7, "stateOperators": [], "numInputRows": 4}
    got = P.merged(spark_progress, Stream)
    assert got["stateOperators"] == [entry] and got["numInputRows"] == 4
    assert spark_progress["stateOperators"] == []  # Spark's dict is not changed
    assert P.merged(None, Stream) is None


def test_prometheus_exporter_writes_the_expected_names():
    prom = pytest.importorskip("prometheus_client")
    from dstl.spark.progress_export import PrometheusExporter

    registry = prom.CollectorRegistry()
    export = PrometheusExporter(registry=registry)
    figures = P.checkpoint_figures([_report(0, metrics={F.ROWS_TOTAL: 5, "timers_fired": 2, F.UPLOAD_REQUESTS: 3})])
    record = {"name": "sessions", "id": "q1", "batchId": 0, "durationMs": {"dstlBatch": 1500},
              "stateOperators": [P.state_operator(figures, 1)]}
    export(record)
    export(dict(record, batchId=1))
    text = prom.generate_latest(registry).decode()
    labels = 'operator="dstlStatefulStream",query="sessions"'
    assert f"dstl_state_rows{{{labels}}} 5.0" in text
    assert f"dstl_timers_expired_total{{{labels}}} 4.0" in text  # counters add up batch by batch
    assert f"dstl_changelog_storage_upload_requests_total{{{labels}}} 6.0" in text
    assert f"dstl_input_rows_total{{{labels}}} 20.0" in text
    assert f"dstl_batch_duration_seconds_count{{{labels}}} 2.0" in text
    assert f"dstl_batch_duration_seconds_sum{{{labels}}} 3.0" in text
    assert "dstl_commit_duration_seconds" in text and "dstl_subtasks_warm" in text


def test_opentelemetry_exporter_records_on_the_meter():
    pytest.importorskip("opentelemetry.sdk.metrics")
    from opentelemetry.sdk.metrics import MeterProvider
    from opentelemetry.sdk.metrics.export import InMemoryMetricReader

    from dstl.spark.progress_export import OpenTelemetryExporter

    reader = InMemoryMetricReader()
    meter = MeterProvider(metric_readers=[reader]).get_meter("dstl")
    figures = P.checkpoint_figures([_report(0, metrics={F.ROWS_TOTAL: 5})])
    OpenTelemetryExporter(meter)({"id": "q1", "durationMs": {"dstlBatch": 10},
                                  "stateOperators": [P.state_operator(figures, 1)]})
    names = {m.name for rm in reader.get_metrics_data().resource_metrics for sm in rm.scope_metrics
             for m in sm.metrics}
    assert {"dstl.state.rows", "dstl.input.rows", "dstl.batch.duration"} <= names


def _totals(rows, state):
    """Each user's running sum of `v` (one value-state row per user)."""
    running = state.value_state("total")
    out = rows.groupby("user", as_index=False)["v"].sum()
    out["total"] = [running.get(u, 0) + int(v) for u, v in zip(out["user"], out["v"])]
    running.update_many(out["user"].tolist(), out["total"].tolist())
    return out[["user", "total"]]


def test_a_streams_progress_from_the_stream_its_listener_the_checkpoint_and_state_ls(spark, tmp_path, capsys):
    from dstl.spark import StatefulStream
    from dstl.state.metadata import latest_checkpoint
    from dstl.tools import state_cli

    base = str(tmp_path / "p")
    stream = StatefulStream(base, _totals, "user string, total long", key="user", parallelism=2)
    heard = []
    stream.add_listener(heard.append)
    assert stream.lastProgress is None and stream.recentProgress == []
    stream.run(spark.createDataFrame(pd.DataFrame({"user": ["a", "b", "a"], "v": [1, 2, 3]})))
    stream.run(spark.createDataFrame(pd.DataFrame({"user": ["c"], "v": [4]})))
    assert [r["batchId"] for r in stream.recentProgress] == [0, 1] and heard == stream.recentProgress
    last = stream.lastProgress
    op = last["stateOperators"][0]
    assert last["numInputRows"] == 1 and last["checkpointId"] == 2
    assert op["numRowsTotal"] == 3 and op["numShufflePartitions"] == 2 and op["numStateStoreInstances"] == 2
    custom = op["customMetrics"]
    assert custom["dstlRowsIn"] == 1 and custom["dstlRowsOut"] == 1
    assert custom["dstlSubtasksWarm"] + custom["dstlSubtasksRestored"] == 2  # local mode keeps them warm
    assert custom[F.UPLOAD_REQUESTS] >= 1 and custom[F.UPLOAD_BYTES] > 0 and custom["dstlNewFiles"] >= 1
    kept = latest_checkpoint(base).properties["progress"]
    assert kept["numRowsTotal"] == 3 and kept[F.UPLOAD_REQUESTS] == custom[F.UPLOAD_REQUESTS]

    # a StatefulJob keeps the same records
    from dstl.spark import StatefulJob
    from dstl.spark.coordinator import CheckpointCoordinator, JobSpec

    jbase = str(tmp_path / "job")
    coord = CheckpointCoordinator.open(jbase, JobSpec.new("totals", 8, jbase + "/output"),
                                       {"dstl.dfs.base-path": jbase}, resume=False)
    job = StatefulJob(coord, _totals, "user string, total long", key="user", parallelism=2, spark=spark)
    job_heard = []
    job.add_listener(job_heard.append)
    job.run_batch(pd.DataFrame({"user": ["a", "b", "c", "a"], "v": [1, 2, 3, 4]}))
    coord.finish()
    assert job_heard == job.recentProgress and job.lastProgress["stateOperators"][0]["numRowsTotal"] == 3
    assert latest_checkpoint(jbase).properties["progress"]["dstlRowsIn"] == 4

    parser = __import__("argparse").ArgumentParser()
    state_cli.add_arguments(parser)
    assert state_cli.run(parser.parse_args(["ls", base])) == 0
    table = capsys.readouterr().out.splitlines()
    assert "batch in>out" in table[0]
    assert "b0 3>2 rows=2" in table[1] and "b1 1>1 rows=3" in table[2]


@heavy
def test_progress_of_a_real_streaming_query_merges_dstls_entry(spark, tmp_path):
    from dstl.spark import StatefulStream, progress_of

    src = tmp_path / "in"
    src.mkdir()
    pd.DataFrame({"user": ["a", "b", "a"], "v": [1, 2, 3]}).to_json(src / "0.json", orient="records", lines=True)
    stream = StatefulStream(str(tmp_path / "state"), _totals, "user string, total long", key="user", parallelism=2)
    seen = []
    stream.add_listener(seen.append)
    events = spark.readStream.schema("user string, v long").json(str(src))
    query = (events.writeStream.foreachBatch(stream).option("checkpointLocation", str(tmp_path / "ckpt"))
             .queryName("dstl_progress_test").start())
    try:
        query.processAllAvailable()
        pd.DataFrame({"user": ["c"], "v": [4]}).to_json(src / "1.json", orient="records", lines=True)
        query.processAllAvailable()
        merged = progress_of(query, stream)
    finally:
        query.stop()
    assert merged["batchId"] == 1 and merged["name"] == "dstl_progress_test"
    assert merged["numInputRows"] == 1  # Spark's own figures stay
    ops = merged["stateOperators"]
    assert len(ops) == 1 and ops[0]["operatorName"] == P.OPERATOR_NAME and ops[0]["numRowsTotal"] == 3
    assert [r["batchId"] for r in seen] == [0, 1]
    # the record carries Spark's query and run ids (Spark's progress holds them as UUIDs)
    assert seen[-1]["id"] == str(merged["id"]) and seen[-1]["runId"] == str(merged["runId"])

    class Elsewhere:  # the batch ran in another process (Spark Connect): read from the checkpoint
        base_path = stream.base_path
        parallelism = 2
        progress = P.ProgressLog()

    from_ckpt = P.merged({"batchId": 1, "stateOperators": []}, Elsewhere)["stateOperators"][0]
    assert from_ckpt["numRowsTotal"] == 3 and from_ckpt["customMetrics"]["dstlRowsIn"] == 1
