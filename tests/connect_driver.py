"""Drive dstl through a Spark Connect session: `SparkSession.builder.remote("local[2]")`.

Run as a script by tests/test_connect.py, in its own process: a local Connect server starts inside
this process's JVM (a process with a classic session could not start one), and the client side must
not share a process with the suite's classic session (a Connect session switches pyspark into
Connect mode for the whole process). Usage: connect_driver.py WORK_DIR; writes WORK_DIR/result.json:
per scenario "ok" or the error, plus what the test compares.

Once the session is up, the classic SparkContext the local server lives in is hidden from this
process (and building a new one raises): any use of `sparkContext`, `_jvm` or an RDD by dstl would
fail here as it does against a remote `sc://` server.
"""
from __future__ import annotations

import json
import os
import sys
import traceback

HERE = os.path.dirname(os.path.abspath(__file__))
sys.path.insert(0, HERE)
os.environ["PYSPARK_PYTHON"] = sys.executable


#: the tag the `run` scenario's jobs carry (tests/test_connect.py finds its batches by it)
RUN_SCOPE = "connect-driver-run-scenario"


def _hide_classic_context():
    """Make the in-process classic SparkContext unusable; returns a function that restores it."""
    from pyspark import SparkContext

    saved = (SparkContext._active_spark_context, SparkContext._jvm, SparkContext._gateway)
    real_init = SparkContext.__init__

    def refuse(self, *a, **kw):
        raise RuntimeError("a classic SparkContext was requested under Spark Connect")

    SparkContext._active_spark_context, SparkContext._jvm, SparkContext._gateway = None, None, None
    SparkContext.__init__ = refuse

    def restore():
        SparkContext._active_spark_context, SparkContext._jvm, SparkContext._gateway = saved
        SparkContext.__init__ = real_init

    return restore


def main(work: str) -> int:
    from pyspark.sql import SparkSession
    from pyspark.sql import functions as F

    from eventlog_util import eventlog_conf

    events = os.path.join(work, "eventlog")  # what Spark ran (tests/test_connect.py); "events" is the stream source
    os.makedirs(events, exist_ok=True)
    builder = (SparkSession.builder.remote("local[2]").config("spark.sql.shuffle.partitions", "2")
               # a Python process that connected back but is slow to answer Spark's authentication
               # on a loaded machine is still accepted (the connect-back itself has a fixed 10 s:
               # tests/driver_util.py, bytecode_spark_home)
               .config("spark.python.authenticate.socketTimeout", "120s")
               .config("spark.sql.streaming.stateStore.providerClass",
                       "org.apache.spark.sql.execution.streaming.state.RocksDBStateStoreProvider"))
    for key, value in eventlog_conf(events).items():
        builder = builder.config(key, value)
    spark = builder.getOrCreate()
    restore = _hide_classic_context()
    from dstl.spark import StatefulStream, bootstrap_state, read_changes, read_state, read_timers
    from processors import (COUNT_OUTPUT, SESSION_OUTPUT, CountingProcessor, RowCountingProcessor,
                            RowSessionProcessor)
    from streaming_util import EVENTS_SCHEMA, make_batches, read_stream, write_json_stream

    result = {"session": type(spark).__module__}
    batches = make_batches(3, 600, 200)
    source = os.path.join(work, "events")
    write_json_stream(source, batches)

    def scenario(name, fn):
        try:
            result[name] = {"ok": True, **(fn() or {})}
        except BaseException as exc:  # noqa: BLE001 - reported to the test
            result[name] = {"ok": False, "error": f"{type(exc).__name__}: {exc}", "trace": traceback.format_exc()}

    def static(b):
        return spark.createDataFrame(batches[b], EVENTS_SCHEMA).withColumn("ts", F.timestamp_millis("ts_ms"))

    def foreach_batch_row_api():
        # the stream object is pickled to the server's foreachBatch worker: it runs there
        stream = StatefulStream(os.path.join(work, "fb"), RowCountingProcessor(), COUNT_OUTPUT, key="user",
                                parallelism=2, api="row", retain=5)
        for attempt in range(5):
            try:
                query = (read_stream(spark, source).writeStream.foreachBatch(stream)
                         .option("checkpointLocation", os.path.join(work, "fb-ckpt"))
                         .trigger(availableNow=True).start())
                break
            except Exception as exc:  # noqa: BLE001
                # Spark waits a fixed 10 s for its foreachBatch Python process to connect back; the
                # test starts it without compiling pyspark (bytecode_spark_home), and on a machine
                # loaded enough it can still start slower. Nothing has run yet: start again.
                if "failed to connect back" not in str(exc) or attempt == 4:
                    raise
        query.awaitTermination()
        from dstl.state.metadata import list_checkpoints, read_checkpoint

        placement = [read_checkpoint(os.path.join(work, "fb"), c).properties.get("placement")
                     for c in list_checkpoints(os.path.join(work, "fb"))]
        # the batches ran in the server: dstl's entry in Spark's progress comes from the checkpoints
        from dstl.spark import progress_of

        merged = progress_of(query, stream)
        return {"progress_batches": len(query.recentProgress), "placement": placement,
                "merged_batch": merged["batchId"], "merged_operators": merged["stateOperators"]}

    def run_pandas_api_and_rescale():
        base = os.path.join(work, "run")
        # this scenario's jobs carry the tag too, beside dstl's batch tag: the event log holds every
        # scenario's batches, with the same operator and batch numbers
        spark.addTag(RUN_SCOPE)
        try:
            res = [StatefulStream(base, CountingProcessor(), COUNT_OUTPUT, key="user", parallelism=2,
                                  retain=5).run(static(b)) for b in range(2)]
            rescaled = StatefulStream(base, CountingProcessor(), COUNT_OUTPUT, key="user", parallelism=3,
                                      retain=5).run(static(2))
        finally:
            spark.removeTag(RUN_SCOPE)
        every = res + [rescaled]
        return {"batch_ids": [r.batch_id for r in every], "rows_out": [r.rows_out for r in every],
                "rescale_restored": rescaled.restored, "subtasks": sorted(t.subtask for t in rescaled.reports),
                "routes": [r.route for r in every], "events": events, "scope": RUN_SCOPE,
                "reports": {r.batch_id: [{"subtask": t.subtask, "executor": t.executor, "rows_in": t.rows_in}
                                         for t in r.reports] for r in every}}

    def readers():
        base = os.path.join(work, "run")
        state = read_state(spark, base, "totals").toPandas()
        changes = read_changes(spark, base, 1, 3).toPandas()
        return {"state": state.to_dict("records"), "changes": len(changes),
                "change_ops": sorted(set(changes["op"]))}

    def timers():
        base = os.path.join(work, "sessions")
        stream = StatefulStream(base, RowSessionProcessor(), SESSION_OUTPUT, key="user", parallelism=2, api="row",
                                time_mode="EventTime", event_time_column="ts", watermark_delay="10 seconds")
        for b in range(2):
            stream.run(static(b))
        got = read_timers(spark, base).toPandas()
        return {"timers": got.to_dict("records")}

    def bootstrap():
        base = os.path.join(work, "boot")
        users = sorted(set(batches[0]["user"]))[:2]  # users batch 0 has events for
        seeds = {users[0]: [100, 5], users[1]: [10, 1]}
        seed = spark.createDataFrame([(u, *v) for u, v in seeds.items()], "user string, events long, value_sum long")
        meta = bootstrap_state(spark, seed, base, key="user", state_name="totals",
                               schema="events long, value_sum long", operator_id=StatefulStream.operator_id,
                               parallelism=2)
        r = StatefulStream(base, RowCountingProcessor(), COUNT_OUTPUT, key="user", parallelism=2,
                           api="row").run(static(0))
        return {"checkpoint": meta.checkpoint_id, "batch_id": r.batch_id, "next_checkpoint": r.checkpoint_id,
                "seeds": seeds}

    def seam():
        from dstl.spark import session as S

        return {"is_connect": S.is_connect(spark), "default_parallelism": S.default_parallelism(spark),
                "worker_env": S._worker_env(spark), "executor_count": S.executor_count(spark),
                "quiet": S.quiet(spark)}

    def conformance():
        # a sample of tests/test_conformance.py under Connect: native transformWithState and
        # foreachBatch(StatefulStream) on the same file stream, compared batch by batch
        from conformance_util import compare
        from conform_cases import CASES

        out = {}
        for name in ("event_time_max", "two_key_columns"):
            case = next(c for c in CASES if c.name == name)
            native, ours, _ = compare(spark, case, "row", os.path.join(work, f"conform-{name}"))
            out[name] = {"native": {b: sorted(map(repr, c.elements())) for b, c in native.items()},
                         "dstl": {b: sorted(map(repr, c.elements())) for b, c in ours.items()}}
        return out

    scenario("seam", seam)
    scenario("foreach_batch_row_api", foreach_batch_row_api)
    scenario("run_pandas_api_and_rescale", run_pandas_api_and_rescale)
    scenario("readers", readers)
    scenario("timers", timers)
    scenario("bootstrap", bootstrap)
    scenario("conformance", conformance)
    with open(os.path.join(work, "result.json"), "w") as f:
        json.dump(result, f, default=str)
    restore()
    spark.stop()
    return 0


if __name__ == "__main__":
    sys.exit(main(sys.argv[1]))
