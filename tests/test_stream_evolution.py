"""Schema evolution through a real StatefulStream resume on local Spark: run with schema A, stop,
resume with an evolved processor (a field added -> null, int -> long and float -> double widened, a
field removed) at another parallelism, from a log-only checkpoint and from a materialized one; the
processor and `read_state` see the new layout, the next checkpoint records it, and a forbidden change
(rename, narrowing, TTL added) fails naming the state and field before anything at the base path
changes, also with `resume_from`."""
from __future__ import annotations

import os
import sys

import pandas as pd
import pytest

from conftest import heavy

pytest.importorskip("pyspark")

from pyspark import cloudpickle  # noqa: E402
from pyspark.sql.streaming.stateful_processor import StatefulProcessor  # noqa: E402

from dstl.spark import StatefulStream  # noqa: E402
from dstl.state.evolution import SchemaEvolutionError  # noqa: E402
from dstl.state.metadata import latest_checkpoint, list_checkpoints, read_checkpoint  # noqa: E402

cloudpickle.register_pickle_by_value(sys.modules[__name__])

pytestmark = pytest.mark.spark

NOW = 5_000_000
HOUR = 3_600_000
OUT = "user string, visits long, score double, active boolean, hist long, tag_c long, tag_extra boolean, last long"


class ProfileA(StatefulProcessor):
    """Schema A: a profile, a history list, a tag map and a TTL'd last value, all of int/float fields."""

    def init(self, handle):
        self.profile = handle.getValueState("profile", "name string, visits int, score float, zip string")
        self.hist = handle.getListState("hist", "v int")
        self.tags = handle.getMapState("tags", "t string", "c int, note string")
        self.last = handle.getValueState("last", "v int", ttlDurationMs=HOUR)

    def handleInputRows(self, key, rows, timerValues):
        v = [int(x) for pdf in rows for x in pdf["v"]]
        old = self.profile.get()
        visits = (old[1] if old else 0) + len(v)
        self.profile.update((key[0].upper(), visits, 0.5 * visits, f"z{key[0]}"))
        self.hist.appendList([(x,) for x in v])
        t = self.tags.getValue(("all",))
        self.tags.updateValue(("all",), ((t[0] if t else 0) + len(v), "n"))
        self.last.update((v[-1],))
        return iter([])

    def close(self):
        pass


class ProfileB(StatefulProcessor):
    """Schema B: visits long, score double, zip removed, `active` added; hist long; tags' value gains
    `extra`; last long. It reports what it reads before updating."""

    # the subclasses below change one of these (a state is defined once per init, as on Spark)
    PROFILE = "name string, visits long, score double, active boolean"
    HIST = "v long"
    TAGS_TTL = None

    def init(self, handle):
        self.profile = handle.getValueState("profile", self.PROFILE)
        self.hist = handle.getListState("hist", self.HIST)
        ttl = {} if self.TAGS_TTL is None else {"ttlDurationMs": self.TAGS_TTL}
        self.tags = handle.getMapState("tags", "t string", "c long, note string, extra boolean", **ttl)
        self.last = handle.getValueState("last", "v long", ttlDurationMs=HOUR)

    def handleInputRows(self, key, rows, timerValues):
        v = [int(x) for pdf in rows for x in pdf["v"]]
        name, visits, score, active = self.profile.get()
        hist = list(self.hist.get())
        c, note, extra = self.tags.getValue(("all",))
        last = self.last.get()
        yield pd.DataFrame({"user": [key[0]], "visits": [visits], "score": [score], "active": [active],
                            "hist": [len(hist)], "tag_c": [c], "tag_extra": [extra], "last": [last[0]]})
        self.profile.update((name, visits + len(v), score, True))
        self.hist.appendList([(x,) for x in v])
        self.tags.updateValue(("all",), (c + len(v), note, False))
        self.last.update((v[-1],))

    def close(self):
        pass


class Renamed(ProfileB):
    PROFILE = "full_name string, visits long, score double, active boolean"


class Narrowed(ProfileB):
    HIST = "v short"


class TtlAdded(ProfileB):
    TAGS_TTL = HOUR


USERS = ["a", "b", "c", "d", "e", "f"]


def _batch(b):
    return pd.DataFrame({"user": USERS * 2, "v": [b * 100 + i for i in range(len(USERS) * 2)]})


def _stream(base, processor, p, materialize_every, **kw):
    return StatefulStream(base, processor, OUT, key="user", parallelism=p, time_mode="ProcessingTime",
                          clock=lambda: NOW, materialize_every=materialize_every, **kw)


def _snapshot_kinds(base):
    meta = latest_checkpoint(base)
    return (any(s.materialized for s in meta.subtasks), any(s.changelog for s in meta.subtasks))


@pytest.mark.parametrize("layout", ["log", "materialized"])
@heavy
def test_resume_with_an_evolved_schema_converts_old_values(spark, tmp_path, layout):
    base = str(tmp_path / "job")
    every = None if layout == "log" else 1
    a = _stream(base, ProfileA(), 2, every)
    for b in range(2):
        a.run(spark.createDataFrame(_batch(b), "user string, v long"))
    a.close()
    materialized, _ = _snapshot_kinds(base)
    if layout == "materialized":  # the values come from where the case says
        assert materialized
    else:  # only changelog files: a subtask that restored in batch 1 carries batch 0's log as its base
        meta = latest_checkpoint(base)
        name = os.path.basename
        base_files = {name(f.path) for s in meta.subtasks for h in s.materialized for f, _ in h.handles_and_offsets}
        assert base_files <= {name(f) for f in read_checkpoint(base, 1).files()}

    # forbidden changes fail on open, naming state and field, and change nothing at the base path
    before = list_checkpoints(base)
    for proc, msg in [(Renamed(), r"state 'profile': field 'name' is renamed to 'full_name'"),
                      (Narrowed(), r"state 'hist': field 'v' is narrowed \(integer -> short\)"),
                      (TtlAdded(), r"state 'tags' was created without a TTL")]:
        with pytest.raises(SchemaEvolutionError, match=msg):
            _stream(base, proc, 3, every).open()
        with pytest.raises(SchemaEvolutionError, match=msg):
            _stream(base, proc, 3, every, resume_from=before[0]).open()
        assert list_checkpoints(base) == before

    b_stream = _stream(base, ProfileB(), 3, every)
    res = b_stream.run(spark.createDataFrame(_batch(2), "user string, v long"))
    # hist and last only widen int -> long: stored integers need no conversion, only a new record
    assert res.evolved_states == ["profile", "tags"]
    assert res.restored == 3  # rescaled 2 -> 3: every subtask restored from the checkpoint's files
    got = spark.read.parquet(base + "/output/batch_id=2").toPandas().sort_values("user").reset_index(drop=True)
    expected = pd.DataFrame({"user": USERS, "visits": [4] * 6, "score": [2.0] * 6, "active": [None] * 6,
                             "hist": [4] * 6, "tag_c": [4] * 6, "tag_extra": [None] * 6,
                             "last": [106 + i for i in range(6)]})
    pd.testing.assert_frame_equal(got[expected.columns], expected, check_dtype=False)

    # the new checkpoint records schema B and holds its values in the new layout (a materialization)
    recorded = latest_checkpoint(base).properties["state_schemas"]
    assert recorded["profile"]["value_ddl"] == "name string, visits bigint, score double, active boolean"
    assert recorded["hist"]["value_ddl"] == "v bigint"
    assert _snapshot_kinds(base)[0]
    from dstl.spark import read_state
    from dstl.state import read_state_pandas

    prof = read_state(spark, base, "profile").toPandas().sort_values("key").reset_index(drop=True)
    assert "zip" not in prof.columns
    assert prof[["key", "name", "visits", "score", "active"]].values.tolist() == \
        [[u, u.upper(), 6, 2.0, True] for u in USERS]
    tags = read_state_pandas(base, "tags", now_ms=NOW).sort_values("key")
    assert tags[["c", "note", "extra"]].values.tolist() == [[6, "n", False]] * 6
    hist = read_state_pandas(base, "hist", now_ms=NOW)
    assert sorted(hist.groupby("key").size().tolist()) == [6] * 6

    # a further resume (back at parallelism 2) converts nothing and reads the same
    again = _stream(base, ProfileB(), 2, every)
    res = again.run(spark.createDataFrame(_batch(3), "user string, v long"))
    assert res.evolved_states == []
    got = spark.read.parquet(base + "/output/batch_id=3").toPandas().sort_values("user")
    assert got[["visits", "score", "active", "hist", "tag_c", "tag_extra"]].values.tolist() == \
        [[6, 2.0, True, 6, 6, False]] * 6
    again.close()
    assert os.path.exists(base + "/output/batch_id=3/_SUCCESS")
