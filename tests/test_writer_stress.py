"""Several writers on one storage, in threads, against a model: every persist reads back exactly the
changes from its `from` on, and at the end exactly the files of confirmed checkpoints remain
(docs/semantics.md §9: a file is deleted iff no change set in it was confirmed and every one was released)."""
from __future__ import annotations

import os
import random
import threading
import uuid

import numpy as np
import pytest

from dstl.changelog.storage import open_storage
from dstl.types import KeyGroupRange

T = 30


THRESHOLD = 2048  # pre-emptive persist threshold: the model rolls over exactly where the writer must


def _writer_loop(s, index, seed, rounds, confirmed_files, errors):
    rnd = random.Random(seed)
    kgr = KeyGroupRange(index * 32, index * 32 + 31)
    sets = {}  # sqn -> [(kg, data)] in append order
    active, start = [], 0
    sqn = 0
    cp = 0

    def model_append(changes):
        nonlocal active, sqn
        active += changes
        if sum(len(v) for _, v in active) >= THRESHOLD:  # pre-emptive persist rolls over
            sets[sqn] = active
            sqn += 1
            active = []

    try:
        w = s.create_writer(f"op{index}", kgr)
        for _ in range(rounds):
            for _ in range(rnd.randrange(1, 4)):
                if rnd.random() < 0.3:
                    n = rnd.randrange(1, 50)
                    kgs = np.array([rnd.randrange(kgr.start, kgr.end + 1) for _ in range(n)], dtype=np.int32)
                    vals = [bytes([rnd.randrange(256)]) * rnd.randrange(0, 80) for _ in range(n)]
                    offs = np.cumsum([0] + [len(v) for v in vals]).astype(np.int64)
                    w.append_many(kgs, b"".join(vals), offs)
                    model_append(list(zip(kgs.tolist(), vals)))
                else:
                    for _ in range(rnd.randrange(1, 30)):
                        if rnd.random() < 0.1:
                            v = b"meta-%d" % rnd.randrange(1000)
                            w.append_meta(v)
                            model_append([(-1, v)])
                        else:
                            kg = rnd.randrange(kgr.start, kgr.end + 1)
                            v = os.urandom(rnd.randrange(0, 120))
                            w.append(kg, v)
                            model_append([(kg, v)])
                if rnd.random() < 0.4:
                    nxt = int(w.next_sequence_number())
                    if active:
                        sets[sqn] = active
                        sqn += 1
                        active = []
                    assert nxt == sqn
            cp += 1
            h = w.persist(start, cp).result(T).job_manager_owned_snapshot
            if active:
                sets[sqn] = active
                sqn += 1
                active = []
            expected = [c for s_ in range(start, sqn) for c in sorted(sets[s_], key=lambda c: c[0])]
            got = [(c.key_group, bytes(c.data)) for c in s.create_reader().get_changes(h)]
            assert got == expected, f"writer {index} checkpoint {cp}"
            assert len(h.handles_and_offsets) == sqn - start
            nxt = int(w.next_sequence_number())
            assert nxt == sqn
            if rnd.random() < 0.5:  # checkpoint completes, then a "materialization" truncates
                w.confirm(start, nxt, cp)
                confirmed_files.update(sh.path for sh, _ in h.handles_and_offsets)
                w.truncate(nxt)
                for s_ in range(start, nxt):
                    sets.pop(s_, None)
                start = nxt
            else:  # checkpoint aborted
                w.reset(start, nxt, cp)
        w.truncate(w.next_sequence_number())
        w.close()
    except BaseException as e:  # reported by the test
        errors.append(e)


@pytest.mark.parametrize("mode", ["direct", "thread"])
def test_concurrent_writers_against_a_model(tmp_path, mode):
    job = uuid.uuid4().hex
    s = open_storage(str(tmp_path), job_id=job, upload_mode=mode, preemptive_persist_threshold=THRESHOLD,
                     batch_persist_delay="2 ms")
    confirmed, errors = set(), []
    try:
        threads = [threading.Thread(target=_writer_loop, args=(s, i, 100 + i, 20, confirmed, errors))
                   for i in range(4)]
        for t in threads:
            t.start()
        for t in threads:
            t.join(120)
        assert not any(t.is_alive() for t in threads)
        if errors:
            raise errors[0]
        s.registry.wait_for_deletions(T)
        on_disk = set(os.listdir(tmp_path / job / "dstl"))
        assert on_disk == {os.path.basename(p) for p in confirmed}
        assert s.registry.tracked() == {}
    finally:
        s.close()
