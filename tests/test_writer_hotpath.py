"""The writer's append path (WriterCore): the Cython class and its twin side by side in one process.

Both must give the same sequence numbers, handles, errors and byte-identical files for any mix of
append / append_meta / append_many / next_sequence_number / persist / truncate.
"""
from __future__ import annotations

import os
import re
import threading
import types

import numpy as np
import pytest
from hypothesis import HealthCheck, given, settings, strategies as st

from dstl.changelog import storage as storage_mod
from dstl.changelog.storage import open_storage
from dstl.changelog.writer import FsStateChangelogWriter
from dstl.types import KeyGroupRange

from conftest import expected_implementation
from dstl._fast import _writer_py

KGR = KeyGroupRange(0, 15)
T = 20


def _writer_class(core):
    """FsStateChangelogWriter's methods over `core` (a WriterCore implementation)."""
    body = {k: v for k, v in FsStateChangelogWriter.__dict__.items() if k not in ("__dict__", "__weakref__")}
    return types.new_class(f"FsStateChangelogWriter_{core.__module__.rsplit('.', 1)[-1]}", (core,),
                           exec_body=lambda ns: ns.update(body))


def _cores():
    cores = [("python", _writer_py.WriterCore)]
    try:
        from dstl._fast import _writer
    except ImportError:
        if expected_implementation() == "cython":
            raise
    else:
        cores.append(("cython", _writer.WriterCore))
    return cores


CORES = _cores()
WRITERS = {name: _writer_class(core) for name, core in CORES}
needs_both = pytest.mark.skipif(len(CORES) < 2, reason="the Cython extension is not built")


def test_the_writer_uses_the_selected_core():
    from dstl import format as fmt

    assert issubclass(FsStateChangelogWriter, fmt.WriterCore)
    assert fmt.WriterCore is dict(CORES)[fmt.IMPLEMENTATION]


class _Storage:
    """A direct-mode storage whose writers use the given core."""

    def __init__(self, base, impl, monkeypatch, **options):
        options.setdefault("upload_mode", "direct")
        self.storage = open_storage(str(base), job_id="0" * 32, **options)
        self.impl = impl
        self.monkeypatch = monkeypatch

    def writer(self, kgr=KGR):
        self.monkeypatch.setattr(storage_mod, "FsStateChangelogWriter", WRITERS[self.impl])
        try:
            return self.storage.create_writer("op", kgr)
        finally:
            self.monkeypatch.undo()

    def close(self):
        self.storage.close()


def _handle_shape(handle):
    """A handle without its file names: entries as (file bytes, offset, logical size)."""
    out = []
    for stream, offset in handle.handles_and_offsets:
        with open(stream.path, "rb") as f:
            out.append((f.read(), offset, stream.size))
    return out, handle.state_size, handle.checkpointed_size, handle.key_group_range


def _read(storage, handle):
    with storage.create_reader().get_changes(handle) as it:
        return [(c.key_group, c.data) for c in it]


def _error(exc, writer):
    return type(exc), str(exc).replace(str(writer.log_id), "<log>")


# -- byte-identical files --------------------------------------------------------------------------

def _records(n, seed):
    rng = np.random.default_rng(seed)
    kgs = rng.integers(0, 16, n).astype(np.int32)
    lens = rng.integers(0, 40, n)
    offs = np.concatenate([[0], np.cumsum(lens)]).astype(np.int64)
    data = rng.integers(0, 256, int(offs[-1]), dtype=np.uint8).tobytes()
    return kgs, data, offs


def _drive(w, mode, kgs, data, offs):
    n = len(kgs)
    if mode == "append":
        for i in range(n):
            w.append(int(kgs[i]), data[offs[i]:offs[i + 1]])
    elif mode == "append_many":
        for s in range(0, n, 97):
            e = min(n, s + 97)
            w.append_many(kgs[s:e], data[offs[s]:offs[e]], offs[s:e + 1] - offs[s])
    else:  # mixed, with metadata and bytes-like values of several kinds
        for s in range(0, n, 50):
            e = min(n, s + 50)
            if (s // 50) % 2:
                w.append_many(kgs[s:e], data[offs[s]:offs[e]], offs[s:e + 1] - offs[s])
            else:
                for i in range(s, e):
                    v = data[offs[i]:offs[i + 1]]
                    w.append(np.int64(kgs[i]) if i % 3 == 0 else int(kgs[i]), bytearray(v) if i % 5 == 0 else v)
            w.append_meta(memoryview(b"meta-%d" % s))


@pytest.mark.parametrize("mode", ["append", "append_many", "mixed"])
@pytest.mark.parametrize("compression", [None, "zstd"])
def test_files_are_byte_identical_in_both_implementations(tmp_path, monkeypatch, mode, compression):
    kgs, data, offs = _records(2000, seed=7)
    shapes, reads = {}, {}
    for impl, _ in CORES:
        st_ = _Storage(tmp_path / impl, impl, monkeypatch, preemptive_persist_threshold="4 kb",
                       compression_enabled=compression is not None, compression_codec=compression or "snappy")
        try:
            w = st_.writer()
            _drive(w, mode, kgs, data, offs)
            h = w.persist(0, 1).result(T).job_manager_owned_snapshot
            shapes[impl] = _handle_shape(h)
            reads[impl] = _read(st_.storage, h)
        finally:
            st_.close()
    expected = [(int(kgs[i]), data[offs[i]:offs[i + 1]]) for i in range(len(kgs))]
    for impl in reads:
        assert sorted(x for x in reads[impl] if x[0] >= 0) == sorted(expected)
        assert len(shapes[impl][0]) > 5  # pre-emptive persists made several change sets
    if len(shapes) == 2:
        assert shapes["python"] == shapes["cython"]
        assert reads["python"] == reads["cython"]


def test_append_loop_and_append_many_give_the_same_bytes(tmp_path, monkeypatch):
    kgs, data, offs = _records(1500, seed=3)
    for impl, _ in CORES:
        bodies = []
        for mode in ("append", "append_many"):
            st_ = _Storage(tmp_path / f"{impl}-{mode}", impl, monkeypatch)
            try:
                w = st_.writer()
                _drive(w, mode, kgs, data, offs)
                bodies.append(_handle_shape(w.persist(0, 1).result(T).job_manager_owned_snapshot))
            finally:
                st_.close()
        assert bodies[0] == bodies[1]


# -- errors ----------------------------------------------------------------------------------------

def _errors_of(w):
    out = []
    for call in (lambda: w.append(True, b"x"), lambda: w.append("3", b"x"), lambda: w.append(1.0, b"x"),
                 lambda: w.append(16, b"x"), lambda: w.append(-1, b"x"), lambda: w.append(2**70, b"x"),
                 lambda: w.append(np.int32(99), b"x"), lambda: w.append(3, "text"), lambda: w.append(3, 42),
                 lambda: w.append(3, None), lambda: w.append_meta("text"), lambda: w.append_meta(object())):
        try:
            call()
            out.append(None)
        except Exception as exc:  # compared below, type and message
            out.append(_error(exc, w))
    w.close()
    for call in (lambda: w.append(3, b"x"), lambda: w.append_meta(b"x"), lambda: w.append(99, "bad")):
        try:
            call()
            out.append(None)
        except Exception as exc:
            out.append(_error(exc, w))
    return out


def test_errors_are_the_same_in_both_implementations(tmp_path, monkeypatch):
    got = {}
    for impl, _ in CORES:
        st_ = _Storage(tmp_path / impl, impl, monkeypatch)
        try:
            got[impl] = _errors_of(st_.writer())
        finally:
            st_.close()
    for errs in got.values():
        assert None not in errs
        assert errs[3] == (ValueError, "key group 16 is outside the writer's range KeyGroupRange(0, 15)")
        assert errs[0] == (TypeError, "key_group must be an int, got bool")
        assert [e[0].__name__ for e in errs[-3:]] == ["WriterClosedError"] * 3
    if len(got) == 2:
        assert got["python"] == got["cython"]


# -- concurrency: detected, never interleaved ------------------------------------------------------

@pytest.mark.parametrize("impl", [name for name, _ in CORES])
def test_append_from_a_second_thread_during_a_preemptive_persist_is_refused(tmp_path, monkeypatch, impl):
    st_ = _Storage(tmp_path, impl, monkeypatch, preemptive_persist_threshold="10 b")
    try:
        w = st_.writer()
        inside, release = threading.Event(), threading.Event()
        original = type(w)._preemptive

        def slow_preemptive(self):
            inside.set()
            assert release.wait(T)
            original(self)

        monkeypatch.setattr(type(w), "_preemptive", slow_preemptive)
        first = threading.Thread(target=w.append, args=(1, b"0123456789"))
        first.start()
        assert inside.wait(T)
        with pytest.raises(RuntimeError, match="not thread-safe"):
            w.append(2, b"other thread")
        with pytest.raises(RuntimeError, match="not thread-safe"):
            w.append_meta(b"other thread")
        release.set()
        first.join(T)
        monkeypatch.setattr(type(w), "_preemptive", original)
        w.append(3, b"after")  # the writer works on once the persist is over
        h = w.persist(0, 1).result(T).job_manager_owned_snapshot
        assert _read(st_.storage, h) == [(1, b"0123456789"), (3, b"after")]
    finally:
        st_.close()


@pytest.mark.parametrize("impl", [name for name, _ in CORES])
def test_same_thread_reentry_from_a_callback_is_allowed(tmp_path, monkeypatch, impl):
    """An append made on the appending thread inside its own pre-emptive persist (e.g. from a future's
    callback in direct mode) is not a concurrent append."""
    st_ = _Storage(tmp_path, impl, monkeypatch, preemptive_persist_threshold="10 b")
    try:
        w = st_.writer()
        original = type(w)._preemptive
        nested = []

        def preemptive(self):
            if not nested:
                nested.append(1)
                self.append_meta(b"nested")
            original(self)

        monkeypatch.setattr(type(w), "_preemptive", preemptive)
        w.append(1, b"0123456789")
        monkeypatch.setattr(type(w), "_preemptive", original)
        h = w.persist(0, 1).result(T).job_manager_owned_snapshot
        assert sorted(_read(st_.storage, h)) == [(-1, b"nested"), (1, b"0123456789")]
    finally:
        st_.close()


# -- random operation sequences ------------------------------------------------------------------

_op = st.one_of(
    st.tuples(st.just("append"), st.integers(-2, 17), st.binary(max_size=30)),
    st.tuples(st.just("meta"), st.binary(max_size=30)),
    st.tuples(st.just("many"), st.lists(st.tuples(st.integers(0, 15), st.binary(max_size=20)), max_size=8)),
    st.tuples(st.just("nsn")),
    st.tuples(st.just("persist"), st.integers(0, 6)),
    st.tuples(st.just("truncate"), st.integers(0, 6)),
)


def _run_ops(w, storage, ops):
    """Apply `ops`; returns what every call gave (values, error types and messages, handle shapes)."""
    out = []
    for op in ops:
        try:
            if op[0] == "append":
                w.append(op[1], op[2])
                r = None
            elif op[0] == "meta":
                w.append_meta(op[1])
                r = None
            elif op[0] == "many":
                kgs = np.array([kg for kg, _ in op[1]], dtype=np.int32)
                data = b"".join(d for _, d in op[1])
                offs = np.concatenate([[0], np.cumsum([len(d) for _, d in op[1]])]).astype(np.int64)
                w.append_many(kgs, data, offs)
                r = None
            elif op[0] == "nsn":
                r = int(w.next_sequence_number())
            elif op[0] == "persist":
                h = w.persist(op[1], len(out) + 1).result(T).job_manager_owned_snapshot
                r = (_handle_shape(h), _read(storage, h))
            else:
                w.truncate(op[1])
                r = int(w.lowest_sequence_number)
        except TimeoutError:  # a persist that never settles is a bug in both, not a result to compare
            raise
        except Exception as exc:  # compared between the implementations
            r = _error(exc, w)
        out.append((op[0], r, w.active_size, w.uploaded_sequence_numbers(), w.not_uploaded_sequence_numbers()))
    return out


@needs_both
@settings(max_examples=40, deadline=None, suppress_health_check=[HealthCheck.function_scoped_fixture])
@given(ops=st.lists(_op, max_size=25), threshold=st.sampled_from(["1 b", "64 b", "1 mb"]))
def test_random_operation_sequences_agree(tmp_path_factory, monkeypatch, ops, threshold):
    base = tmp_path_factory.mktemp("ops")
    results = {}
    for impl, _ in CORES:
        st_ = _Storage(base / impl, impl, monkeypatch, preemptive_persist_threshold=threshold)
        try:
            results[impl] = _run_ops(st_.writer(), st_.storage, ops)
        finally:
            st_.close()
    assert results["python"] == results["cython"]


def test_twin_writer_class_is_complete():
    """The side-by-side writer classes carry every method of the real one."""
    for cls in WRITERS.values():
        for name, value in FsStateChangelogWriter.__dict__.items():
            if callable(value) and not name.startswith("__"):
                assert getattr(cls, name) is value
    assert re.match(r"FsStateChangelogWriter_", WRITERS["python"].__name__)
    assert os.path.basename(__file__).startswith("test_")
