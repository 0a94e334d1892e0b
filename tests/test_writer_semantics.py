"""FsStateChangelogWriter semantics (docs/semantics.md §3-§6), in every upload mode of writer_modes.UPLOAD_MODES."""
from __future__ import annotations

import threading
import uuid
from concurrent.futures import CancelledError

import numpy as np
import pytest

from dstl.errors import WriterClosedError
from dstl.types import KeyGroupRange, SequenceNumber
from writer_modes import RESULT_TIMEOUT as T
from writer_modes import files_of, make_storage, read_all, upload_mode, wait_until  # noqa: F401

KGR = KeyGroupRange(0, 127)


def result(fut):
    return fut.result(T).job_manager_owned_snapshot


# -- §3 sequence-number table ---------------------------------------------------------------------

@pytest.mark.parametrize("with_append", [True, False], ids=["with-append", "without"])
def test_sequence_number_table(make_storage, with_append):
    s = make_storage()

    def fresh():
        w = s.create_writer("op", KGR)
        if with_append:
            w.append(0, b"abcd")
        return w

    assert int(fresh().initial_sequence_number()) == 0
    # next_sequence_number()
    assert int(fresh().next_sequence_number()) == (1 if with_append else 0)
    # persist(0, 1)
    w = fresh()
    w.persist(0, 1).result(T)
    assert int(w.next_sequence_number()) == (1 if with_append else 0)
    # append(...) again: no rollover, the next change still gets sqn 0
    w = fresh()
    w.append(1, b"efgh")
    with pytest.raises(ValueError, match="not yet appended"):
        w.persist(1, 1)  # from > active
    assert int(w.next_sequence_number()) == 1  # both appends were in change set 0
    # truncate(0)
    w = fresh()
    w.truncate(0)
    with pytest.raises(ValueError, match="not yet appended"):
        w.persist(1, 1)
    # truncate(next_sequence_number())
    if with_append:
        w = fresh()
        nxt = w.next_sequence_number()
        w.truncate(nxt)
        assert int(nxt) == 1
        assert int(w.next_sequence_number()) == 1
        with pytest.raises(ValueError, match="truncated"):
            w.persist(0, 1)


def test_sequence_numbers_are_sequence_number_objects(make_storage):
    w = make_storage().create_writer("op", KGR)
    w.append(3, b"x")
    nxt = w.next_sequence_number()
    assert isinstance(nxt, SequenceNumber) and nxt == SequenceNumber(1)
    # plain ints and SequenceNumbers are both accepted
    assert result(w.persist(SequenceNumber(0), 1)).state_size == 1


# -- §5 persist ----------------------------------------------------------------------------------

def _three_sets(w):
    w.append(0, b"a0")
    w.next_sequence_number()
    w.append(1, b"b1")
    w.append_meta(b"m1")
    w.next_sequence_number()
    w.append(2, b"c2")


def test_persist_from_chooses_exactly_the_later_change_sets(make_storage):
    s = make_storage()
    w = s.create_writer("op", KGR)
    _three_sets(w)
    h = result(w.persist(1, 1))
    assert len(h.handles_and_offsets) == 2
    assert h.key_group_range == KGR
    assert h.state_size == 6 and h.checkpointed_size == 6
    assert h.storage_identifier == "filesystem"
    assert read_all(s, h) == [(-1, b"m1"), (1, b"b1"), (2, b"c2")]
    assert len(files_of(s)) == 1


def test_already_uploaded_change_sets_are_reused(make_storage):
    s = make_storage()
    w = s.create_writer("op", KGR)
    _three_sets(w)
    h1 = result(w.persist(1, 1))
    h2 = result(w.persist(0, 2))
    assert len(files_of(s)) == 2  # only change set 0 was uploaded again
    assert h2.handles_and_offsets[1:] == h1.handles_and_offsets
    assert h2.checkpointed_size == 2 and h2.state_size == 8
    assert read_all(s, h2) == [(0, b"a0"), (-1, b"m1"), (1, b"b1"), (2, b"c2")]
    # nothing new: fast path, completed future, checkpointed size 0, no new file
    f3 = w.persist(0, 3)
    assert f3.done()
    h3 = result(f3)
    assert h3.handles_and_offsets == h2.handles_and_offsets and h3.checkpointed_size == 0
    assert h3.state_handle_id != h2.state_handle_id
    assert len(files_of(s)) == 2


def test_persist_of_empty_range_completes_at_once(make_storage):
    s = make_storage()
    w = s.create_writer("op", KGR)
    f = w.persist(0, 1)
    assert f.done()
    h = result(f)
    assert h.handles_and_offsets == [] and h.state_size == 0
    assert files_of(s) == []


def test_persist_range_checks(make_storage):
    w = make_storage().create_writer("op", KGR)
    w.append(0, b"x")
    with pytest.raises(ValueError, match="not yet appended"):
        w.persist(1, 1)
    w.truncate(w.next_sequence_number())
    with pytest.raises(ValueError, match="truncated"):
        w.persist(0, 1)


def test_offsets_point_at_each_change_set(make_storage):
    s = make_storage()
    w = s.create_writer("op", KGR)
    _three_sets(w)
    h = result(w.persist(0, 1))
    offsets = [off for _, off in h.handles_and_offsets]
    assert offsets[0] == 0 and offsets == sorted(offsets) and len(set(offsets)) == 3
    # change set 0 = 1 group: 4 + 8 + 4 + 2 bytes
    assert offsets[1] == 18


# -- §4 pre-emptive persist ------------------------------------------------------------------------

def test_preemptive_persist_uploads_once_the_active_set_reaches_the_threshold(make_storage):
    s = make_storage(preemptive_persist_threshold=64)
    w = s.create_writer("op", KGR)
    w.append(0, b"x" * 40)
    w.next_sequence_number()  # the count restarts at a rollover
    w.append(1, b"y" * 40)
    assert files_of(s) == [] and w.uploaded_sequence_numbers() == []
    w.append(2, b"z" * 24)  # active set now 64 bytes: uploads sets 0 and 1 without a checkpoint
    wait_until(lambda: w.uploaded_sequence_numbers() == [0, 1], what="pre-emptive upload")
    assert len(files_of(s)) == 1
    w.append(3, b"w" * 10)
    h = result(w.persist(0, 1))
    assert len(h.handles_and_offsets) == 3
    assert h.checkpointed_size == 10 and h.state_size == 114
    assert read_all(s, h) == [(0, b"x" * 40), (1, b"y" * 40), (2, b"z" * 24), (3, b"w" * 10)]


def test_preemptive_threshold_checked_once_after_append_many(make_storage):
    s = make_storage(preemptive_persist_threshold=10)
    w = s.create_writer("op", KGR)
    data = b"abcdefghijkl"
    w.append_many(np.array([0, 1, 2], dtype=np.int32), data, np.array([0, 4, 8, 12], dtype=np.int64))
    wait_until(lambda: w.uploaded_sequence_numbers() == [0], what="pre-emptive upload")
    assert len(files_of(s)) == 1  # one upload for the whole call
    h = result(w.persist(0, 1))
    assert read_all(s, h) == [(0, b"abcd"), (1, b"efgh"), (2, b"ijkl")]


def test_threshold_zero_uploads_on_every_append(make_storage):
    s = make_storage(preemptive_persist_threshold=0)
    w = s.create_writer("op", KGR)
    for i in range(3):
        w.append(i, b"v%d" % i)
    wait_until(lambda: w.uploaded_sequence_numbers() == [0, 1, 2], what="three uploads")
    h = result(w.persist(0, 1))
    assert h.checkpointed_size == 0 and len(h.handles_and_offsets) == 3


# -- §4 append errors --------------------------------------------------------------------------

def test_key_group_outside_range_is_rejected(make_storage):
    w = make_storage().create_writer("op", KeyGroupRange(10, 19))
    for kg in (9, 20, -1, 32767):
        with pytest.raises(ValueError, match="outside the writer's range"):
            w.append(kg, b"x")
    with pytest.raises(TypeError):
        w.append(10, "not bytes")
    w.append(10, bytearray(b"ok"))
    w.append(19, memoryview(b"ok2"))
    assert result(w.persist(0, 1)).state_size == 5


def test_append_many_is_all_or_nothing(make_storage):
    s = make_storage()
    w = s.create_writer("op", KeyGroupRange(0, 9))
    w.append(1, b"first")
    with pytest.raises(ValueError, match="row 2"):
        w.append_many([1, 2, 10, 3], b"aabbccdd", [0, 2, 4, 6, 8])
    with pytest.raises(ValueError):
        w.append_many([1, 2], b"aabb", [0, 2, 9])  # offset past the data
    w.append_many([3, 1], b"ccaa", [0, 2, 4])
    h = result(w.persist(0, 1))
    assert read_all(s, h) == [(1, b"first"), (1, b"aa"), (3, b"cc")]


def test_closed_writer_raises(make_storage):
    w = make_storage().create_writer("op", KGR)
    w.append(0, b"x")
    w.close()
    w.close()  # a second close does nothing
    with pytest.raises(WriterClosedError):
        w.append(0, b"y")
    with pytest.raises(WriterClosedError):
        w.append_meta(b"y")
    with pytest.raises(WriterClosedError):
        w.append_many([0], b"y", [0, 1])
    with pytest.raises(WriterClosedError):
        w.persist(0, 1)
    assert isinstance(WriterClosedError("x"), RuntimeError)
    # truncate / confirm / reset are accepted on a closed writer
    w.truncate(0)
    w.confirm(0, 0, 1)
    w.reset(0, 0, 1)


def test_writer_is_a_context_manager(make_storage):
    s = make_storage()
    with s.create_writer("op", KGR) as w:
        w.append(0, b"x")
        h = result(w.persist(0, 1))
    assert w.closed
    assert read_all(s, h) == [(0, b"x")]


# -- §6 truncate / confirm / reset / close ------------------------------------------------------

def test_truncate_releases_uploaded_files(make_storage):
    s = make_storage(batch_persist_delay="50 ms")
    w = s.create_writer("op", KGR)
    w.append(0, b"a")
    w.next_sequence_number()
    w.append(1, b"b")
    result(w.persist(0, 1))  # one file holding sets 0 and 1
    [name] = files_of(s)
    w.truncate(1)  # releases set 0: the file still holds set 1
    s.registry.wait_for_deletions(T)
    assert files_of(s) == [name]
    w.truncate(w.next_sequence_number())
    s.registry.wait_for_deletions(T)
    assert files_of(s) == []
    with pytest.raises(ValueError, match="not yet appended"):
        w.truncate(5)


def test_truncate_never_moves_lowest_back(make_storage):
    """Flink sets `lowest = to` even below an earlier truncation; a persist from the dropped range
    then waits forever for change sets that are gone. dstl keeps the highest truncation (found by
    test_writer_hotpath's random sequences)."""
    w = make_storage().create_writer("op", KGR)
    w.append_meta(b"")
    assert int(w.next_sequence_number()) == 1
    w.truncate(1)  # drops set 0
    w.truncate(0)
    assert int(w.lowest_sequence_number) == 1
    with pytest.raises(ValueError, match="already truncated"):
        w.persist(0, 1)
    assert result(w.persist(1, 1)).handles_and_offsets == []


def test_confirmed_files_are_never_deleted_by_the_writer(make_storage):
    s = make_storage()
    w = s.create_writer("op", KGR)
    w.append(0, b"a")
    nxt = w.next_sequence_number()
    h = result(w.persist(0, 1))
    w.confirm(0, nxt, 1)
    assert s.registry.ref_count(h.handles_and_offsets[0][0]) is None
    w.truncate(nxt)
    w.close()
    s.registry.wait_for_deletions(T)
    assert len(files_of(s)) == 1
    assert read_all(s, h) == [(0, b"a")]
    with pytest.raises(ValueError):
        w.confirm(0, 5, 2)


def test_confirm_range_checks(make_storage):
    w = make_storage().create_writer("op", KGR)
    w.append(0, b"a")
    w.next_sequence_number()
    with pytest.raises(ValueError):
        w.confirm(1, 0, 1)
    with pytest.raises(ValueError):
        w.confirm(0, 2, 1)
    w.confirm(0, 1, 1)  # nothing uploaded yet: fine


def test_reset_keeps_uploads_reusable(make_storage):
    s = make_storage()
    w = s.create_writer("op", KGR)
    w.append(0, b"a")
    h1 = result(w.persist(0, 1))
    w.reset(0, 1, 1)  # checkpoint 1 aborted
    h2 = result(w.persist(0, 2))
    assert h2.handles_and_offsets == h1.handles_and_offsets
    assert len(files_of(s)) == 1


def test_truncate_and_close_keeps_earlier_handles_valid(make_storage):
    s = make_storage()
    w = s.create_writer("op", KGR)
    w.append(0, b"a")
    h1 = result(w.persist(0, 1))
    w.append(1, b"b")
    h2 = result(w.persist(0, 2))
    assert len(files_of(s)) == 2
    w.truncate_and_close(1)  # releases set 1 (second file), keeps set 0
    assert w.closed
    s.registry.wait_for_deletions(T)
    assert files_of(s) == [h1.handles_and_offsets[0][0].path.rsplit("/", 1)[-1]]
    assert read_all(s, h1) == [(0, b"a")]
    assert h2.handles_and_offsets[0] == h1.handles_and_offsets[0]


def test_close_releases_nothing(make_storage):
    s = make_storage()
    w = s.create_writer("op", KGR)
    w.append(0, b"a")
    h = result(w.persist(0, 1))
    w.close()
    s.registry.wait_for_deletions(T)
    assert len(files_of(s)) == 1
    assert s.registry.ref_count(h.handles_and_offsets[0][0]) == 1


# -- upload failures -----------------------------------------------------------------------------

def _blocked_storage(make_storage, tmp_path, **options):
    """A storage whose job directory is blocked by a regular file: every upload fails with an OSError."""
    job = uuid.uuid4().hex
    base = tmp_path / "blocked"
    base.mkdir()
    (base / job).write_bytes(b"not a directory")
    s = make_storage(base_path=str(base), job_id=job, upload_retry_policy="none", **options)
    return s, base / job


def test_upload_failure_fails_every_persist_that_needed_it(make_storage, tmp_path, upload_mode):
    s, blocker = _blocked_storage(make_storage, tmp_path, batch_persist_delay="1 s")
    w = s.create_writer("op", KGR)
    w.append(0, b"a")
    futures = [w.persist(0, 1)]
    if upload_mode != "direct":
        assert not futures[0].done()
        futures.append(w.persist(0, 2))  # the set is in flight: waits for the same upload
    for f in futures:
        with pytest.raises(OSError):
            f.result(T)
    # later persists needing the failed set fail at once instead of hanging
    with pytest.raises(OSError, match="already failed") as ei:
        w.persist(0, 3)
    assert ei.value.__cause__ is not None
    hf = w.highest_failed
    assert hf is not None and int(hf[0]) == 0
    # change sets after the failed one still work once the filesystem recovers
    blocker.unlink()
    w.append(1, b"b")
    h = result(w.persist(1, 4))
    assert read_all(s, h) == [(1, b"b")]
    with pytest.raises(OSError):
        w.persist(0, 5)


def test_failed_preemptive_upload_makes_append_raise(make_storage, tmp_path):
    s, _ = _blocked_storage(make_storage, tmp_path, preemptive_persist_threshold=8,
                            batch_persist_delay="0 ms")
    w = s.create_writer("op", KGR)
    w.append(0, b"12345678")  # pre-emptive upload of set 0 fails
    wait_until(lambda: w.highest_failed is not None, what="the failure to arrive")
    w.next_sequence_number()
    w.append(1, b"1234")  # set 1: below the threshold, nothing happens
    with pytest.raises(OSError, match="already failed"):
        w.persist(0, 1)


# -- storage basics ------------------------------------------------------------------------------

def test_log_ids_count_per_storage(make_storage):
    s = make_storage()
    ws = [s.create_writer(f"op{i}", KGR) for i in range(3)]
    assert [w.log_id for w in ws] == [uuid.UUID(int=i) for i in range(3)]
    assert ws[0].key_group_range == KGR and ws[1].operator_id == "op1"


def test_storage_closed(make_storage):
    s = make_storage()
    s.close()
    s.close()
    with pytest.raises(RuntimeError):
        s.create_writer("op", KGR)


def test_concurrent_writers_and_persists(make_storage):
    s = make_storage(batch_persist_delay="2 ms")
    writers = [s.create_writer(f"op{i}", KeyGroupRange(i * 10, i * 10 + 9)) for i in range(4)]
    handles = {}
    errors = []

    def run(i, w):
        try:
            for j in range(20):
                w.append(i * 10 + j % 10, b"%d-%d" % (i, j))
                if j % 5 == 4:
                    handles[i] = result(w.persist(0, j))
        except BaseException as e:  # surfaced below
            errors.append(e)

    threads = [threading.Thread(target=run, args=(i, w)) for i, w in enumerate(writers)]
    for t in threads:
        t.start()
    for t in threads:
        t.join(60)
    assert not errors
    for i in range(4):
        got = read_all(s, handles[i])
        assert sorted(got) == sorted((i * 10 + j % 10, b"%d-%d" % (i, j)) for j in range(20))


def test_bad_argument_types(make_storage):
    s = make_storage()
    w = s.create_writer("op", KGR)
    with pytest.raises(TypeError):
        w.append("3", b"x")
    with pytest.raises(TypeError):
        w.append(1.0, b"x")
    with pytest.raises(TypeError):
        w.append(True, b"x")
    with pytest.raises(TypeError):
        w.persist(0, "1")
    with pytest.raises(ValueError):
        w.persist(-1, 1)
    with pytest.raises(TypeError):
        s.create_writer("op", (0, 5))
    w.append(np.int64(3), b"x")  # numpy integers are fine
    assert read_all(s, result(w.persist(0, 1))) == [(3, b"x")]


def test_persist_after_storage_close_fails_instead_of_hanging(make_storage):
    s = make_storage()
    w = s.create_writer("op", KGR)
    w.append(0, b"a")
    s.close()
    try:
        f = w.persist(0, 1)
    except (OSError, RuntimeError, CancelledError):
        return
    assert isinstance(f.exception(T), (OSError, RuntimeError, CancelledError))
    assert files_of(s) == []


def test_preemptively_uploaded_then_truncated_files_are_deleted(make_storage):
    s = make_storage(preemptive_persist_threshold=16)
    w = s.create_writer("op", KGR)
    w.append(0, b"x" * 20)  # pre-emptive upload, no checkpoint ever references it
    wait_until(lambda: w.uploaded_sequence_numbers() == [0], what="pre-emptive upload")
    assert len(files_of(s)) == 1
    w.truncate(w.next_sequence_number())  # e.g. a materialization covered it
    s.registry.wait_for_deletions(T)
    assert files_of(s) == []
