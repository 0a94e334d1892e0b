"""Property test (issue 5): random state operations, checkpoints, crashes, restores and rescales.

A job of `p` subtasks (1..8, max parallelism 128) applies random Value/List/Map/Reducing operations
(single and bulk) to the subtask owning each key, takes checkpoints (confirmed or aborted),
materializes at random, crashes (drops every backend without closing it) and restores the last
completed checkpoint at a random new parallelism. After every restore the union of the subtasks'
state must equal a plain-dict model, every state registered before the checkpoint must be known to
each new subtask whose range overlaps the old subtask that registered it, and at the end a restore
right after materializing every subtask must read no data change from before the materialization.
"""
from __future__ import annotations

import copy
import operator
import tempfile

from hypothesis import HealthCheck, given, settings
from hypothesis import strategies as st

from conftest import heavy_twins
from dstl.keygroups import assign_to_key_group, compute_key_group_range_for_operator_index as kg_range
from dstl.state.backend import KeyedStateBackend
from dstl.changelog.storage import open_storage

MAXP = 128
LIST_MAX = 4

# a small key space, so that operations on the same key (set, then clear, ...) are common
keys = st.one_of(st.integers(-3, 12), st.text(alphabet="aé😀", max_size=2), st.binary(max_size=1))
small = st.integers(-5, 5)
values = st.one_of(st.integers(-10**6, 10**6), st.text(max_size=4), st.lists(small, max_size=3))
user_keys = st.one_of(st.integers(0, 5), st.sampled_from(["a", "b", "c"]))

ops = st.one_of(
    st.tuples(st.just("v_set"), keys, values),
    st.tuples(st.just("v_clear"), keys),
    st.tuples(st.just("v_bulk"), st.lists(st.tuples(keys, st.integers(-99, 99)), max_size=12)),
    st.tuples(st.just("l_add"), keys, small),
    st.tuples(st.just("l_update"), keys, st.lists(small, max_size=5)),
    st.tuples(st.just("l_bulk"), st.lists(st.tuples(keys, small), max_size=12)),
    st.tuples(st.just("m_put"), keys, user_keys, values),
    st.tuples(st.just("m_remove"), keys, user_keys),
    st.tuples(st.just("m_clear"), keys),
    st.tuples(st.just("m_bulk"), st.lists(st.tuples(keys, user_keys, st.integers(0, 9)), max_size=12)),
    st.tuples(st.just("r_add"), keys, st.integers(0, 100)),
    st.tuples(st.just("r_bulk"), st.lists(st.tuples(keys, st.integers(0, 9)), max_size=8)),
    st.tuples(st.just("l_add_all"), keys, st.lists(small, max_size=5)),
    st.tuples(st.just("m_put_all"), keys, st.dictionaries(user_keys, st.integers(0, 9), max_size=3)),
    st.tuples(st.just("checkpoint"), st.booleans()),           # confirm (True) or abort (False)
    st.tuples(st.just("materialize"), st.integers(0, 7)),
    st.tuples(st.just("crash"), st.integers(1, 8), st.booleans()),  # new parallelism, materialize on restore
    st.tuples(st.just("checkpoint"), st.just(True)),            # (more checkpoints and crashes)
    st.tuples(st.just("crash"), st.integers(1, 8), st.just(False)),
)

STATES = {"v": "value", "l": "list", "m": "map", "r": "reducing"}


class Job:
    def __init__(self, storage, parallelism, every):
        self.storage = storage
        self.every = every
        self.model = {name: {} for name in STATES}
        self.cp = 0
        self.completed = None   # (snapshots, model, registered names per old subtask, parallelism)
        self.restores = 0
        self._start([KeyedStateBackend(storage, "op", kg_range(MAXP, parallelism, i), MAXP,
                                       materialize_every_changes=every) for i in range(parallelism)])

    def _start(self, backends):
        self.backends = backends
        self.p = len(backends)

    def owner(self, key):
        kg = assign_to_key_group(key, MAXP)
        return next(b for b in self.backends if kg in b.key_group_range)

    @staticmethod
    def state(backend, name):
        if name == "v":
            return backend.value_state("v")
        if name == "l":
            return backend.list_state("l", max_length=LIST_MAX)
        if name == "m":
            return backend.map_state("m")
        return backend.reducing_state("r", operator.add)

    def apply(self, op):
        kind = op[0]
        mv, ml, mm, mr = (self.model[n] for n in "vlmr")
        if kind == "v_set":
            _, k, x = op
            self.state(self.owner(k), "v").update(k, x)
            mv[k] = x
        elif kind == "v_clear":
            self.state(self.owner(op[1]), "v").clear(op[1])
            mv.pop(op[1], None)
        elif kind == "r_bulk":
            for b in self.backends:
                mine = [r for r in op[1] if self.owner(r[0]) is b]
                if mine:
                    self.state(b, "r").add_many([r[0] for r in mine], [r[1] for r in mine])
            for k, x in op[1]:
                mr[k] = mr.get(k, 0) + x
        elif kind == "l_add_all":
            _, k, xs = op
            self.state(self.owner(k), "l").add_all(k, xs)
            if xs:
                ml[k] = (ml.get(k, []) + xs)[-LIST_MAX:]
        elif kind == "m_put_all":
            _, k, d = op
            self.state(self.owner(k), "m").put_all(k, d)
            if d:
                mm.setdefault(k, {}).update(d)
        elif kind in ("v_bulk", "l_bulk", "m_bulk"):
            rows = op[1]
            for b in self.backends:  # route each row to its owner, keep the order within a subtask
                mine = [r for r in rows if self.owner(r[0]) is b]
                if not mine:
                    continue
                cols = list(zip(*mine))
                if kind == "v_bulk":
                    self.state(b, "v").update_many(list(cols[0]), list(cols[1]))
                elif kind == "l_bulk":
                    self.state(b, "l").add_many(list(cols[0]), list(cols[1]))
                else:
                    self.state(b, "m").put_many(list(cols[0]), list(cols[1]), list(cols[2]))
            for r in rows:
                if kind == "v_bulk":
                    mv[r[0]] = r[1]
                elif kind == "l_bulk":
                    ml[r[0]] = (ml.get(r[0], []) + [r[1]])[-LIST_MAX:]
                else:
                    mm.setdefault(r[0], {})[r[1]] = r[2]
        elif kind == "l_add":
            _, k, x = op
            self.state(self.owner(k), "l").add(k, x)
            ml[k] = (ml.get(k, []) + [x])[-LIST_MAX:]
        elif kind == "l_update":
            _, k, xs = op
            self.state(self.owner(k), "l").update(k, xs)
            if xs:
                ml[k] = xs[-LIST_MAX:]
            else:
                ml.pop(k, None)
        elif kind == "m_put":
            _, k, uk, x = op
            self.state(self.owner(k), "m").put(k, uk, x)
            mm.setdefault(k, {})[uk] = x
        elif kind == "m_remove":
            _, k, uk = op
            self.state(self.owner(k), "m").remove(k, uk)
            if k in mm:
                mm[k].pop(uk, None)
                if not mm[k]:
                    del mm[k]
        elif kind == "m_clear":
            self.state(self.owner(op[1]), "m").clear(op[1])
            mm.pop(op[1], None)
        elif kind == "r_add":
            _, k, x = op
            self.state(self.owner(k), "r").add(k, x)
            mr[k] = mr.get(k, 0) + x
        elif kind == "checkpoint":
            self.checkpoint(op[1])
        elif kind == "materialize":
            self.backends[op[1] % self.p].materialize()
        elif kind == "crash":
            self.crash(op[1], op[2])

    def checkpoint(self, confirm):
        self.cp += 1
        snaps = [b.snapshot(self.cp).result(timeout=30) for b in self.backends]
        if confirm:
            for b in self.backends:
                b.confirm(self.cp)
            registered = [(b.key_group_range, set(b.state_names)) for b in self.backends]
            self.completed = (snaps, copy.deepcopy(self.model), registered)
        else:
            for b in self.backends:
                b.abort(self.cp)

    def crash(self, new_p, materialize_on_restore):
        self.backends = None  # in-memory state is gone; nothing is closed
        self.restores += 1
        if self.completed is None:
            self.model = {name: {} for name in STATES}
            self._start([KeyedStateBackend(self.storage, "op", kg_range(MAXP, new_p, i), MAXP,
                                           materialize_every_changes=self.every) for i in range(new_p)])
            return
        snaps, model, registered = self.completed
        self.model = copy.deepcopy(model)
        self._start([KeyedStateBackend.restore(self.storage, "op", kg_range(MAXP, new_p, i), MAXP, snaps,
                                               materialize_every_changes=self.every,
                                               materialize_on_restore=materialize_on_restore)
                     for i in range(new_p)])
        self.check(registered)

    def union(self):
        out = {name: {} for name in STATES}
        for b in self.backends:
            for name in b.state_names:
                part = dict(b.get_state(name).all_items())
                assert not set(part) & set(out[name]), f"{name}: a key is held by two subtasks"
                out[name].update(part)
        return out

    def check(self, registered=None):
        assert self.union() == self.model
        if registered is not None:
            for b in self.backends:
                expected = set()
                for old_range, names in registered:
                    if not old_range.intersection(b.key_group_range).is_empty():
                        expected |= names
                assert expected <= set(b.state_names), "metadata lost on restore/rescale"
            assert set().union(*(n for _, n in registered)) == set().union(*(set(b.state_names)
                                                                              for b in self.backends))


@heavy_twins  # the state model of each build
@settings(max_examples=50, deadline=None, suppress_health_check=[HealthCheck.too_slow])
@given(p=st.integers(1, 8), every=st.sampled_from([None, None, 7, 40]),
       program=st.lists(ops, min_size=20, max_size=80), mid_p=st.integers(1, 8), final_p=st.integers(1, 8))
def test_random_programs_restore_to_the_model(p, every, program, mid_p, final_p):
    with tempfile.TemporaryDirectory() as tmp:
        storage = open_storage(tmp, upload_mode="direct")
        try:
            job = Job(storage, p, every)
            for op in program:
                job.apply(op)
            job.check()
            # restore everything logged so far (changelog replay of the whole program) ...
            job.checkpoint(True)
            job.crash(mid_p, False)
            # ... then materialize everything, checkpoint, crash, restore elsewhere: the restore reads
            # the key-group snapshots and nothing older
            for b in job.backends:
                b.materialize()
            job.checkpoint(True)
            snaps = job.completed[0]
            job.crash(final_p, False)
            for b in job.backends:
                st_ = b.restore_stats
                groups = {kg for s in snaps for h in s.materialized for kg in range(h.key_group_range.start,
                                                                                   h.key_group_range.end + 1)}
                assert st_["changes_applied"] <= len(groups & set(b.key_group_range))
                assert st_["changes_applied"] == len(b.key_groups())
        finally:
            storage.close()
