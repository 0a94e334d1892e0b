"""Issue 3: `storage.create_reader().get_changes(handle)` on a remote filesystem serves a second read
from the storage's local download cache, which expires after `dstl.dfs.download.local-cache.idle-timeout-ms`.

Remote = the fault-injecting `faulty://` filesystem (not local, not memory), which counts real opens."""
from __future__ import annotations

import time
import uuid

from dstl.changelog.storage import FsStateChangelogStorage
from dstl.types import KeyGroupRange
from faultyfs import FAULTS, faulty, faulty_url  # noqa: F401

T = 20


def _wait_until(cond, timeout=10.0) -> bool:
    deadline = time.monotonic() + timeout
    while time.monotonic() < deadline:
        if cond():
            return True
        time.sleep(0.01)
    return False


def test_storage_reader_uses_a_shared_cache_with_the_configured_idle_timeout(tmp_path, faulty):
    cfg = {"dstl.dfs.base-path": faulty_url(tmp_path), "dstl.dfs.upload.mode": "direct",
           "state.changelog.dstl.dfs.download.local-cache.idle-timeout-ms": "300"}
    with FsStateChangelogStorage(cfg, job_id=uuid.uuid4().hex) as s:
        w = s.create_writer("op", KeyGroupRange(0, 7))
        w.append_meta(b"meta")
        for kg in (5, 1, 5):
            w.append(kg, bytes([kg]) * 40)
        handle = w.persist(w.initial_sequence_number(), 1).result(T).job_manager_owned_snapshot
        want = [(-1, b"meta"), (1, b"\x01" * 40), (5, b"\x05" * 40), (5, b"\x05" * 40)]

        opens = FAULTS.read_opens
        first = s.create_reader()
        assert [(c.key_group, c.data) for c in first.get_changes(handle)] == want
        assert FAULTS.read_opens == opens + 1  # downloaded once
        # a second call, and a second reader of the same storage: served from the local copy
        assert [(c.key_group, c.data) for c in first.get_changes(handle)] == want
        assert [(c.key_group, c.data) for c in s.create_reader().get_changes(handle)] == want
        part = handle.get_intersection(KeyGroupRange(5, 7))
        assert [(c.key_group, c.data) for c in s.create_reader().get_changes(part)] == [want[0]] + want[2:]
        assert FAULTS.read_opens == opens + 1

        # idle for longer than the configured timeout: the copy is dropped, the next read downloads again
        cache = s._cache
        assert cache is not None and len(cache.cached_paths()) == 1
        assert _wait_until(lambda: not cache.cached_paths()), "the cached copy never expired"
        assert [(c.key_group, c.data) for c in first.get_changes(handle)] == want
        assert FAULTS.read_opens == opens + 2
