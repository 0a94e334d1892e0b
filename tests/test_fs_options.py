"""fsspec options in storage options (`dstl.dfs.fs.<name>`): they reach every process that touches
the base path (driver, task, upload service, its uploaders) and are never written anywhere; the
driver's probe fails at once, in one line, when the store cannot be reached."""
from __future__ import annotations

import json
import os
import stat
import subprocess
import sys
import uuid

import pytest

from dstl.config import StorageConfig
from dstl.changelog import fs as dfs
from service_util import runtime  # noqa: F401 - fixture

HERE = os.path.dirname(os.path.abspath(__file__))


def test_fs_options_parse_and_never_show():
    secret = "sentinel-" + uuid.uuid4().hex
    a = StorageConfig.from_mapping({"dstl.dfs.base-path": "memory://fsopt-a/base", "dstl.dfs.fs.key": "K",
                                    "state.changelog.dstl.dfs.fs.secret": secret})
    b = StorageConfig.from_options("memory://fsopt-a/base", fs_options={"key": "K", "secret": secret})
    assert a == b and a.fs_options == {"key": "K", "secret": secret}
    assert secret not in repr(a) and secret not in str(a)
    assert a.to_mapping()["dstl.dfs.fs.secret"] == secret  # what travels to the executors, in memory
    assert not any(k.startswith("dstl.dfs.fs.") for k in a.to_mapping(as_strings=True, with_fs_options=False))
    assert StorageConfig.from_mapping(a.to_mapping()) == a
    assert dfs.options_for("memory://fsopt-a/base/checkpoints/chk-1/_metadata")["secret"] == secret
    assert dfs.options_for("memory://fsopt-a/other") == {"key": "K", "secret": secret}  # same bucket
    assert dfs.options_for("memory://fsopt-b/base") == {}
    with pytest.raises(ValueError, match="fs_options must be a mapping"):
        StorageConfig.from_options("memory://x", fs_options=["key"])
    with pytest.raises(ValueError, match=r"fsspec options are dstl\.dfs\.fs\.<name>"):
        StorageConfig.from_mapping({"dstl.dfs.base-path": "/tmp/x", "dstl.dfs.endpoint_url": "http://h"})


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


def test_driver_probe_names_url_and_where_credentials_were_looked_for(s3_server, s3_bucket, tmp_path):
    base = f"{s3_bucket}/job"
    r = _race(base, tmp_path, _clean_env(AWS_ENDPOINT_URL=s3_server))
    assert r.returncode == 4, r.stderr[-2000:]
    line = r.stdout.strip()
    assert line.startswith(f"UNREACHABLE cannot reach {base}: no credentials found; looked in the storage "
                           "options (fs.key/fs.secret")
    assert "AWS_ACCESS_KEY_ID" in line and "instance" in line and "\n" not in line
    r = _race("s3://no-such-bucket-dstl/job", tmp_path, _clean_env(
        RACE_FS_OPTIONS=json.dumps({"key": "k", "secret": "s", "client_kwargs": {"endpoint_url": s3_server}})))
    assert r.returncode == 4 and "cannot reach s3://no-such-bucket-dstl/job: the bucket" in r.stdout


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
