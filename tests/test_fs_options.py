"""The file system's keyword arguments (`storage_options=`, as pandas and fsspec take them) and
dstl's own options (`options=`): a name in the wrong one says where it goes; the keyword arguments
reach every process that touches the base path (driver, Spark workers, upload service, its
uploaders) and are never written anywhere; the driver's probe fails at once, in one line, when the
store cannot be reached."""
from __future__ import annotations

import json
import os
import stat
import subprocess
import sys
import uuid

import pytest

from dstl.config import StorageConfig, storage_config
from dstl.changelog import fs as dfs
from conftest import heavy
from service_util import runtime  # noqa: F401 - fixture

HERE = os.path.dirname(os.path.abspath(__file__))


def test_fs_options_parse_and_never_show():
    secret = "sentinel-" + uuid.uuid4().hex
    a = StorageConfig.from_mapping({"dstl.dfs.base-path": "memory://fsopt-a/base", "dstl.dfs.fs.key": "K",
                                    "state.changelog.dstl.dfs.fs.secret": secret})
    b = StorageConfig.from_options("memory://fsopt-a/base", storage_options={"key": "K", "secret": secret})
    c = storage_config("memory://fsopt-a/base", {"upload.mode": "process"}, {"key": "K", "secret": secret})
    assert a == b == c and a.fs_options == {"key": "K", "secret": secret}
    assert secret not in repr(a) and secret not in str(a)
    assert a.to_mapping()["dstl.dfs.fs.secret"] == secret  # what travels to the executors, in memory
    assert not any(k.startswith("dstl.dfs.fs.") for k in a.to_mapping(as_strings=True, with_fs_options=False))
    assert StorageConfig.from_mapping(a.to_mapping()) == a
    assert dfs.options_for("memory://fsopt-a/base/checkpoints/chk-1/_metadata")["secret"] == secret
    assert dfs.options_for("memory://fsopt-a/other") == {"key": "K", "secret": secret}  # same bucket
    assert dfs.options_for("memory://fsopt-b/base") == {}
    with pytest.raises(ValueError, match="storage_options must be a mapping"):
        StorageConfig.from_options("memory://x", storage_options=["key"])
    with pytest.raises(ValueError, match=r"^fs_options= is now storage_options="):
        StorageConfig.from_options("memory://x", fs_options={"key": "K"})
    with pytest.raises(ValueError, match=r"the file system's keyword arguments go in storage_options="):
        StorageConfig.from_mapping({"dstl.dfs.base-path": "/tmp/x", "dstl.dfs.endpoint_url": "http://h"})


def test_an_unpickled_config_registers_its_file_system_arguments():
    """A StatefulStream pickled to a Spark Connect foreachBatch worker carries its StorageConfig:
    unpickling it registers the arguments in that process, before the job's first file system."""
    import pickle

    from dstl import config as C

    base = "memory://fsopt-pickle/" + uuid.uuid4().hex
    blob = pickle.dumps(storage_config(base, None, {"key": "K", "secret": "S"}))
    with C._OPTIONS_LOCK:
        for p in [p for p in C._OPTIONS if p.startswith("memory://fsopt-pickle")]:
            del C._OPTIONS[p]
    assert dfs.options_for(base) == {}
    again = pickle.loads(blob)
    assert again.fs_options == {"key": "K", "secret": "S"} and dfs.options_for(base + "/x")["secret"] == "S"


# (storage_options, options, the one-line error: where the name goes now)
MISPLACED = [
    ({"dstl.dfs.upload.mode": "thread"}, None,
     "storage_options: 'dstl.dfs.upload.mode' is a dstl option (dstl.dfs.upload.mode): pass it in "
     "options={'dstl.dfs.upload.mode': ...}"),
    ({"upload.timeout": "2 s"}, None, "'upload.timeout' is a dstl option (dstl.dfs.upload.timeout): pass it in "
                                      "options={'upload.timeout': ...}"),
    ({"upload_mode": "thread"}, None, "'upload_mode' is a dstl option (dstl.dfs.upload.mode)"),
    ({"max_attempts": 3}, None, "'max_attempts' is a dstl option (dstl.dfs.upload.max-attempts)"),
    ({"state.changelog.dstl.dfs.compression.enabled": True}, None, "is a dstl option (dstl.dfs.compression.enabled)"),
    ({"fs.key": "K"}, None, "storage_options: 'fs.key' is the old spelling of the file system's keyword "
                            "argument 'key': pass storage_options={'key': ...}"),
    ({"dstl.dfs.fs.client_kwargs": {}}, None, "pass storage_options={'client_kwargs': ...}"),
    ({"dstl.dfs.nonsense": 1}, None, "looks like a dstl option key, and no dstl option has that name"),
    ({"upload.nonsense": 1}, None, "'upload.nonsense' is not a keyword argument name"),
    (None, {"fs.secret": "S"}, "options: 'fs.secret' is a keyword argument of the file system: pass it as "
                               "storage_options={'secret': ...}"),
    (None, {"dstl.dfs.fs.endpoint_url": "http://h"}, "pass it as storage_options={'endpoint_url': ...}"),
    (None, {"key": "K"}, "options: unknown dstl option 'key'"),
    (None, {"upload.mode": "thread", "upload_mode": "direct"}, "given twice with different values"),
    (None, {"upload.timeout": "1.5s"}, "options: invalid value '1.5s' for option 'dstl.dfs.upload.timeout'"),
]


@pytest.mark.parametrize("storage_options, options, message", MISPLACED)
def test_a_name_in_the_wrong_place_says_where_it_goes(storage_options, options, message):
    """StatefulStream, CheckpointCoordinator, open_storage and the readers share these checks: every
    misplaced name is refused in one line before anything is opened, and no value is echoed."""
    from dstl.changelog.storage import open_storage
    from dstl.spark import StatefulStream
    from dstl.spark.coordinator import CheckpointCoordinator, JobSpec
    from dstl.state.reader import read_state_pandas

    secret_value = "VALUE-" + uuid.uuid4().hex
    so = {k: secret_value for k in storage_options} if storage_options else storage_options
    attempts = [
        lambda: storage_config("/tmp/never", options, so),
        lambda: open_storage("memory://never/x", storage_options=so, options=options),
        lambda: StatefulStream("memory://never/x", lambda rows, state: rows, "k long", key="k", parallelism=1,
                               storage_options=so, options=options),
    ]
    attempts.append(lambda: CheckpointCoordinator.open("memory://never/x", JobSpec.new("op", 8), options,
                                                       storage_options=so, resume=False))
    if options is None:  # the readers take no dstl option that matters; check the file system side
        attempts.append(lambda: read_state_pandas("memory://never/x", storage_options=so))
    for attempt in attempts:
        with pytest.raises(ValueError) as info:
            attempt()
        text = str(info.value)
        assert message in text and "\n" not in text and secret_value not in text, text


def test_open_storage_takes_options_and_file_system_arguments(tmp_path):
    from dstl.changelog.storage import open_storage

    base = "memory://fsopt-open/" + uuid.uuid4().hex
    with open_storage(base, options={"upload.mode": "direct"}, batch_persist_delay="0 ms",
                      storage_options={"skip_instance_cache": True}) as storage:
        assert storage.config.upload_mode == "direct" and storage.config.persist_delay_ms == 0
        assert storage.config.fs_options == {"skip_instance_cache": True}
    assert dfs.options_for(base + "/dstl/x") == {"skip_instance_cache": True}
    with pytest.raises(ValueError, match="given both in options= and as a keyword"):
        open_storage(str(tmp_path), options={"upload_mode": "direct"}, upload_mode="thread")


def test_pipeline_flags_split_dstl_options_from_file_system_arguments(tmp_path):
    """`dstl pipeline --option K=V --fs-option NAME=V`: a dotted name fills a nested dict, a JSON
    value is that value, anything else a string; both land where the API puts them."""
    import argparse

    from dstl.app import pipeline

    p = argparse.ArgumentParser()
    pipeline.add_arguments(p)
    base = "memory://fsopt-cli/" + uuid.uuid4().hex
    args = p.parse_args(["--base-path", base, "--option", "upload.mode=thread", "--option",
                         "dstl.dfs.upload.timeout=2s", "--fs-option", "key=12AB", "--fs-option", "secret=\"12345\"",
                         "--fs-option", "client_kwargs.endpoint_url=http://127.0.0.1:1",
                         "--fs-option", "client_kwargs.region_name=eu-1", "--fs-option", "use_ssl=false",
                         "--fs-option", "config_kwargs={\"retries\": {\"max_attempts\": 2}}"])
    opts = pipeline.check_options(args)
    config = opts.storage
    assert config.upload_mode == "thread" and config.upload_timeout_ms == 2000 and config.base_path == base
    assert config.fs_options == {"key": "12AB", "secret": "12345", "use_ssl": False,
                                 "client_kwargs": {"endpoint_url": "http://127.0.0.1:1", "region_name": "eu-1"},
                                 "config_kwargs": {"retries": {"max_attempts": 2}}}
    assert dfs.options_for(base + "/checkpoints")["secret"] == "12345"


def _clean_env(**extra):
    """This process's environment without any AWS credentials or endpoint (and no instance role
    lookup: only 127.0.0.1 is ever contacted)."""
    env = {k: v for k, v in os.environ.items() if not k.startswith("AWS_")}
    env.update(AWS_SHARED_CREDENTIALS_FILE="/nonexistent", AWS_CONFIG_FILE="/nonexistent",
               AWS_EC2_METADATA_DISABLED="true", AWS_DEFAULT_REGION="us-east-1",
               PYTHONPATH=os.pathsep.join([os.path.dirname(HERE), HERE]))
    env.update(extra)
    return env


def _race(base, tmp_path, env, batches=3):
    barrier = tmp_path / f"barrier-{uuid.uuid4().hex[:6]}"
    barrier.mkdir()
    return subprocess.run([sys.executable, os.path.join(HERE, "writer_race.py"), base, str(batches),
                           str(barrier), "solo", "1"], env=env, capture_output=True, text=True, timeout=300)


@heavy  # S3
def test_driver_probe_names_url_and_where_credentials_were_looked_for(s3_server, s3_bucket, tmp_path):
    base = f"{s3_bucket}/job"
    r = _race(base, tmp_path, _clean_env(AWS_ENDPOINT_URL=s3_server))
    assert r.returncode == 4, r.stderr[-2000:]
    line = r.stdout.strip()
    assert line.startswith(f"UNREACHABLE cannot reach {base}: no credentials found; looked in "
                           "storage_options (key/secret")
    assert "AWS_ACCESS_KEY_ID" in line and "instance" in line and "\n" not in line
    r = _race("s3://no-such-bucket-dstl/job", tmp_path, _clean_env(
        RACE_FS_OPTIONS=json.dumps({"key": "k", "secret": "s", "client_kwargs": {"endpoint_url": s3_server}})))
    assert r.returncode == 4 and "cannot reach s3://no-such-bucket-dstl/job: the bucket" in r.stdout


@heavy  # S3 and the upload service
def test_credentials_in_storage_options_are_never_at_rest(s3_server, s3_bucket, tmp_path, runtime):
    """A job whose only credentials and endpoint are fsspec options in its storage options runs with
    the upload service (process mode); the sentinel secret appears in no object under the base path,
    no file of the service's runtime directory (config.json, log, journal), and no dstl log line."""
    secret = "SENTINEL" + uuid.uuid4().hex
    key = "AKIA" + uuid.uuid4().hex[:12].upper()
    base = f"{s3_bucket}/job"
    log_file = tmp_path / "dstl.log"
    fs_options = {"key": key, "secret": secret, "client_kwargs": {"endpoint_url": s3_server}}
    env = _clean_env(RACE_FS_OPTIONS=json.dumps(fs_options), RACE_UPLOAD_MODE="process",
                     RACE_LOG=str(log_file), DSTL_RUNTIME_DIR=runtime.root, DSTL_SERVICE_LINGER_MS="60000")
    r = _race(base, tmp_path, env)
    assert r.returncode == 0 and r.stdout.strip() == "WON", (r.stdout, r.stderr[-3000:])
    assert secret not in r.stdout + r.stderr

    import s3fs

    fs = s3fs.S3FileSystem(client_kwargs={"endpoint_url": s3_server}, skip_instance_cache=True)
    objects = fs.find(base)
    assert any(o.endswith("_dstl_job.json") for o in objects) and any("/checkpoints/" in o for o in objects)
    assert any(o.endswith("_SUCCESS") for o in objects)
    for o in objects:
        assert secret.encode() not in fs.cat_file(o), o
        assert key.encode() not in fs.cat_file(o), o
    service_dirs = [d for d in os.listdir(runtime.root) if os.path.isdir(os.path.join(runtime.root, d))]
    assert service_dirs, "the job should have started an upload service"
    seen = set()
    for d in service_dirs:
        for folder, _, names in os.walk(os.path.join(runtime.root, d)):
            for n in names:
                p = os.path.join(folder, n)
                if stat.S_ISSOCK(os.lstat(p).st_mode):  # the service's and its forkserver's sockets
                    continue
                seen.add(n)
                with open(p, "rb") as f:
                    data = f.read()
                assert secret.encode() not in data and key.encode() not in data, p
    assert "config.json" in seen and "service.log" in seen
    text = log_file.read_text()
    assert text.strip(), "dstl logged nothing at DEBUG: the check would prove nothing"
    assert secret not in text and key not in text


def _assert_nowhere(needles, s3_server, base, dirs):
    """None of `needles` in any object under `base` or any file below `dirs` (sockets skipped);
    returns the object keys and the file names seen, so the caller can check the search saw them."""
    import s3fs

    fs = s3fs.S3FileSystem(client_kwargs={"endpoint_url": s3_server}, skip_instance_cache=True)
    objects = fs.find(base)
    for o in objects:
        data = fs.cat_file(o)
        assert not any(n.encode() in data for n in needles), o
    seen = set()
    for root in dirs:
        for folder, _, names in os.walk(root):
            for n in names:
                p = os.path.join(folder, n)
                if stat.S_ISSOCK(os.lstat(p).st_mode):
                    continue
                seen.add(n)
                with open(p, "rb") as f:
                    data = f.read()
                assert not any(x.encode() in data for x in needles), p
    return objects, seen


@heavy
def test_a_stream_whose_only_credentials_are_its_storage_options(s3_server, s3_bucket, tmp_path, runtime):
    """StatefulStream(storage_options={key, secret, client_kwargs: {endpoint_url}}) in a process whose
    environment has no AWS credentials and no endpoint: without the keyword arguments no process could
    reach the bucket, so the driver, the Python workers (run and read_state) and the upload service
    all got them. The secret is in no object under the base path, no Spark event log, no file of the
    upload service, no dstl log line and no repr of the objects that hold it."""
    secret = "SENTINEL" + uuid.uuid4().hex
    key = "AKIA" + uuid.uuid4().hex[:12].upper()
    base = f"{s3_bucket}/stream"
    events, log_file = tmp_path / "events", tmp_path / "dstl.log"
    events.mkdir()
    fs_options = {"key": key, "secret": secret, "client_kwargs": {"endpoint_url": s3_server}}
    env = _clean_env(FS_OPTIONS=json.dumps(fs_options), DRIVER_LOG=str(log_file), DSTL_RUNTIME_DIR=runtime.root,
                     PYSPARK_PYTHON=sys.executable, SPARK_LOCAL_IP="127.0.0.1")
    r = subprocess.run([sys.executable, os.path.join(HERE, "fs_options_driver.py"), base, str(events)],
                       env=env, capture_output=True, text=True, timeout=600)
    assert r.returncode == 0, r.stderr[-3000:]
    assert secret not in r.stdout + r.stderr and key not in r.stdout + r.stderr
    result = json.loads(r.stdout.strip().splitlines()[-1])
    assert result["output"] == [["a", 2], ["b", 1], ["c", 1], ["a", 3], ["c", 2], ["d", 1]]
    expected = [["a", "3"], ["b", "1"], ["c", "2"], ["d", "1"]]
    assert result["state"] == expected and result["spark_state"] == expected
    assert len(result["reprs"]) == 4 and "upload_timeout_ms=20000" in result["reprs"][0]
    for text in result["reprs"]:
        assert secret not in text and key not in text, text
    objects, seen = _assert_nowhere([secret, key], s3_server, base, [runtime.root, str(events)])
    assert any(o.endswith("_dstl_job.json") for o in objects) and any("/checkpoints/" in o for o in objects)
    assert any("/dstl/" in o for o in objects), "the changelog should be on the bucket"
    assert "config.json" in seen and "service.log" in seen, seen
    assert os.listdir(events), "Spark wrote no event log: the check would prove nothing"
    text = log_file.read_text()
    assert text.strip() and secret not in text and key not in text

    # the command line: `dstl state` reaches the job only through its --fs-option flags
    flags = ["--fs-option", f"key={key}", "--fs-option", f"secret={secret}",
             "--fs-option", f"client_kwargs.endpoint_url={s3_server}"]
    cli = [sys.executable, "-m", "dstl", "state", "show", base, "--state", "n", "--json"]
    r = subprocess.run(cli + flags, env=_clean_env(), capture_output=True, text=True, timeout=300)
    assert r.returncode == 0, r.stderr[-2000:]
    shown = sorted((row["key"], json.dumps(row["value"])) for row in json.loads(r.stdout))
    assert [list(x) for x in shown] == expected
    r = subprocess.run(cli, env=_clean_env(), capture_output=True, text=True, timeout=300)
    assert r.returncode == 2 and "no credentials found" in r.stderr, r.stderr[-2000:]
