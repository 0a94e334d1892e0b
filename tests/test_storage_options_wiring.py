"""Issue 3: the thread-count and buffer options reach the parts that use them (not only parsed).

`dstl.dfs.upload.num-threads` bounds the uploads running at once (checked with hanging uploads on the
fault-injecting filesystem); `dstl.dfs.discard.num-threads` sizes the registry's deletion pool;
`dstl.dfs.upload.buffer-size` reaches the uploader."""
from __future__ import annotations

import threading
import time
import uuid

from dstl.changelog.storage import FsStateChangelogStorage
from dstl.types import KeyGroupRange
from faultyfs import FAULTS, faulty, faulty_url  # noqa: F401
from writer_modes import read_all, wait_until

T = 20


def test_upload_and_discard_thread_counts_and_buffer_size(tmp_path, faulty):
    cfg = {"dstl.dfs.base-path": faulty_url(tmp_path), "dstl.dfs.upload.mode": "thread",
           "dstl.dfs.upload.num-threads": "2", "dstl.dfs.discard.num-threads": "3",
           "state.changelog.dstl.dfs.upload.buffer-size": "8kb",
           "dstl.dfs.batch.persist-delay": "0 ms", "dstl.dfs.upload.timeout": "0 ms"}
    s = FsStateChangelogStorage(cfg, job_id=uuid.uuid4().hex)
    try:
        assert s.uploader.buffer_size == 8 << 10
        assert s.registry._discarder._pool._max_workers == 3
        FAULTS.hang(15.0)
        FAULTS.hang(15.0)  # the first two uploads block in open until released
        writers, futures = [], []
        for i in range(3):
            w = s.create_writer(f"op{i}", KeyGroupRange(0, 3))
            w.append(i, b"%d" % i * 10)
            writers.append(w)
            futures.append(w.persist(0, 1))
        wait_until(lambda: FAULTS.write_opens == 2, T, "two uploads to start")
        time.sleep(0.3)
        assert FAULTS.write_opens == 2, "a third upload ran beside two busy upload threads"
        assert not any(f.done() for f in futures)
        assert len([t for t in threading.enumerate() if t.name.startswith("dstl-upload")]) == 2
        FAULTS.release_hangs()
        handles = [f.result(T).job_manager_owned_snapshot for f in futures]
        assert FAULTS.write_opens == 3
        for i, h in enumerate(handles):
            assert read_all(s, h) == [(i, b"%d" % i * 10)]
    finally:
        FAULTS.release_hangs()
        s.close()
