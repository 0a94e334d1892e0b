"""A StatefulStream (P=2, state and output on moto's S3 server) through an object store that
misbehaves: tests/s3proxy.py between s3fs and moto injects 503 SlowDown and 500 answers, connection
resets, 2 s latency, PUTs whose answers are lost, and an outage in the middle of a batch
(docs/semantics.md, "Faults of the object store"). Each run is a real driver process
(tests/cluster_driver.py, local mode) reaching the store only through the proxy; the output is
compared row for row with pandas, and `dstl gc` must find nothing unreferenced. Also here, as it
needs a driver of its own: a batch in Spark's Python workers under a 200-character TMPDIR and
DSTL_RUNTIME_DIR (docs/service.md, "The runtime directory and its sockets").

Heavy: each test starts Spark drivers (about 1-3 minutes each on a loaded 2-core machine).
"""
from __future__ import annotations

import os
import shutil
import subprocess
import sys
import time
import uuid

import pytest

from conftest import heavy

pytestmark = heavy

pytest.importorskip("pyspark")

HERE = os.path.dirname(os.path.abspath(__file__))
ROOT = os.path.dirname(HERE)
EVENTS, KEYS = 400, 60
CONF = {"spark.master": "local[2,4]", "spark.driver.host": "127.0.0.1", "spark.driver.bindAddress": "127.0.0.1",
        "spark.ui.enabled": "false", "spark.sql.shuffle.partitions": "4", "spark.task.maxFailures": "4",
        "spark.sql.execution.arrow.pyspark.enabled": "true"}
# above the proxy's 2 s latency with room for a loaded machine (docs/semantics.md)
OPTIONS = ["upload.timeout=10s"]


@pytest.fixture
def store(s3_server, tmp_path):
    """(proxy, bucket URL): a fresh bucket on moto, reached by the drivers only through the proxy."""
    import s3fs

    from s3proxy import ProxyProcess

    name = f"dstl-faults-{uuid.uuid4().hex[:10]}"
    fs = s3fs.S3FileSystem(client_kwargs={"endpoint_url": s3_server}, skip_instance_cache=True)
    fs.mkdir(name)
    proxy = ProxyProcess(s3_server, str(tmp_path))
    try:
        yield proxy, f"s3://{name}"
    finally:
        proxy.stop()
        try:
            fs.rm(name, recursive=True)
        except FileNotFoundError:
            pass


def _driver(proxy, base, tmp_path, on_start=None, timeout=900, conf=None):
    """Run tests/cluster_driver.py over the input batches written so far (those done already are
    skipped by Spark's checkpoint) with the store behind `proxy` and CONF updated with `conf`;
    `on_start(batch)` is called once as each batch starts. Returns (exit code, seconds, log text)."""
    from cluster_util import read_progress

    inputs, ckpt, progress = (str(tmp_path / n) for n in ("input", "spark-checkpoint", "progress.jsonl"))
    env = dict(os.environ, AWS_ENDPOINT_URL=proxy.endpoint, PYTHONPATH=os.pathsep.join([ROOT, HERE]),
               PYSPARK_PYTHON=sys.executable, SPARK_LOCAL_IP="127.0.0.1")
    argv = [sys.executable, os.path.join(HERE, "cluster_driver.py"), "--base", base, "--input", inputs,
            "--checkpoint", ckpt, "--parallelism", "2", "--progress", progress]
    for opt in OPTIONS:
        argv += ["--option", opt]
    for k, v in dict(CONF, **(conf or {})).items():
        argv += ["--conf", f"{k}={v}"]
    seen = {e["batch"] for e in read_progress(progress) if e["phase"] == "start"}
    log_path = progress + ".log"
    t0 = time.monotonic()
    with open(log_path, "ab") as log:
        proc = subprocess.Popen(argv, env=env, stdout=log, stderr=subprocess.STDOUT, start_new_session=True)
    try:
        while proc.poll() is None and time.monotonic() - t0 < timeout:
            for e in read_progress(progress):
                if e["phase"] == "start" and e["batch"] not in seen:
                    seen.add(e["batch"])
                    if on_start is not None:
                        on_start(e["batch"])
            time.sleep(0.05)
    finally:
        if proc.poll() is None:
            proc.kill()
        proc.wait(30)
        from dstl.tools.stream_demo import reap_group

        reap_group(proc.pid)
    with open(log_path, errors="replace") as f:
        return proc.returncode, time.monotonic() - t0, f.read()


def _batch_seconds(tmp_path):
    """Each completed batch's seconds (for the timing line a test writes to stderr)."""
    from cluster_util import read_progress

    return {e["batch"]: round(e["seconds"], 1) for e in read_progress(str(tmp_path / "progress.jsonl"))
            if e["phase"] == "done"}


def _write_inputs(tmp_path, batches, upto):
    from streaming_util import write_json_batch

    for b in range(upto):
        write_json_batch(str(tmp_path / "input"), b, batches[b])


def _check_exact(base, batches):
    import fsspec
    import numpy as np
    import pyarrow.dataset as ds

    from streaming_util import normalize, reference_counts

    fs, root = fsspec.core.url_to_fs(f"{base}/output")
    fs.invalidate_cache()
    got = ds.dataset(root, filesystem=fs, format="parquet", partitioning="hive").to_table().to_pandas()
    got["batch_id"] = got["batch_id"].astype(np.int64)
    cols = ["user", "events", "value_sum", "batches", "kinds", "top_kind_events", "batch_id"]
    got, want = normalize(got, cols), normalize(reference_counts(batches), cols)
    assert len(got) == len(want) and got.equals(want)


def _nothing_to_collect(base, capsys):
    from dstl import cli

    capsys.readouterr()
    assert cli.main(["gc", base, "--keep-latest", "2", "--grace", "0s"]) == 0
    out = capsys.readouterr().out
    assert "0 files (0 bytes) would delete" in out, out


def test_stream_rides_through_throttling_resets_latency_and_lost_put_answers(store, tmp_path, capsys):
    from streaming_util import make_batches

    proxy, bucket = store
    base = f"{bucket}/riding"
    batches = make_batches(6, EVENTS, KEYS, seed=34)
    # one fault kind per batch, throttling and resets together (each request draws both)
    plan = {1: dict(error_rate=0.2, error_codes=[503, 500], reset_rate=0.15, seed=1),
            2: dict(latency_s=2.0),                                   # a slow store
            3: dict(lose_put_answers=3),                              # stored, never answered
            4: dict(lose_put_answers=1, lose_match="_metadata")}      # ... the checkpoint's own
    stats = {}

    def on_start(b):
        if b - 1 in plan:
            stats[b - 1] = proxy.stats()
        if b in plan:
            proxy.set(**plan[b])

    _write_inputs(tmp_path, batches, 5)
    code, seconds, log = _driver(proxy, base, tmp_path, on_start)
    assert code == 0, log[-4000:]
    proxy.set()
    final = proxy.stats()
    assert final["errors"] > 0 and final["resets"] > 0 and final["lost_put_answers"] == 4, final
    # a restart restores every subtask from the store (files whose PUT answers were lost included)
    _write_inputs(tmp_path, batches, 6)
    code, _, log = _driver(proxy, base, tmp_path)
    assert code == 0, log[-4000:]
    _check_exact(base, batches)
    _nothing_to_collect(base, capsys)
    sys.stderr.write(f"\nfaults ride-through: {seconds:.0f} s for 5 batches; proxy {final}; "
                     f"batch seconds {_batch_seconds(tmp_path)}\n")


def test_store_outage_mid_batch_fails_once_clearly_and_the_restart_resumes_exactly(store, tmp_path, capsys):
    from streaming_util import make_batches

    proxy, bucket = store
    base = f"{bucket}/outage"
    batches = make_batches(4, EVENTS, KEYS, seed=35)
    down_at = {}

    def on_start(b):
        if b == 2:  # the store goes away under batch 2's first upload, from a task
            proxy.set(down_from_put="")
            down_at["t"] = time.monotonic()

    _write_inputs(tmp_path, batches, 4)
    # two task attempts, not four: Spark's retry of the failed task takes part, and each further
    # attempt would only wait out the same retries again (about 35 s each on a loaded machine)
    retry_once = {"spark.master": "local[2,2]", "spark.task.maxFailures": "2"}
    code, _, log = _driver(proxy, base, tmp_path, on_start, conf=retry_once)
    failed_after = time.monotonic() - down_at["t"]
    assert down_at and code != 0, log[-4000:]
    # no hang beyond the configured timeouts (docs/semantics.md: attempts x timeout per write, Spark's
    # task retries, botocore's own retries)
    assert failed_after < 300, failed_after
    with open(proxy.control + ".log") as f:
        tripped = [line for line in f if line.startswith("DOWN from PUT")]
    assert len(tripped) == 1 and "/_staging/batch-000002/" in tripped[0], tripped  # a task's write
    # the task failed, was retried, and the retry failed too
    assert "failed 2 times" in log, log[-4000:]
    assert "StreamBatchError" in log or "Could not connect to the endpoint URL" in log, log[-4000:]
    proxy.set()  # the store is back
    code, _, log = _driver(proxy, base, tmp_path)
    assert code == 0, log[-4000:]
    _check_exact(base, batches)
    _nothing_to_collect(base, capsys)
    sys.stderr.write(f"\nstore outage: the driver failed {failed_after:.0f} s after the store went away; "
                     f"batch seconds {_batch_seconds(tmp_path)}\n")


def test_a_stream_batch_under_a_200_character_tmpdir_and_runtime_dir(tmp_path):
    """Item 1's Spark half: the default process mode in Spark's Python workers, whose TMPDIR and
    DSTL_RUNTIME_DIR are 200 characters long; a local base path; exact output."""
    from streaming_util import make_batches, normalize, read_output, reference_counts

    def long_dir(n):
        top = os.path.join("/tmp", f"dl-{uuid.uuid4().hex[:8]}")
        d = top + "/" + "t" * (n - len(top) - 1)
        os.makedirs(d)
        return top, d

    (t_top, tmpdir), (r_top, rundir) = long_dir(200), long_dir(200)
    batches = make_batches(3, EVENTS, KEYS, seed=36)
    _write_inputs(tmp_path, batches, 3)
    base = str(tmp_path / "job")
    env = dict(os.environ, TMPDIR=tmpdir, DSTL_RUNTIME_DIR=rundir, PYTHONPATH=os.pathsep.join([ROOT, HERE]),
               PYSPARK_PYTHON=sys.executable, SPARK_LOCAL_IP="127.0.0.1")
    argv = [sys.executable, os.path.join(HERE, "cluster_driver.py"), "--base", base,
            "--input", str(tmp_path / "input"), "--checkpoint", str(tmp_path / "ckpt"), "--parallelism", "2",
            "--progress", str(tmp_path / "progress.jsonl"), "--option", "upload.mode=process"]
    for k, v in CONF.items():
        argv += ["--conf", f"{k}={v}"]
    from service_util import stop_services_under

    try:
        p = subprocess.run(argv, env=env, capture_output=True, text=True, timeout=900, start_new_session=True)
        assert p.returncode == 0, (p.stdout + p.stderr)[-4000:]
        cols = ["user", "events", "value_sum", "batches", "kinds", "top_kind_events", "batch_id"]
        got = normalize(read_output(base + "/output"), cols)
        assert got.equals(normalize(reference_counts(batches), cols))
    finally:
        stop_services_under(rundir)
        shutil.rmtree(t_top, ignore_errors=True)
        shutil.rmtree(r_top, ignore_errors=True)
