"""What a steady-state StatefulStream batch asks of an object store (P=2, 5,000 events, state and
output on moto's S3 server): the driver and Spark's Python workers each reach the store through a
proxy of their own (tests/s3proxy.py, separate processes stopped by PID), so every request is
counted and told apart by who made it. The driver's requests are round trips in sequence on the
batch's critical path; the budget is docs/spark.md's ("What a batch asks of the store").

Heavy: it runs a Spark driver (about 1-2 minutes on a loaded 2-core machine).
"""
from __future__ import annotations

import collections
import os
import sys
import uuid

import pytest

from conftest import heavy
from s3proxy import request_kind

pytestmark = heavy

pytest.importorskip("pyspark")

HERE = os.path.dirname(os.path.abspath(__file__))
ROOT = os.path.dirname(HERE)
EVENTS, KEYS, BATCHES, MEASURED = 5000, 400, 5, 3
DRIVER_BUDGET, TOTAL_BUDGET = 12, 16
CONF = {"spark.master": "local[2]", "spark.driver.host": "127.0.0.1", "spark.driver.bindAddress": "127.0.0.1",
        "spark.ui.enabled": "false", "spark.sql.shuffle.partitions": "4",
        "spark.sql.execution.arrow.pyspark.enabled": "true"}


@pytest.fixture
def proxies(s3_server, tmp_path):
    """(driver proxy, task proxy, bucket URL) on a fresh bucket."""
    import s3fs

    from s3proxy import ProxyProcess

    name = f"dstl-req-{uuid.uuid4().hex[:10]}"
    fs = s3fs.S3FileSystem(client_kwargs={"endpoint_url": s3_server}, skip_instance_cache=True)
    fs.mkdir(name)
    made = []
    try:
        for who in ("driver", "tasks"):
            (tmp_path / who).mkdir()
            made.append(ProxyProcess(s3_server, str(tmp_path / who)))
        yield made[0], made[1], f"s3://{name}"
    finally:
        for proxy in made:
            proxy.stop()
        try:
            fs.rm(name, recursive=True)
        except FileNotFoundError:
            pass


def test_a_steady_state_batch_stays_within_its_request_budget(proxies, tmp_path):
    from cluster_util import read_progress, run_stream_driver
    from streaming_util import make_batches, write_json_batch

    driver, tasks, bucket = proxies
    for b, batch in enumerate(make_batches(BATCHES, EVENTS, KEYS, seed=42)):
        write_json_batch(str(tmp_path / "input"), b, batch)
    progress = str(tmp_path / "progress.jsonl")
    # dstl forwards the driver's AWS_ENDPOINT_URL* to the workers, but not AWS_CONFIG_FILE: each side
    # finds its own proxy in a config file of its own (spark.executorEnv.* reaches the workers)
    ini = {}
    for who, proxy in (("driver", driver), ("tasks", tasks)):
        ini[who] = str(tmp_path / who / "aws-config")
        with open(ini[who], "w") as f:
            f.write(f"[default]\nendpoint_url = {proxy.endpoint}\n")
    env = {k: v for k, v in os.environ.items() if not k.startswith("AWS_ENDPOINT_URL")}
    env.update(AWS_CONFIG_FILE=ini["driver"], PYTHONPATH=os.pathsep.join([ROOT, HERE]),
               PYSPARK_PYTHON=sys.executable, SPARK_LOCAL_IP="127.0.0.1")
    conf = dict(CONF, **{"spark.executorEnv.AWS_CONFIG_FILE": ini["tasks"]})
    run_stream_driver(env, conf, ["--base", f"{bucket}/job", "--input", str(tmp_path / "input"),
                                  "--checkpoint", str(tmp_path / "spark-checkpoint"), "--parallelism", "2",
                                  # room for a loaded machine behind a proxy (as test_faults_store.py)
                                  "--option", "upload.timeout=10s"],
                      progress)
    starts = {e["batch"]: e["t"] for e in read_progress(progress) if e["phase"] == "start"}
    assert sorted(starts) == list(range(BATCHES)), starts
    # from the measured batch's start to the next one's: work deferred past the batch counts too
    lo, hi = starts[MEASURED], starts[MEASURED + 1]
    mine = {who: [request_kind(m, p) for t, m, p in proxy.requests() if lo <= t < hi]
            for who, proxy in (("driver", driver), ("tasks", tasks))}
    assert mine["tasks"], "the tasks' requests did not reach their own proxy"
    lines = []
    for who, kinds in mine.items():
        lines.append(f"{who}: {len(kinds)}")
        lines += [f"  {n:3d} {k}" for k, n in sorted(collections.Counter(kinds).items())]
    breakdown = "\n".join(lines)
    sys.stderr.write(f"\nrequests of steady-state batch {MEASURED} (P=2, {EVENTS} events):\n{breakdown}\n")
    assert len(mine["driver"]) <= DRIVER_BUDGET, breakdown
    assert len(mine["driver"]) + len(mine["tasks"]) <= TOTAL_BUDGET, breakdown
