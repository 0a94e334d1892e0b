"""The two places that hold file-system and checkpoint knowledge: dstl.changelog.fs (URLs to file
systems and keys, base-path validation) and dstl.changelog.checkpoints (files referenced by complete
checkpoints, relative paths resolved against the base path); and the layer rule of upload/."""
from __future__ import annotations

import os
import re
import uuid

import pytest

from dstl.types import KeyGroupRange

KGR = KeyGroupRange(0, 127)
ROOT = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))


def _checkpoint(base, cid, files, job=None):
    """Write checkpoint `cid` whose one subtask's changelog handle reads `files`."""
    from dstl.changelog.handles import ChangelogStateHandleStreamImpl, StreamStateHandle
    from dstl.state.metadata import CheckpointMetadata, SubtaskState, write_checkpoint

    handle = ChangelogStateHandleStreamImpl([(StreamStateHandle(f, 10), 0) for f in files], KGR, 10)
    write_checkpoint(str(base), CheckpointMetadata(cid, 128, 1, [SubtaskState(0, KGR, changelog=[handle])],
                                                   job_id=job))


def test_files_referenced_all_latest_and_relative_paths(tmp_path):
    from dstl.changelog.checkpoints import files_referenced
    from dstl.changelog.fs import key_of_url

    base = tmp_path / "base"
    a, b = str(base / "job" / "dstl" / "a"), str(base / "job" / "dstl" / "b")
    _checkpoint(base, 1, [a])
    _checkpoint(base, 2, [b, "job/dstl/c"])  # a relative path: below the base path
    assert files_referenced(str(base)) == {key_of_url(a), key_of_url(b), key_of_url(str(base / "job/dstl/c"))}
    assert files_referenced(str(base), latest=1) == {key_of_url(b), key_of_url(str(base / "job/dstl/c"))}
    assert files_referenced(str(tmp_path / "nothing-here")) == set()


def test_files_referenced_refuses_unreadable_metadata(tmp_path):
    from dstl.changelog.checkpoints import UnreadableCheckpointError, files_referenced, metadata_path

    base = tmp_path / "base"
    _checkpoint(base, 1, [str(base / "x")])
    with open(metadata_path(str(base), 1), "r+b") as f:
        f.seek(12)
        f.write(b"\xff\xff")
    with pytest.raises(UnreadableCheckpointError):
        files_referenced(str(base))


def test_keys_compare_spellings_of_one_local_file(tmp_path):
    from dstl.changelog.fs import key_of_url

    p = tmp_path / "f"
    assert key_of_url(str(p)) == key_of_url("file://" + str(p)) == key_of_url(str(tmp_path / "." / "f"))
    assert key_of_url("memory://bucket/x").startswith("memory://") and key_of_url("memory://bucket/x").endswith("/bucket/x")


def test_validate_base_path(tmp_path):
    from dstl.changelog.fs import validate_base_path

    validate_base_path(str(tmp_path))  # a directory
    validate_base_path(str(tmp_path / "not-yet"))  # made at the first upload
    validate_base_path("memory://somewhere")
    f = tmp_path / "file"
    f.write_bytes(b"")
    with pytest.raises(ValueError, match="not a directory"):
        validate_base_path(str(f))
    with pytest.raises(ValueError, match="unknown file system protocol 'zzz'"):
        validate_base_path("zzz://x")


def test_no_module_under_upload_imports_tools_or_state():
    upload = os.path.join(ROOT, "dstl", "changelog", "upload")
    bad = []
    for dirpath, _, files in os.walk(upload):
        for name in files:
            if name.endswith(".py"):
                path = os.path.join(dirpath, name)
                with open(path, encoding="utf-8") as f:
                    text = f.read()
                if re.search(r"^\s*(from|import)\s+dstl\.(tools|state)\b", text, re.M):
                    bad.append(os.path.relpath(path, ROOT))
    assert bad == []


def test_the_gc_tool_and_the_coordinator_use_the_one_function(tmp_path):
    """`dstl gc --keep-latest` and CheckpointCoordinator.referenced_files agree with files_referenced."""
    from dstl.changelog.checkpoints import files_referenced
    from dstl.tools.gc import load_retained

    base = tmp_path / "base"
    job = uuid.uuid4().hex
    f1 = str(base / job / "dstl" / str(uuid.uuid4()))
    _checkpoint(base, 3, [f1], job=job)
    assert load_retained([], 1, str(base)) == files_referenced(str(base), latest=1)
    manifest = os.path.join(str(base), "checkpoints", "chk-3", "_metadata")
    assert load_retained([manifest], None, str(base)) == files_referenced(str(base))
