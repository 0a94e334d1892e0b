"""A small job written straight through the state API (no Spark): two subtasks, all four state
kinds, a few checkpoints with a materialization in between. It records what it did, so the readers'
results can be compared with an independent account of the live state and of every change."""
from __future__ import annotations

import json
import random
from typing import Any, Dict, List, Tuple

from dstl.keygroups import assign_to_key_group, key_group_ranges
from dstl.state import CheckpointMetadata, KeyedStateBackend, SubtaskState, write_checkpoint
from dstl.changelog.storage import open_storage

JOB = "5eed5eed5eed5eed5eed5eed5eed5eed"
MAXP = 128


class StateJob:
    def __init__(self, base: str, parallelism: int = 2, seed: int = 7):
        self.base = base
        self.rng = random.Random(seed)
        self.storage = open_storage(base, upload_mode="direct", job_id=JOB)
        self.ranges = key_group_ranges(MAXP, parallelism)
        self.backends = [KeyedStateBackend(self.storage, "op", r, MAXP) for r in self.ranges]
        self.live: Dict[Tuple[str, Any], Any] = {}  # (state, key) -> value
        self.kinds = {"count": "value", "items": "list", "seen": "map", "total": "reducing"}
        self.changes: List[Tuple] = []  # (checkpoint, key, state, op, user_key json, value json)
        self.cid = 0

    def _b(self, key):
        kg = assign_to_key_group(key, MAXP)
        return next(b for b, r in zip(self.backends, self.ranges) if r.contains(kg))

    def step(self, n: int = 40, materialize: bool = False) -> int:
        """Random operations, then a checkpoint; returns its id."""
        cid = self.cid + 1
        if materialize:  # before the changes: they stay in the log the checkpoint references
            for b in self.backends:
                b.materialize()
        for _ in range(n):
            key = self.rng.choice([f"u{i}" for i in range(15)])
            b = self._b(key)
            what = self.rng.random()
            if what < 0.3:
                v = self.rng.randint(0, 99)
                b.value_state("count").update(key, v)
                self.live[("count", key)] = v
                self.changes.append((cid, key, "count", "update", None, json.dumps(v)))
            elif what < 0.5:
                el = self.rng.choice(["a", "b", "c"])
                b.list_state("items").add(key, el)
                self.live.setdefault(("items", key), []).append(el)
                self.changes.append((cid, key, "items", "add", None, json.dumps(el)))
            elif what < 0.7:
                uk = self.rng.choice(["x", "y"])
                b.map_state("seen").put(key, uk, 1.5)
                self.live.setdefault(("seen", key), {})[uk] = 1.5
                self.changes.append((cid, key, "seen", "put", json.dumps(uk), "1.5"))
            elif what < 0.8:
                uk = self.rng.choice(["x", "y"])
                b.map_state("seen").remove(key, uk)
                m = self.live.get(("seen", key))
                if m is not None:
                    m.pop(uk, None)
                    if not m:
                        del self.live[("seen", key)]
                self.changes.append((cid, key, "seen", "remove", json.dumps(uk), None))
            elif what < 0.9:
                st = b.reducing_state("total", lambda a, c: a + c)
                st.add(key, 2)
                v = self.live.get(("total", key), 0) + 2
                self.live[("total", key)] = v
                self.changes.append((cid, key, "total", "update", None, json.dumps(v)))
            else:
                b.value_state("count").clear(key)
                self.live.pop(("count", key), None)
                self.changes.append((cid, key, "count", "clear", None, None))
        snaps = [b.snapshot(cid).result() for b in self.backends]
        meta = CheckpointMetadata(cid, MAXP, len(self.backends),
                                  [SubtaskState.from_keyed_snapshot(i, s) for i, s in enumerate(snaps)],
                                  {"batch": cid - 1}, job_id=JOB)
        write_checkpoint(self.base, meta)
        for b in self.backends:
            b.confirm(cid)
        self.cid = cid
        return cid

    def expected_rows(self):
        """Sorted STATE_COLUMNS tuples without key_group, from the independent account."""
        rows = []
        for (name, key), v in self.live.items():
            kind = self.kinds[name]
            if kind == "list":
                rows += [(key, name, kind, None, i, json.dumps(e)) for i, e in enumerate(v)]
            elif kind == "map":
                rows += [(key, name, kind, json.dumps(uk), None, json.dumps(x)) for uk, x in v.items()]
            else:
                rows.append((key, name, kind, None, None, json.dumps(v)))
        return sorted(rows, key=repr)

    def close(self):
        for b in self.backends:
            b.close()
        self.storage.close()


def frame_rows(df):
    """A read_state DataFrame as sorted tuples comparable with `expected_rows`."""
    import pandas as pd

    out = []
    for r in df.itertuples(index=False):
        pos = None if pd.isna(r.position) else int(r.position)
        user_key = None if pd.isna(r.user_key) else r.user_key
        value = None if pd.isna(r.value) else r.value
        out.append((r.key, r.state, r.kind, user_key, pos, value))
    return sorted(out, key=repr)
