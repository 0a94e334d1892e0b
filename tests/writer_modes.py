"""Shared fixtures for storage/writer tests, parametrised over the upload mode.

To run every writer-semantics test in another mode, add it to UPLOAD_MODES (helper Q: "process").
Test modules use them with `from writer_modes import upload_mode, make_storage  # noqa: F401`.
"""
from __future__ import annotations

import os
import time
import uuid
from typing import Callable, List

import pytest

from conftest import heavy_twins

UPLOAD_MODES: List[str] = ["direct", "thread", "process"]
# process mode starts an upload service per test (about a second each): its runs are in the full tier,
# under both builds; the fast tier keeps direct and thread mode
_PARAMS = [pytest.param(m, marks=heavy_twins) if m == "process" else m for m in UPLOAD_MODES]

RESULT_TIMEOUT = 20  # seconds any persist future may take in a test before it counts as hung


@pytest.fixture(params=_PARAMS)
def upload_mode(request) -> str:
    return request.param


@pytest.fixture
def make_storage(tmp_path, upload_mode):
    """`make_storage(**options)` -> an open storage under tmp_path in the current mode; closed afterwards.

    Options use `open_storage` spelling (`batch_persist_delay="1 ms"`); `job_id` and
    `local_recovery_dir` pass through; `base_path` overrides the default directory.
    """
    from dstl.changelog.storage import open_storage

    made = []

    def make(**options):
        base = options.pop("base_path", str(tmp_path / f"cl-{len(made)}"))
        options.setdefault("upload_mode", upload_mode)
        options.setdefault("job_id", uuid.uuid4().hex)
        storage = open_storage(base, **options)
        made.append(storage)
        return storage

    yield make
    for s in made:
        s.close()
    if upload_mode == "process":  # stop the services these storages started, by PID (helper Q)
        from service_util import stop_services

        stop_services(made)


def files_of(storage) -> List[str]:
    """The changelog files currently in the storage's job directory (local base paths only)."""
    d = os.path.join(storage.config.base_path, storage.job_id, "dstl")
    return sorted(os.listdir(d)) if os.path.isdir(d) else []


def wait_until(cond: Callable[[], bool], timeout: float = 10.0, what: str = "condition") -> None:
    """Poll `cond` until true; fail the test after `timeout` seconds."""
    deadline = time.monotonic() + timeout
    while not cond():
        if time.monotonic() > deadline:
            pytest.fail(f"timed out after {timeout} s waiting for {what}")
        time.sleep(0.005)


def read_all(storage, handle) -> list:
    """Every change of `handle`, read through the storage's reader, as (key_group, data) tuples."""
    reader = storage.create_reader()
    it = reader.get_changes(handle)
    try:
        return [(c.key_group, bytes(c.data)) for c in it]
    finally:
        close = getattr(it, "close", None)
        if close is not None:
            close()
