"""8 writer processes x 200,000 changes through one upload service: exactly once, in order, batched."""
from __future__ import annotations

import json
import os
import uuid

import pytest

from conftest import heavy
from service_util import Runtime, python_child

from dstl.changelog.handles import ChangelogStateHandleStreamImpl
from dstl.types import KeyGroupRange

pytestmark = heavy  # real service processes and signals; the service's code is the same under both builds

WRITERS = 8
CHANGES = 200_000
PERSIST_EVERY = 10_000

_WRITER = r"""
import json, sys
import numpy as np
from dstl.changelog.storage import open_storage
from dstl.types import KeyGroupRange
base, job, idx, n, every, out = sys.argv[1], sys.argv[2], int(sys.argv[3]), int(sys.argv[4]), int(sys.argv[5]), sys.argv[6]
s = open_storage(base, upload_mode="process", job_id=job)
w = s.create_writer(f"op{idx}", KeyGroupRange(0, 127))
futures = []
for start in range(0, n, every):
    rows = range(start, min(n, start + every))
    data = b"".join(b"%02d:%08d" % (idx, i) for i in rows)
    kgs = np.array([i % 128 for i in rows], dtype=np.int32)
    offsets = np.arange(0, len(rows) + 1, dtype=np.int64) * 11
    first = w.next_sequence_number()
    w.append_many(kgs, data, offsets)
    futures.append(w.persist(first, start // every + 1))
handles = [f.result(120).job_manager_owned_snapshot.to_bytes().hex() for f in futures]
with open(out, "w") as f:
    json.dump({"service": s.scheduler.service_pid, "handles": handles, "persists": len(futures)}, f)
w.close()
s.close()
"""


@pytest.mark.slow
def test_eight_processes_every_change_exactly_once_in_order_and_batched(tmp_path):
    rt = Runtime(linger_ms=300)
    procs = []
    try:
        base = tmp_path / "base"
        job = uuid.uuid4().hex
        outs = [tmp_path / f"out{i}.json" for i in range(WRITERS)]
        procs = [python_child(_WRITER, str(base), job, str(i), str(CHANGES), str(PERSIST_EVERY), str(outs[i]))
                 for i in range(WRITERS)]
        for p in procs:
            _, err = p.communicate(timeout=400)
            assert p.returncode == 0, err
        results = [json.loads(o.read_text()) for o in outs]
        for r in results:
            rt.remember(r["service"])
        assert len({r["service"] for r in results}) == 1, "every writer process must use one service"
        from dstl.changelog.storage import open_storage

        flushes = sum(r["persists"] for r in results)
        files = os.listdir(base / job / "dstl")
        assert 0 < len(files) <= flushes
        with open_storage(str(base), upload_mode="direct", job_id=job) as reader_storage:
            reader = reader_storage.create_reader()
            for idx, r in enumerate(results):
                got = []
                for hx in r["handles"]:
                    h = ChangelogStateHandleStreamImpl.from_bytes(bytes.fromhex(hx))
                    assert h.key_group_range == KeyGroupRange(0, 127)
                    it = reader.get_changes(h)
                    got += [bytes(c.data) for c in it]
                    it.close()
                # a change set is stored by key group, so compare per persist range, order within a group
                expected = []
                for start in range(0, CHANGES, PERSIST_EVERY):
                    rows = range(start, min(CHANGES, start + PERSIST_EVERY))
                    expected += sorted((b"%02d:%08d" % (idx, i) for i in rows), key=lambda b: int(b[3:]) % 128)
                assert len(got) == CHANGES
                assert got == expected
    finally:
        for p in procs:
            if p.poll() is None:
                p.kill()
        rt.cleanup()
