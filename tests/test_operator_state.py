"""Operator list state and its FLIP-8 redistribution (docs/rescaling.md §5)."""
from collections import Counter

import pytest
from hypothesis import given, settings
from hypothesis import strategies as st

from dstl.state.operator import (
    BROADCAST, SPLIT_DISTRIBUTE, UNION, OperatorListState, OperatorStateHandle, StateMetaInfo,
    repartition, restore_operator_state, snapshot_operator_state,
)


def _units_by_subtask(assignment, name):
    return [restore_operator_state(handles).get(name, OperatorListState(name)).get() for handles in assignment]


def _slices(handles, name):
    """{stream id: offsets} of one state in one new subtask's handles."""
    return {h.stream_id: h.states[name].offsets for h in handles if name in h.states}


# ------------------------------------------------------------------ the state itself


def test_list_state_operations():
    s = OperatorListState("offsets")
    assert s.mode == SPLIT_DISTRIBUTE and s.get() == [] and len(s) == 0
    s.add(1)
    s.add_all([2, 3])
    assert s.get() == [1, 2, 3]
    got = s.get()
    got.append(99)  # get() is a copy
    assert s.get() == [1, 2, 3]
    s.update(["a"])
    assert list(s) == ["a"]
    s.clear()
    assert s.get() == []
    assert OperatorListState("u", "UNION").mode == UNION  # Flink's enum spelling


def test_bad_states_are_rejected():
    with pytest.raises(ValueError, match="mode"):
        OperatorListState("x", "round_robin")
    with pytest.raises(ValueError, match="name"):
        OperatorListState("")
    s = OperatorListState("x")
    with pytest.raises(TypeError, match="msgpack"):
        s.add(object())
    with pytest.raises(TypeError, match="msgpack"):
        s.add_all([1, object()])
    assert s.get() == []  # all-or-nothing
    with pytest.raises(ValueError, match="named"):
        snapshot_operator_state([OperatorListState("x"), OperatorListState("x")])


def test_snapshot_and_restore_roundtrip_with_serialization():
    a = OperatorListState("a", values=[{"p": 0, "o": 10}, [1, 2], b"\x00raw", "text", None, 2**63 - 1])
    b = OperatorListState("b", UNION, values=[1.5])
    empty = OperatorListState("empty", BROADCAST)
    handle = snapshot_operator_state([a, b, empty])
    assert set(handle.states) == {"a", "b", "empty"}
    assert handle.states["a"].mode == SPLIT_DISTRIBUTE and len(handle.states["a"].offsets) == 6
    assert handle.states["empty"].offsets == ()
    again = OperatorStateHandle.from_bytes(handle.to_bytes())
    assert again == handle
    restored = restore_operator_state([again])
    assert restored["a"].get() == a.get()
    assert restored["b"].get() == [1.5] and restored["b"].mode == UNION
    assert restored["empty"].get() == [] and restored["empty"].mode == BROADCAST


def test_corrupt_handles_are_rejected():
    handle = snapshot_operator_state([OperatorListState("a", values=["xyz", "abc"])])
    with pytest.raises(ValueError, match="not the start of a unit"):
        OperatorStateHandle({"a": ((1,), SPLIT_DISTRIBUTE)}, handle.data).read_units()
    with pytest.raises(ValueError, match="outside the stream"):
        OperatorStateHandle({"a": ((100,), SPLIT_DISTRIBUTE)}, handle.data)
    with pytest.raises(ValueError, match="truncated|corrupt"):
        OperatorStateHandle({"a": ((0,), SPLIT_DISTRIBUTE)}, handle.data[:-1]).read_units()
    with pytest.raises(ValueError, match="msgpack"):
        OperatorStateHandle.from_bytes(b"\xc1")
    with pytest.raises(ValueError, match="operator-state"):
        OperatorStateHandle.from_bytes(b"\x80")


# ------------------------------------------------------------------ RESCALING §5 worked example


def _offsets_of(handle, name):
    return handle.states[name].offsets


def test_worked_example_of_rescaling_section_5():
    old0 = snapshot_operator_state([OperatorListState("x", values=["a0", "a1", "a2"]),
                                    OperatorListState("y", values=["c0", "c1", "c2", "c3"])])
    old1 = snapshot_operator_state([OperatorListState("x", values=["b0", "b1"])])
    A, C = _offsets_of(old0, "x"), _offsets_of(old0, "y")
    B = _offsets_of(old1, "x")
    new = repartition([[old0], [old1]], 3)
    assert len(new) == 3
    # x: subtask 0 gets a0,a1; subtask 1 gets a2 and b0 as two slices; subtask 2 gets b1
    assert _slices(new[0], "x") == {old0.stream_id: A[0:2]}
    assert _slices(new[1], "x") == {old0.stream_id: A[2:3], old1.stream_id: B[0:1]}
    assert _slices(new[2], "x") == {old1.stream_id: B[1:2]}
    # y starts at subtask 2: c0,c1 there, then c2 on subtask 0, c3 on subtask 1
    assert _slices(new[2], "y") == {old0.stream_id: C[0:2]}
    assert _slices(new[0], "y") == {old0.stream_id: C[2:3]}
    assert _slices(new[1], "y") == {old0.stream_id: C[3:4]}
    # slices of one stream on one subtask are one handle
    for handles in new:
        assert len({h.stream_id for h in handles}) == len(handles)
    assert [len(handles) for handles in new] == [1, 2, 2]
    # handles are listed in the old subtasks' stream order
    assert [h.stream_id for h in new[2]] == [old0.stream_id, old1.stream_id]
    assert _units_by_subtask(new, "x") == [["a0", "a1"], ["a2", "b0"], ["b1"]]
    assert _units_by_subtask(new, "y") == [["c2"], ["c3"], ["c0", "c1"]]


def test_split_states_are_taken_in_name_order():
    # the same states registered in the other order give the same assignment (name order, not insertion)
    old = snapshot_operator_state([OperatorListState("y", values=[0, 1, 2, 3]),
                                   OperatorListState("x", values=[0, 1, 2, 3, 4])])
    new = repartition([[old]], 3)
    assert [len(u) for u in _units_by_subtask(new, "x")] == [2, 2, 1]
    assert [len(u) for u in _units_by_subtask(new, "y")] == [1, 1, 2]  # starts at subtask 2


# ------------------------------------------------------------------ the Kafka-source use case


def _source_subtask(partitions):
    state = OperatorListState("topic-partition-offsets", values=[[p, off] for p, off in partitions])
    return [snapshot_operator_state([state])]


@pytest.mark.parametrize("new_parallelism,expected", [
    (1, [[[0, 100], [1, 250], [2, 300], [3, 475]]]),
    (4, [[[0, 100]], [[1, 250]], [[2, 300]], [[3, 475]]]),
    (3, [[[0, 100], [1, 250]], [[2, 300]], [[3, 475]]]),
])
def test_kafka_source_offsets_rescaled(new_parallelism, expected):
    old = [_source_subtask([(0, 100), (1, 250)]), _source_subtask([(2, 300), (3, 475)])]
    new = repartition(old, new_parallelism)
    got = _units_by_subtask(new, "topic-partition-offsets")
    assert got == expected
    flat = [tuple(u) for units in got for u in units]
    assert sorted(flat) == [(0, 100), (1, 250), (2, 300), (3, 475)]  # nothing skipped or duplicated


def test_kafka_source_through_several_rescales_with_fresh_snapshots():
    subtasks = [_source_subtask([(0, 100), (1, 250)]), _source_subtask([(2, 300), (3, 475)])]
    for n in (4, 1, 3, 2, 8, 5):
        assigned = repartition(subtasks, n)
        states = [restore_operator_state(h) for h in assigned]
        units = [tuple(u) for s in states for u in s.get("topic-partition-offsets", OperatorListState("t")).get()]
        assert sorted(units) == [(0, 100), (1, 250), (2, 300), (3, 475)], n
        # every subtask snapshots what it holds (as a running source would at the next checkpoint)
        subtasks = [[snapshot_operator_state(list(s.values()))] if s else [] for s in states]


def test_repartitioned_handles_can_be_repartitioned_again():
    old = [_source_subtask([(0, 1), (1, 2), (2, 3)]), _source_subtask([(3, 4), (4, 5)])]
    once = repartition(old, 3)  # stream of subtask 0 is now split over two subtasks
    for n in (1, 2, 4):
        twice = repartition(once, n)
        units = [tuple(u) for units in _units_by_subtask(twice, "topic-partition-offsets") for u in units]
        assert sorted(units) == [(0, 1), (1, 2), (2, 3), (3, 4), (4, 5)]


# ------------------------------------------------------------------ union and broadcast


def test_union_state_goes_whole_to_every_subtask():
    old = [[snapshot_operator_state([OperatorListState("u", UNION, values=[f"s{i}-{k}" for k in range(i + 1)])])]
           for i in range(3)]
    everything = ["s0-0", "s1-0", "s1-1", "s2-0", "s2-1", "s2-2"]
    for n in (1, 2, 3, 5):
        new = repartition(old, n)
        assert _units_by_subtask(new, "u") == [everything] * n


def test_broadcast_state_by_index():
    old = [[snapshot_operator_state([OperatorListState("b", BROADCAST, values=[f"copy{i}", "rule"])])]
           for i in range(2)]
    new = repartition(old, 5)
    assert [u[0] for u in _units_by_subtask(new, "b")] == ["copy0", "copy1", "copy0", "copy1", "copy0"]
    new = repartition(old, 1)
    assert _units_by_subtask(new, "b") == [["copy0", "rule"]]


def test_mixed_modes_in_one_handle():
    def subtask(i):
        return [snapshot_operator_state([
            OperatorListState("split", values=[f"p{i}{k}" for k in range(3)]),
            OperatorListState("union", UNION, values=[f"u{i}"]),
            OperatorListState("bcast", BROADCAST, values=[f"b{i}"]),
        ])]
    new = repartition([subtask(0), subtask(1)], 4)
    split = _units_by_subtask(new, "split")
    assert sorted(x for units in split for x in units) == ["p00", "p01", "p02", "p10", "p11", "p12"]
    assert [len(u) for u in split] == [2, 2, 1, 1]
    assert _units_by_subtask(new, "union") == [["u0", "u1"]] * 4
    assert _units_by_subtask(new, "bcast") == [["b0"], ["b1"], ["b0"], ["b1"]]
    for handles in new:  # every subtask holds at most one handle per old stream
        assert len({h.stream_id for h in handles}) == len(handles)


# ------------------------------------------------------------------ parallelism unchanged


def test_unchanged_parallelism_without_union_is_identity():
    old = [[snapshot_operator_state([OperatorListState("s", values=[i, i + 10]),
                                     OperatorListState("b", BROADCAST, values=["x"])])] for i in range(3)]
    new = repartition(old, 3)
    assert new == old
    assert all(a is b for new_h, old_h in zip(new, old) for a, b in zip(new_h, old_h))


def test_unchanged_parallelism_with_union_keeps_split_units_in_place():
    old = [[snapshot_operator_state([OperatorListState("s", values=[f"s{i}a", f"s{i}b", f"s{i}c"][: i + 1]),
                                     OperatorListState("u", UNION, values=[f"u{i}"])])] for i in range(3)]
    new = repartition(old, 3)
    assert _units_by_subtask(new, "s") == [["s0a"], ["s1a", "s1b"], ["s2a", "s2b", "s2c"]]
    assert _units_by_subtask(new, "u") == [["u0", "u1", "u2"]] * 3
    # the own stream appears once per subtask, with the union entry merged in
    assert [len(h) for h in new] == [3, 3, 3]


def test_unchanged_parallelism_with_partly_reported_broadcast():
    # subtask 1 finished and reported no broadcast state: every subtask gets entry i % 2
    old = [
        [snapshot_operator_state([OperatorListState("b", BROADCAST, values=["from0"]),
                                  OperatorListState("s", values=["s0"])])],
        [snapshot_operator_state([OperatorListState("s", values=["s1"])])],
        [snapshot_operator_state([OperatorListState("b", BROADCAST, values=["from2"]),
                                  OperatorListState("s", values=["s2"])])],
    ]
    new = repartition(old, 3)
    assert _units_by_subtask(new, "b") == [["from0"], ["from2"], ["from0"]]
    assert _units_by_subtask(new, "s") == [["s0"], ["s1"], ["s2"]]


def test_repartition_argument_checks():
    with pytest.raises(ValueError, match="new_parallelism"):
        repartition([[]], 0)
    with pytest.raises(ValueError, match="at least one"):
        repartition([], 2)
    with pytest.raises(TypeError):
        repartition([["not a handle"]], 2)
    a = snapshot_operator_state([OperatorListState("x", UNION, values=[1])])
    b = snapshot_operator_state([OperatorListState("x", SPLIT_DISTRIBUTE, values=[1])])
    with pytest.raises(ValueError, match="modes"):
        repartition([[a], [b]], 3)
    assert repartition([[], []], 3) == [[], [], []]


def test_empty_entries_in_the_middle_are_passed_through_as_flink_does():
    old = [[snapshot_operator_state([OperatorListState("x", values=["a"])])],
           [snapshot_operator_state([OperatorListState("x")])],
           [snapshot_operator_state([OperatorListState("x", values=["c"])])]]
    new = repartition(old, 2)
    assert _units_by_subtask(new, "x") == [["a"], ["c"]]
    # the empty entry is attached to the subtask that walked past it (1), with no offsets
    assert _slices(new[1], "x") == {old[1][0].stream_id: (), old[2][0].stream_id: _offsets_of(old[2][0], "x")}
    assert _slices(new[0], "x") == {old[0][0].stream_id: _offsets_of(old[0][0], "x")}


# ------------------------------------------------------------------ property


@st.composite
def _old_states(draw):
    old_p = draw(st.integers(1, 8))
    names = draw(st.lists(st.sampled_from(["a", "b", "c"]), min_size=1, max_size=3, unique=True))
    subtasks = []
    for i in range(old_p):
        handles = []
        for h in range(draw(st.integers(0, 2))):
            states = [OperatorListState(n, values=[f"{n}:{i}:{h}:{k}" for k in range(draw(st.integers(0, 6)))])
                      for n in names if draw(st.booleans())]
            handles.append(snapshot_operator_state(states))
        subtasks.append(handles)
    return names, subtasks


@settings(max_examples=200, deadline=None)
@given(_old_states(), st.integers(1, 8), st.integers(1, 8))
def test_property_split_distribute_never_loses_or_duplicates(old, new_p, third_p):
    names, subtasks = old
    before = {n: Counter(u for handles in subtasks for u in restore_operator_state(handles).get(
        n, OperatorListState(n)).get()) for n in names}
    new = repartition(subtasks, new_p)
    assert len(new) == new_p
    new = [[OperatorStateHandle.from_bytes(h.to_bytes()) for h in handles] for handles in new]
    for n in names:
        per_subtask = _units_by_subtask(new, n)
        assert Counter(u for units in per_subtask for u in units) == before[n]
        if new_p != len(subtasks):  # balanced: sizes differ by at most one
            sizes = [len(u) for u in per_subtask]
            assert max(sizes) - min(sizes) <= 1
    for handles in new:
        assert len({h.stream_id for h in handles}) == len(handles)
    again = repartition(new, third_p)
    for n in names:
        assert Counter(u for units in _units_by_subtask(again, n) for u in units) == before[n]


def test_state_meta_info_is_a_plain_pair():
    info = StateMetaInfo((0, 5), UNION)
    offsets, mode = info
    assert offsets == (0, 5) and mode == UNION
