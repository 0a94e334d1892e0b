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
# hsperfdata_<user> goes to /tmp whatever java.io.tmpdir says; the suite does not need it
_JAVA_TMP = f"-Djava.io.tmpdir={SESSION_TMP} -XX:-UsePerfData"
os.environ["JAVA_TOOL_OPTIONS"] = f"{os.environ.get('JAVA_TOOL_OPTIONS', '')} {_JAVA_TMP}".strip()


def pytest_unconfigure(config):
    shutil.rmtree(SESSION_TMP, ignore_errors=True)

# Golden files written by Apache Flink 2.3's DSTL (see fixtures/flink/README.md).
FIXTURES = os.path.join(os.path.dirname(os.path.abspath(__file__)), "fixtures", "flink")


def expected_implementation() -> str:
    """What `make test` asked for: the twins under DSTL_PUREPYTHON=1, else the Cython extension."""
    return "python" if os.environ.get("DSTL_PUREPYTHON", "") not in ("", "0") else "cython"


# A heavy scenario (Spark end to end, or a benchmark harness: figures come from the Cython build) runs
# once, under the Cython build, when a lighter test covers the same logic under the twins
# (docs/contributing.md, "Tests"): `make test` stays within CI's time.
heavy = pytest.mark.skipif(expected_implementation() == "python", reason="heavy: runs once, under the Cython build")


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
