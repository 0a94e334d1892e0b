"""Shared fixtures: the implementation in use, moto's S3 server on 127.0.0.1, one SparkSession."""
from __future__ import annotations

import os
import shutil
import socket
import sys
import tempfile

import pytest

os.environ.setdefault("SPARK_LOCAL_IP", "127.0.0.1")
os.environ.setdefault("AWS_DEFAULT_REGION", "us-east-1")

# The suite's temporary files, and those of every process and JVM it starts, go below one directory
# that the session removes at its end: a test that SIGKILLs a JVM leaves Spark's spark-*/blockmgr-*
# directories and lz4-java's extracted library behind, and pytest keeps its own basetemps.
# dstl's own clean-up is tested where it happens (test_leftovers.py), not hidden by this.
SESSION_TMP = tempfile.mkdtemp(prefix="dstl-tests-")
os.environ["TMPDIR"] = SESSION_TMP
tempfile.tempdir = None  # re-read TMPDIR
# hsperfdata_<user> goes to /tmp whatever java.io.tmpdir says; the suite does not need it.
# Every JVM of the suite (the session's, each driver's, the clusters', the doc examples') is short-lived
# and works on small data: the C1 compiler alone (no C2 compiler threads competing for the 2 cores)
# halves a Spark driver's run on a loaded 2-core machine (a doc example: 88-97 s -> 42-46 s).
# DSTL_TEST_JAVA_OPTS replaces it (e.g. DSTL_TEST_JAVA_OPTS= for the JVM's default tiers).
_JAVA_JIT = os.environ.get("DSTL_TEST_JAVA_OPTS", "-XX:TieredStopAtLevel=1")
_JAVA_TMP = f"-Djava.io.tmpdir={SESSION_TMP} -XX:-UsePerfData {_JAVA_JIT}".strip()
os.environ["JAVA_TOOL_OPTIONS"] = f"{os.environ.get('JAVA_TOOL_OPTIONS', '')} {_JAVA_TMP}".strip()


def pytest_unconfigure(config):
    shutil.rmtree(SESSION_TMP, ignore_errors=True)

# Golden files written by Apache Flink 2.3's DSTL (see fixtures/flink/README.md).
FIXTURES = os.path.join(os.path.dirname(os.path.abspath(__file__)), "fixtures", "flink")


def expected_implementation() -> str:
    """What `make test` asked for: the twins under DSTL_PUREPYTHON=1, else the Cython extension."""
    return "python" if os.environ.get("DSTL_PUREPYTHON", "") not in ("", "0") else "cython"


# Two tiers (docs/contributing.md, "Tests"): `pytest -m "not heavy"` is the fast tier (`make test`, under
# both implementations), `make test-all` runs every test. A `heavy` test runs in the full tier only,
# and there once, under the Cython build: Spark end to end, the clusters, real service processes, the
# benchmark harnesses (scenarios whose logic a lighter test covers under the twins). `heavy_twins`
# marks a heavy test the twins' run keeps too (a front door end to end, a model of each build).
heavy = pytest.mark.heavy
heavy_twins = pytest.mark.heavy(twins=True)


# The Spark runs the fast tier keeps on purpose: one end-to-end StatefulStream and one `dstl pipeline`,
# under the Cython build only (the twins' Spark runs are in the full tier). Every other test that
# starts Spark is heavy (tests/test_tiers.py checks).
FAST_SPARK = (
    "tests/test_live_rescale.py::test_live_rescale_2_3_1_exact_output",
    "tests/test_live_rescale.py::test_rescale_bounds_checked_before_anything_changes",
    "tests/test_stream.py::test_vectorised_function_and_initial_state",
    "tests/test_spark_pipeline.py::test_cli_report_json_and_verify_catches_lost_output",
    "tests/test_spark_routing.py::test_local_mode_shuffles_big_batches_and_keeps_every_subtask_warm",
    "tests/test_progress.py::test_a_streams_progress_from_the_stream_its_listener_the_checkpoint_and_state_ls",
    "tests/test_batch_errors.py::test_a_failed_batch_leads_with_its_cause",
    "tests/test_timer_rounds.py::test_processing_time_timer_fires_on_an_idle_stream",
)
# tests that use the `spark` fixture, are not heavy and not in FAST_SPARK (filled at collection)
UNMARKED_SPARK: list = []
COLLECTED_SPARK: list = []


@pytest.hookimpl(tryfirst=True)  # before `-m` deselects: the check sees every collected test
def pytest_collection_modifyitems(config, items):
    for item in items:
        if "spark" in getattr(item, "fixturenames", ()):
            COLLECTED_SPARK.append(item.nodeid)
            if item.get_closest_marker("heavy") is None and item.nodeid.split("[")[0] not in FAST_SPARK:
                UNMARKED_SPARK.append(item.nodeid)
    if expected_implementation() != "python":
        return
    once = pytest.mark.skip(reason="heavy: runs once, under the Cython build")
    fast_spark = pytest.mark.skip(reason="the fast tier's Spark run: once, under the Cython build")
    for item in items:
        marks = list(item.iter_markers("heavy"))
        if marks and not any(m.kwargs.get("twins") for m in marks):
            item.add_marker(once)
        elif item.nodeid.split("[")[0] in FAST_SPARK:
            item.add_marker(fast_spark)


def pytest_report_header(config):
    import dstl

    return f"dstl implementation: {dstl.IMPLEMENTATION} (expected {expected_implementation()})"


@pytest.fixture(scope="session")
def flink_fixtures() -> str:
    if not os.path.isdir(FIXTURES):
        pytest.fail(f"Flink fixtures not found at {FIXTURES}")
    return FIXTURES


def _free_port() -> int:
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return s.getsockname()[1]


@pytest.fixture(scope="session")
def s3_server():
    """moto's S3 server on 127.0.0.1 (as s3fs's own suite does); yields its endpoint URL.

    The endpoint and fake credentials go into the environment, so s3fs in this process, in
    subprocesses and in Spark's Python workers all reach it with plain `s3://bucket/...` URLs.
    """
    from moto.server import ThreadedMotoServer

    port = _free_port()
    server = ThreadedMotoServer(ip_address="127.0.0.1", port=port, verbose=False)
    server.start()
    endpoint = f"http://127.0.0.1:{port}"
    saved = {k: os.environ.get(k) for k in (
        "AWS_ENDPOINT_URL", "AWS_ACCESS_KEY_ID", "AWS_SECRET_ACCESS_KEY", "AWS_DEFAULT_REGION")}
    os.environ.update({
        "AWS_ENDPOINT_URL": endpoint, "AWS_ACCESS_KEY_ID": "testing",
        "AWS_SECRET_ACCESS_KEY": "testing", "AWS_DEFAULT_REGION": "us-east-1",
    })
    import fsspec

    fsspec.config.conf.setdefault("s3", {})["client_kwargs"] = {"endpoint_url": endpoint}
    try:
        yield endpoint
    finally:
        fsspec.config.conf.get("s3", {}).pop("client_kwargs", None)
        for k, v in saved.items():
            if v is None:
                os.environ.pop(k, None)
            else:
                os.environ[k] = v
        server.stop()


@pytest.fixture
def s3_bucket(s3_server, request):
    """A fresh bucket on the moto server; yields `s3://<bucket>`."""
    import uuid

    import s3fs

    name = f"dstl-test-{uuid.uuid4().hex[:12]}"
    fs = s3fs.S3FileSystem(client_kwargs={"endpoint_url": s3_server}, skip_instance_cache=True)
    fs.mkdir(name)
    yield f"s3://{name}"
    try:
        fs.rm(name, recursive=True)
    except FileNotFoundError:
        pass


@pytest.fixture(scope="session")
def spark():
    """One local SparkSession for the whole suite (JVM start-up is the expensive part)."""
    os.environ["PYSPARK_PYTHON"] = sys.executable
    os.environ["PYSPARK_DRIVER_PYTHON"] = sys.executable
    from pyspark.sql import SparkSession

    session = (
        # local[N,F]: in local mode only the master string allows task retries (spark.task.maxFailures
        # is ignored there); the pipeline's --fail-at test needs Spark to retry a crashed task
        SparkSession.builder.master("local[2,4]")
        .appName("dstl-tests")
        .config("spark.driver.host", "127.0.0.1")
        .config("spark.driver.bindAddress", "127.0.0.1")
        .config("spark.ui.enabled", "false")
        .config("spark.sql.shuffle.partitions", "4")
        .config("spark.sql.execution.arrow.pyspark.enabled", "true")
        .config("spark.task.maxFailures", "4")
        .getOrCreate()
    )
    try:
        yield session
    finally:
        session.stop()


@pytest.fixture(scope="session", autouse=True)
def _dstl_upload_services():
    """Upload services started during the session (process mode is the default) live in a private
    runtime directory and are stopped by PID at session end (tests/service_util.py)."""
    from service_util import session_runtime

    with session_runtime():
        yield
    from dstl.changelog.reader import sweep_download_caches

    sweep_download_caches()  # caches of Python workers Spark killed (no later process would sweep them)
