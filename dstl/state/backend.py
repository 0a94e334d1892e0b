"""Keyed state on the changelog: ValueState, ListState, MapState, ReducingState.

Every mutation does two things: it changes an in-memory table (key group -> state name -> key ->
value, so one key group can be snapshotted or dropped on its own) and it appends exactly one change
(`dstl.state.changes`: op byte + msgpack body) to the writer's key group. Registering a state appends
a METADATA change. Bulk methods (`update_many`, `add_many`, `put_many`) encode a whole pandas/numpy/
Arrow batch without a Python loop per row and hand the writer ONE `append_many` per batch.

Checkpoints: `snapshot(cp)` persists the log from the sqn of the last materialization and returns a
Future of a `KeyedStateSnapshot` (materialized handles + the changelog handle since then); `confirm`
hands that range to the checkpoint and truncates what a confirmed materialization made obsolete;
`abort` resets. `restore` rebuilds a backend for any key-group range from the snapshots of all old
subtasks (any old parallelism, docs/rescaling.md §6).

Log segments are self-describing: each segment a checkpoint can reference (from sqn 0, from a
materialization, from a restore) starts with the METADATA changes of every state, because state ids
are per log. After a restore the old handles (intersected with the new range) are kept as the new
backend's base and included in every snapshot until the next materialization, as Flink does with
restored state (`materialize_on_restore=True` materializes at once instead).

A backend is not thread-safe: use it from one thread (the task thread), as in Flink.
"""
from __future__ import annotations

import logging
from concurrent.futures import Future
from typing import Any, Callable, Dict, List, Optional, Sequence

import numpy as np

from dstl import _impl
from dstl.state import changes as C
from dstl.state.columns import Column
from dstl.state.serializers import resolve_serializer
from dstl.types import KeyGroupRange
from dstl.state.base import _State
from dstl.state.kinds import kind_class
from dstl.state.list import ListState
from dstl.state.map import MapState
from dstl.state.restore import replay_snapshots
from dstl.state.snapshot import KeyedStateSnapshot
from dstl.state import ttl as T
from dstl.state.value import ReducingState, ValueState

_keyed = _impl.kernel("_keyed")

log = logging.getLogger(__name__)

__all__ = ["KeyedStateBackend", "KeyedStateSnapshot", "ValueState", "ListState", "MapState",
           "ReducingState"]

_MAX_PARALLELISM = 32768
_INTERVAL_MAX = 2**62  # a materialization interval beyond it is never reached (the kernel's int64)


class _Pending:
    __slots__ = ("mat", "start", "end")

    def __init__(self, mat, start, end):
        self.mat, self.start, self.end = mat, start, end


class KeyedStateBackend:
    """The keyed state of one operator subtask (one key-group range), backed by a changelog writer.

    `materialize_every_changes` / `materialize_every_bytes`: materialize automatically once that many
    changes / payload bytes were logged since the last materialization (checked after each mutation
    or batch). `serializer`: default value serializer (msgpack).
    """

    def __init__(self, storage, operator_id: str, key_group_range: KeyGroupRange, max_parallelism: int, *,
                 materialize_every_changes: Optional[int] = None, materialize_every_bytes: Optional[int] = None,
                 serializer: Any = None, ttl_clock: Optional[Callable[[], int]] = None):
        if isinstance(max_parallelism, bool) or not isinstance(max_parallelism, (int, np.integer)):
            raise TypeError(f"max_parallelism must be an int, got {type(max_parallelism).__name__}")
        max_parallelism = int(max_parallelism)
        if not 1 <= max_parallelism <= _MAX_PARALLELISM:
            raise ValueError(f"max_parallelism must be in 1..{_MAX_PARALLELISM}, got {max_parallelism}")
        if not isinstance(key_group_range, KeyGroupRange):
            raise TypeError(f"key_group_range must be a KeyGroupRange, got {type(key_group_range).__name__}")
        if key_group_range.is_empty() or key_group_range.end >= max_parallelism:
            raise ValueError(f"key_group_range {key_group_range} must be non-empty and within "
                             f"0..{max_parallelism - 1} (max_parallelism {max_parallelism})")
        for name, v in (("materialize_every_changes", materialize_every_changes),
                        ("materialize_every_bytes", materialize_every_bytes)):
            if v is not None and (isinstance(v, bool) or not isinstance(v, int) or v <= 0):
                raise ValueError(f"{name} must be a positive int or None, got {v!r}")
        self.storage = storage
        self.operator_id = operator_id
        self.key_group_range = key_group_range
        self.max_parallelism = max_parallelism
        self.default_serializer = resolve_serializer(serializer)
        self._kg_start = key_group_range.start
        self._kg_end = key_group_range.end
        self._writer = storage.create_writer(operator_id, key_group_range)
        # the single-key path (key group, payload, append, counters) in one kernel call per change
        self._k = _keyed.KeyedAppender(self, self._writer.append, max_parallelism, key_group_range)
        self._kg = self._k.kg  # key -> key group with the checks below (kernel: no Python frame)
        self.materialize_every_changes = materialize_every_changes
        self.materialize_every_bytes = materialize_every_bytes
        self._table: Dict[int, Dict[str, dict]] = {}
        self._states: Dict[str, _State] = {}
        self._next_sid = 0
        # materialization bookkeeping (see materialize.py)
        self._mat = None                  # current Materialization (or the restored base), or None
        self._old_mats: List[Any] = []    # superseded ones, discarded once a newer one is confirmed
        self._mat_counter = 0
        self._truncated_mat_id = -1
        self._pending: Dict[int, _Pending] = {}
        self._since_changes = 0
        self._since_bytes = 0
        self._materializing = False
        self._closed = False
        self.restore_stats: Dict[str, int] = {}
        self.materializations = 0
        #: milliseconds "now" for TTL states (dstl.state.ttl); settable (StatefulStream: the batch time)
        self.ttl_clock: Callable[[], int] = ttl_clock or T.wall_clock_ms

    # -- keys and appends -----------------------------------------------------------------------
    # `self._kg(key)` is the kernel's: TypeError unless the key is an int, str or bytes (numpy ints are
    # refused with a hint), ValueError when its key group is outside this backend's range.

    @property
    def _writer(self):
        return self._writer_obj

    @_writer.setter
    def _writer(self, writer) -> None:
        self._writer_obj = writer
        k = self.__dict__.get("_k")
        if k is not None:  # the kernel appends through the writer's bound append: keep it in step
            k.writer_append = writer.append

    # changes and payload bytes logged since the last materialization: the kernel counts them
    @property
    def _since_changes(self) -> int:
        return self._k.changes

    @_since_changes.setter
    def _since_changes(self, value: int) -> None:
        self._k.changes = value

    @property
    def _since_bytes(self) -> int:
        return self._k.nbytes

    @_since_bytes.setter
    def _since_bytes(self, value: int) -> None:
        self._k.nbytes = value

    # the materialization interval and the deferred append error live in the kernel too, so that a
    # bound ValueState.update checks them in C and calls _mutated only when there is something to do
    @property
    def materialize_every_changes(self) -> Optional[int]:
        return self._k.every_changes or None

    @materialize_every_changes.setter
    def materialize_every_changes(self, value: Optional[int]) -> None:
        self._k.every_changes = min(value, _INTERVAL_MAX) if value else 0

    @property
    def materialize_every_bytes(self) -> Optional[int]:
        return self._k.every_bytes or None

    @materialize_every_bytes.setter
    def materialize_every_bytes(self, value: Optional[int]) -> None:
        self._k.every_bytes = min(value, _INTERVAL_MAX) if value else 0

    @property
    def _deferred_error(self) -> Optional[BaseException]:
        """An OSError of an append whose change was taken (raised by the next `_mutated`)."""
        return self._k.deferred_error

    @_deferred_error.setter
    def _deferred_error(self, exc: Optional[BaseException]) -> None:
        self._k.deferred_error = exc

    def _check_kgs(self, kgs: np.ndarray, col: Column) -> None:
        if kgs.size:
            bad = (kgs < self._kg_start) | (kgs > self._kg_end)
            if bad.any():
                row = int(np.argmax(bad))
                key = col.tolist()[row]
                raise ValueError(f"row {row}: key {key!r} belongs to key group {int(kgs[row])}, outside this "
                                 f"backend's range {self.key_group_range}")

    def _append(self, kg: int, payload: bytes) -> None:
        # an OSError of the append means the change is in the log (a pre-emptive upload failed
        # afterwards, SEMANTICS §4.5): the kernel keeps it in _deferred_error, so the caller applies
        # the change in memory too, and _mutated() raises it
        self._k.append(kg, payload)

    def _append_many(self, kgs: np.ndarray, data: np.ndarray, offsets: np.ndarray) -> None:
        self._check_open()
        try:
            self._writer.append_many(np.ascontiguousarray(kgs, dtype=np.int32), data, offsets)
        except OSError as exc:
            self._deferred_error = exc
        self._since_changes += len(kgs)
        self._since_bytes += int(offsets[-1] - offsets[0])

    def _mutated(self, n: int = 1) -> None:
        """After the in-memory table changed: raise a deferred append error, else materialize if
        the interval is reached."""
        k = self._k
        if not k.due():
            return
        exc = k.deferred_error
        if exc is not None:
            k.deferred_error = None
            raise exc
        if not self._materializing:
            self.materialize()

    def _check_open(self) -> None:
        if self._closed:
            raise RuntimeError(f"keyed state backend {self.operator_id!r} {self.key_group_range} is closed")

    # -- registration ---------------------------------------------------------------------------
    def _register(self, name: str, kind: str, serializer: Any, options: Dict[str, Any]) -> _State:
        self._check_open()
        ser = resolve_serializer(serializer) if serializer is not None else self.default_serializer
        existing = self._states.get(name)
        if existing is not None:
            m = existing.meta
            if m.kind != kind:
                raise ValueError(f"state {name!r} is already registered as {m.kind} state, not {kind}")
            if m.serializer_id != ser.id and serializer is not None:
                raise ValueError(f"state {name!r} uses serializer {m.serializer_id!r}, not {ser.id!r}")
            if m.options != options:
                raise ValueError(f"state {name!r} is registered with options {m.options}, not {options}")
            return existing
        meta = C.StateMeta(self._next_sid, name, kind, ser.id, options)
        self._next_sid += 1
        self._writer.append_meta(C.encode_meta(meta))
        state = self._new_state(kind, meta, ser)
        self._states[name] = state
        return state

    def _new_state(self, kind: str, meta: C.StateMeta, serializer: Any) -> _State:
        return kind_class(kind)(self, meta, serializer)

    def value_state(self, name: str, serializer: Any = None, ttl_ms: Optional[int] = None) -> ValueState:
        """Get or register a ValueState (one METADATA change on first registration).

        `ttl_ms`: values expire that long after their last update (processing time, `ttl_clock`);
        the result is then a `dstl.state.ttl.TtlValueState` view."""
        return self._with_ttl(name, "value", serializer, {}, ttl_ms)

    def list_state(self, name: str, serializer: Any = None, max_length: Optional[int] = None,
                   ttl_ms: Optional[int] = None) -> ListState:
        """Get or register a ListState; `max_length` keeps only the last N elements per key;
        `ttl_ms`: each element expires that long after it was written (a TtlListState view)."""
        if max_length is not None and (isinstance(max_length, bool) or not isinstance(max_length, int)
                                       or max_length <= 0):
            raise ValueError(f"max_length must be a positive int or None, got {max_length!r}")
        return self._with_ttl(name, "list", serializer, {} if max_length is None else {"max_length": max_length},
                              ttl_ms)

    def map_state(self, name: str, serializer: Any = None, ttl_ms: Optional[int] = None) -> MapState:
        """Get or register a MapState (the serializer applies to map values); `ttl_ms`: each entry
        expires that long after its last put (a TtlMapState view)."""
        return self._with_ttl(name, "map", serializer, {}, ttl_ms)

    def _with_ttl(self, name: str, kind: str, serializer: Any, options: Dict[str, Any], ttl_ms: Any):
        ttl_ms = T.check_ttl(ttl_ms)
        if ttl_ms is None:
            return self._register(name, kind, serializer, options)
        raw = self._register(name, kind, serializer, dict(options, **{T.TTL_OPTION: True}))
        return raw.with_ttl(ttl_ms, lambda: self.ttl_clock())

    def reducing_state(self, name: str, reduce_fn: Callable[[Any, Any], Any], serializer: Any = None) -> ReducingState:
        """Get or register a ReducingState (re-registering after a restore attaches `reduce_fn`)."""
        if not callable(reduce_fn):
            raise TypeError("reduce_fn must be callable")
        state = self._register(name, "reducing", serializer, {})
        state.reduce_fn = reduce_fn
        return state

    @property
    def state_names(self) -> List[str]:
        return list(self._states)

    def get_state(self, name: str) -> _State:
        """A registered (or restored) state by name."""
        try:
            return self._states[name]
        except KeyError:
            raise KeyError(f"no state named {name!r} (registered: {sorted(self._states)})") from None

    def key_groups(self) -> List[int]:
        """Key groups that hold any state."""
        return sorted(kg for kg, t in self._table.items() if any(t.values()))

    # -- checkpoints ----------------------------------------------------------------------------
    def snapshot(self, checkpoint_id: int) -> "Future[KeyedStateSnapshot]":
        """Persist the log since the last materialization; Future of the checkpoint's snapshot."""
        self._check_open()
        checkpoint_id = int(checkpoint_id)
        if checkpoint_id < 0:
            raise ValueError(f"checkpoint_id must be >= 0, got {checkpoint_id}")
        if checkpoint_id in self._pending:
            raise ValueError(f"checkpoint {checkpoint_id} was already snapshotted")
        try:
            mat, start, end, persisted = self._persist(checkpoint_id)
        except OSError:
            if self._writer.highest_failed is None:
                raise
            # an upload of this log segment failed, so it cannot be persisted any more; the state in
            # memory is complete, so materialize it and persist the fresh segment after it
            log.warning("%s %s: changelog upload failed earlier; materializing before checkpoint %d",
                        self.operator_id, self.key_group_range, checkpoint_id)
            self.materialize(force=True)
            mat, start, end, persisted = self._persist(checkpoint_id)
        self._pending[checkpoint_id] = _Pending(mat, start, end)
        handles = list(mat.handles) if mat is not None else []
        kgr, maxp = self.key_group_range, self.max_parallelism
        out: Future = Future()

        def done(f: Future) -> None:
            exc = f.exception()
            if exc is not None:
                out.set_exception(exc)
                return
            h = f.result().job_manager_owned_snapshot
            changelog = h if h is not None and len(h.handles_and_offsets) else None
            out.set_result(KeyedStateSnapshot(kgr, handles, changelog, maxp, checkpoint_id))

        persisted.add_done_callback(done)
        return out

    def _persist(self, checkpoint_id: int):
        mat = self._mat
        start = mat.sqn if mat is not None else self._writer.initial_sequence_number()
        end = self._writer.next_sequence_number()
        return mat, start, end, self._writer.persist(start, checkpoint_id)

    def confirm(self, checkpoint_id: int) -> None:
        """The checkpoint completed: it owns its files now; drop what it made obsolete."""
        rec = self._pending.pop(int(checkpoint_id), None)
        if rec is None:
            log.debug("confirm of unknown or already settled checkpoint %s", checkpoint_id)
            return
        for cp in [c for c in self._pending if c < checkpoint_id]:  # subsumed
            del self._pending[cp]
        self._writer.confirm(rec.start, rec.end, checkpoint_id)
        mat = rec.mat
        if mat is None:
            return
        mat.confirm(checkpoint_id)
        if mat.id > self._truncated_mat_id:
            # everything logged before this materialization is now covered by it
            self._writer.truncate(rec.start)
            self._truncated_mat_id = mat.id
            keep = []
            for old in self._old_mats:
                if old.id < mat.id:
                    old.discard()
                else:
                    keep.append(old)
            self._old_mats = keep

    def abort(self, checkpoint_id: int) -> None:
        """The checkpoint failed: forget it (uploaded change sets stay reusable)."""
        rec = self._pending.pop(int(checkpoint_id), None)
        if rec is not None:
            self._writer.reset(rec.start, rec.end, checkpoint_id)

    def materialize(self, force: bool = False) -> None:
        """Write a compact snapshot of all state per key group; see dstl.state.materialize.

        A no-op when nothing changed since the last materialization, unless `force`."""
        from dstl.state.materialize import materialize

        self._check_open()
        T.purge_expired(self, self.ttl_clock())  # expired TTL values are not carried into the snapshot
        materialize(self, force=force)

    # -- restore --------------------------------------------------------------------------------
    @classmethod
    def restore(cls, storage, operator_id: str, key_group_range: KeyGroupRange, max_parallelism: int,
                snapshots: Sequence[KeyedStateSnapshot], *, serializers: Optional[Dict[str, Any]] = None,
                materialize_on_restore: bool = False, **kw: Any) -> "KeyedStateBackend":
        """A backend for `key_group_range` rebuilt from the snapshots of all old subtasks.

        Metadata changes are replayed from every handle (idempotent); data changes only for key
        groups in range. `serializers` maps serializer ids to objects (besides the registered ones).
        The old handles stay part of this backend's snapshots until the next materialization
        (immediately, with `materialize_on_restore=True`).
        """
        from dstl.state.materialize import Materialization

        backend = cls(storage, operator_id, key_group_range, max_parallelism, **kw)
        try:
            base = replay_snapshots(backend, snapshots, serializers or {})
            backend._mat = Materialization.restored(base, backend._writer.initial_sequence_number())
            # the restored log counts towards the interval: a subtask restored at every batch (moved,
            # or its worker restarted) must still materialize, or its log and restore time grow forever
            backend._since_changes = backend.restore_stats["log_changes"]
            backend._since_bytes = backend.restore_stats["log_bytes"]
            if materialize_on_restore:
                backend.materialize()
        except BaseException:
            backend.close()
            raise
        return backend

    # -- lifecycle ------------------------------------------------------------------------------
    @property
    def writer(self):
        return self._writer

    @property
    def closed(self) -> bool:
        return self._closed

    def close(self) -> None:
        """Close the writers (releases nothing: persisted handles stay valid). Idempotent."""
        if self._closed:
            return
        self._closed = True
        self._k.closed = True
        self._writer.close()
        for m in [self._mat] + self._old_mats:
            if m is not None:
                m.close()
        self._table.clear()

    def __enter__(self) -> "KeyedStateBackend":
        return self

    def __exit__(self, *exc) -> None:
        self.close()

    def __repr__(self) -> str:
        return (f"KeyedStateBackend({self.operator_id!r}, {self.key_group_range}, max_parallelism="
                f"{self.max_parallelism}, states={sorted(self._states)})")
