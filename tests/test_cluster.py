"""StatefulStream on a real Spark standalone cluster: a master and two workers (1 core, 1 GB each)
from pyspark's own bin/spark-class on 127.0.0.1, state on moto's S3 server.

One run (about 3 minutes on an idle machine): the stream at parallelism 2 while a worker JVM and its
executor JVM are SIGKILLed as the executor runs a task (a new worker is started), then the same
query restarted at parallelism 4. Checked: every output row exact, P tasks per batch in the event
log, running at overlapping times, the lost subtask moving once and staying, every subtask restoring
at the rescale, the warm rate once the cluster is stable, and nothing for `dstl gc` to delete.
Heavy: runs once, under the Cython build (tests/test_stream.py covers the same protocol in-process
under both implementations).
"""
from __future__ import annotations

import os

import pytest

from cluster_util import StandaloneCluster, free_port, read_progress, run_stream_driver, running_tasks
from eventlog_util import batch_stages, overlapping, successful
from conftest import heavy

pytestmark = heavy

HERE = os.path.dirname(os.path.abspath(__file__))
ROOT = os.path.dirname(HERE)
# phase 1 at parallelism 2 (a worker killed while it runs a task of batch KILL_AT), phase 2 at 4
PHASES = ((2, 5), (4, 7))
KILL_AT = 2
EVENTS_PER_BATCH, KEYS = 1500, 300
WARM_MIN = 0.9
CREDENTIALS = ("AWS_ACCESS_KEY_ID", "AWS_SECRET_ACCESS_KEY", "AWS_SESSION_TOKEN")


def _failed_batch_attempts(log_dir):
    """(executor, reason) of every failed task attempt in a stage of a dstl batch's jobs (jobs whose
    description starts with "dstl "), superseded jobs included."""
    import glob
    import json

    stages, failed = set(), []
    for path in sorted(glob.glob(os.path.join(log_dir, "*"))):
        with open(path) as f:
            for e in map(json.loads, filter(str.strip, f)):
                if e["Event"] == "SparkListenerJobStart":
                    if ((e.get("Properties") or {}).get("spark.job.description") or "").startswith("dstl "):
                        stages.update(e.get("Stage IDs", []))
                elif e["Event"] == "SparkListenerTaskEnd" and e["Stage ID"] in stages:
                    reason = e["Task End Reason"]["Reason"]
                    if reason != "Success":
                        failed.append((str(e["Task Info"]["Executor ID"]), reason))
    return failed


def _read_s3_output(base):
    import fsspec
    import numpy as np
    import pyarrow.dataset as ds

    fs, root = fsspec.core.url_to_fs(f"{base}/output")
    fs.invalidate_cache()
    out = ds.dataset(root, filesystem=fs, format="parquet", partitioning="hive").to_table().to_pandas()
    out["batch_id"] = out["batch_id"].astype(np.int64)
    return out


@pytest.mark.timeout(900)  # ~3 minutes idle; a shared 2-core machine under load took 6.5
def test_stream_on_standalone_cluster_with_worker_loss_and_rescale(s3_bucket, tmp_path, capsys):
    from dstl import cli
    from streaming_util import make_batches, normalize, reference_counts, write_json_batch

    n_batches = sum(n for _, n in PHASES)
    batches = make_batches(n_batches, EVENTS_PER_BATCH, KEYS, seed=19)
    base = f"{s3_bucket}/cluster-job"
    inputs, ckpt, progress = (str(tmp_path / n) for n in ("input", "spark-checkpoint", "progress.jsonl"))
    # executors get S3 the way a real cluster would: endpoint and credentials through
    # spark.executorEnv.*, not inherited from the workers' environment
    creds = {k: os.environ[k] for k in CREDENTIALS if k in os.environ}
    with StandaloneCluster(str(tmp_path / "cluster"), workers=2, env={k: None for k in CREDENTIALS}) as cluster:
        conf = dict(cluster.app_conf())
        conf.update({f"spark.executorEnv.{k}": v for k, v in creds.items()})
        conf["spark.executorEnv.AWS_ENDPOINT_URL"] = os.environ["AWS_ENDPOINT_URL"]
        conf["spark.executorEnv.AWS_DEFAULT_REGION"] = "us-east-1"
        conf["spark.task.maxFailures"] = "4"
        # above the longest task time on a loaded machine, as docs/spark.md ("Placement") advises:
        # with the default 3 s an idle executor takes a queued task that prefers the other one
        conf["spark.locality.wait"] = "30s"
        driver_env = cluster.driver_env(dict(creds, PYTHONPATH=os.pathsep.join([ROOT, HERE])))
        conf.update({"spark.ui.enabled": "true", "spark.ui.port": str(free_port())})
        killed, event_logs = [], []

        def kill_mid_task(entries):
            """From batch KILL_AT on, SIGKILL the worker (and its executor) whose executor runs a
            subtask of a batch (seen through the driver's status API), once; then start a new worker."""
            if killed or not any(e["phase"] == "start" and e["batch"] >= KILL_AT for e in entries):
                return
            for t in running_tasks(int(conf["spark.ui.port"])):
                if not t["description"].startswith("dstl "):  # not a batch's subtask stage
                    continue
                worker = cluster.worker_of_executor(t["appId"], t["executorId"])
                if worker is not None:
                    pids = cluster.kill_worker(worker)
                    assert len(pids) == 2, pids  # the worker JVM and its executor JVM
                    killed.append((pids, t["executorId"]))
                    cluster.start_worker(worker)
                    return

        done = 0
        for phase, (parallelism, n) in enumerate(PHASES):
            for b in range(done, done + n):
                write_json_batch(inputs, b, batches[b])
            done += n
            # one event-log directory per application: stage ids restart with each application;
            # upload.timeout: a loaded 2-core machine answers S3 slower than the default 1 s
            log_dir = str(tmp_path / f"event-log-{phase}")
            os.makedirs(log_dir)
            event_logs.append(log_dir)
            env = driver_env
            if phase == 0:  # batch KILL_AT's tasks stall (once each, 10 s), so the kill surely hits a running one
                env = dict(driver_env, DSTL_FAULTS_STALL_S="10", DSTL_FAULTS=",".join(
                    f"task.mid_batch@{KILL_AT}/{s}=stall:once={tmp_path / f'stalled-{s}'}" for s in range(parallelism)))
            run_stream_driver(env, dict(conf, **{"spark.eventLog.dir": "file://" + log_dir}),
                              ["--base", base, "--input", inputs, "--checkpoint", ckpt,
                               "--parallelism", str(parallelism), "--option", "upload.timeout=10s"],
                              progress, on_poll=kill_mid_task if phase == 0 else None)
            if phase == 0:
                cluster.wait_for_workers(2)
    assert killed, "no task of batch %d or later was seen running: no worker was killed" % KILL_AT

    # exact output: every batch once, every row as pandas computes it
    cols = ["user", "events", "value_sum", "batches", "kinds", "top_kind_events", "batch_id"]
    got = normalize(_read_s3_output(base), cols)
    expected = normalize(reference_counts(batches), cols)
    assert len(got) == len(expected)
    assert got.equals(expected)

    # the kill hit a running task of a batch's stage: that attempt failed (the retry succeeded: the
    # output is exact)
    stages = {}
    for log_dir in event_logs:
        stages.update(batch_stages(log_dir))
    assert sorted(stages) == list(range(n_batches))
    lost = killed[0][1]
    assert (lost, "ExecutorLostFailure") in _failed_batch_attempts(event_logs[0])

    # nothing leaked: no changelog file that no retained checkpoint references
    capsys.readouterr()
    assert cli.main(["gc", base, "--keep-latest", "2", "--grace", "0s"]) == 0
    assert "0 files (0 bytes) would delete" in capsys.readouterr().out

    done_entries = [e for e in read_progress(progress) if e["phase"] == "done" and not e["replayed"]]
    assert [e["batch"] for e in done_entries] == list(range(n_batches))
    for e in done_entries:
        # P tasks per batch, in the batch's one stage: task i = subtask i
        p = e["parallelism"]
        assert sorted(successful(stages[e["batch"]])) == list(range(p)), (e["batch"], stages[e["batch"]])
        assert sorted(r["subtask"] for r in e["reports"]) == list(range(p))
    # the lost executor's subtask moved once (its retry restored the state) and stayed on its new
    # executor; the other subtask never restored
    by_batch = {e["batch"]: {r["subtask"]: r for r in e["reports"]} for e in done_entries}
    # (the moved task's attempt number can be 0: losing the executor also loses its shuffle output,
    # and Spark resubmits the stage, whose attempts count from 0 again)
    [(moved, r)] = [(s, r) for s, r in by_batch[KILL_AT].items() if r["restored"]]
    assert r["restored"] and r["executor"] != str(lost), r
    for b in range(KILL_AT + 1, PHASES[0][1]):
        assert by_batch[b][moved]["executor"] == r["executor"] and by_batch[b][moved]["continued"], by_batch[b]
    assert not any(by_batch[b][1 - moved]["restored"] for b in range(1, PHASES[0][1])), by_batch
    # the rescale restores every subtask once, in the new query's first batch
    assert all(r["restored"] for r in by_batch[PHASES[0][1]].values())
    # warm rate on a stable cluster: phase 2, after its first batch
    parallelism, n = PHASES[1]
    stable = done_entries[-(n - 1):]
    warm = [r["continued"] for e in stable for r in e["reports"]]
    assert sum(warm) / len(warm) >= WARM_MIN, f"{sum(warm)}/{len(warm)} subtask-batches warm"
    # ... each batch on both executors, its tasks running at the same time
    assert all(len({r["executor"] for r in e["reports"]}) == 2 for e in stable)
    spread = [e["batch"] for e in stable if overlapping(stages[e["batch"]])
              and len({r.executor for r in successful(stages[e["batch"]]).values()}) == 2]
    assert len(spread) == len(stable), (spread, {e["batch"]: stages[e["batch"]] for e in stable})
