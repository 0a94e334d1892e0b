"""dstl.state.read_state_pandas / read_changes_pandas on a job written through the state API."""
from __future__ import annotations

import json

import pytest

from dstl.keygroups import assign_to_key_group
from dstl.state.reader import StateReadError, read_changes_pandas, read_state_pandas
from state_job import MAXP, StateJob, frame_rows


@pytest.fixture
def job(tmp_path):
    j = StateJob(str(tmp_path / "job"))
    try:
        yield j
    finally:
        j.close()


def test_live_state_of_every_checkpoint(job):
    expected = {}
    for i in range(4):
        cid = job.step(materialize=(i == 1))
        expected[cid] = job.expected_rows()
    df = read_state_pandas(job.base)
    assert list(df.columns) == ["key", "key_group", "state", "kind", "user_key", "position", "value"]
    assert frame_rows(df) == expected[4]
    assert all(assign_to_key_group(k, MAXP) == g for k, g in zip(df["key"], df["key_group"]))
    assert frame_rows(read_state_pandas(job.base, checkpoint_id=3)) == expected[3]
    only = read_state_pandas(job.base, "seen")
    assert set(only["state"]) == {"seen"} and frame_rows(only) == [r for r in expected[4] if r[1] == "seen"]
    one = read_state_pandas(job.base, key="u3")
    assert frame_rows(one) == [r for r in expected[4] if r[0] == "u3"]


def test_changes_between_checkpoints_are_the_applied_ops(job):
    for i in range(4):
        job.step(materialize=(i == 2))
    df = read_changes_pandas(job.base, 1, 4)
    assert list(df.columns) == ["checkpoint_id", "key", "key_group", "state", "op", "user_key", "value"]
    got = sorted((r.checkpoint_id, r.key, r.state, r.op, r.user_key, r.value)
                 for r in df.astype(object).where(df.notna(), None).itertuples(index=False))
    want = sorted(c for c in job.changes if c[0] > 1)
    assert got == want
    # per key, the log order of one key's changes is the order they were applied
    key = "u1"
    mine = df[df["key"] == key]
    assert [tuple(x) for x in mine[["state", "op"]].values] == [(c[2], c[3]) for c in job.changes
                                                               if c[0] > 1 and c[1] == key]
    assert read_changes_pandas(job.base, 2, 3, key="u1")["checkpoint_id"].eq(3).all()


def test_errors_name_the_problem(job, tmp_path):
    job.step()
    job.step()
    with pytest.raises(StateReadError, match="holds no checkpoints"):
        read_state_pandas(str(tmp_path / "nothing"))
    with pytest.raises(StateReadError, match=r"no checkpoint 9 \(retained: 1, 2\)"):
        read_state_pandas(job.base, checkpoint_id=9)
    with pytest.raises(StateReadError, match=r"no state 'nope' \(states: count, items, seen, total\)"):
        read_state_pandas(job.base, "nope")
    with pytest.raises(StateReadError, match="must be before"):
        read_changes_pandas(job.base, 2, 1)
