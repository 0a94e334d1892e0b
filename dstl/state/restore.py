"""Restore of a keyed-state backend: replay the old subtasks' snapshots, filtered to its key groups.

Metadata changes are replayed from every handle (state ids are per log); data changes only for the
key groups in range; KEY_GROUP_SNAPSHOT changes (materializations) are merged into the table.
The backend is reached through `RestoreTarget`, so this module sits below dstl.state.backend.
"""
from __future__ import annotations

from typing import Any, Dict, List, Optional, Protocol, Sequence

from dstl.errors import CorruptChangelogError
from dstl.state import changes as C
from dstl.state.base import _State
from dstl.state.host import StateHost
from dstl.state.serializers import get_serializer, unpackb
from dstl.state.snapshot import KeyedStateSnapshot


class RestoreTarget(StateHost, Protocol):
    """The backend as the replay sees it: a state host that also registers states and owns a writer."""

    storage: Any
    restore_stats: Dict[str, int]
    _states: Dict[str, _State]
    _next_sid: int
    _writer: Any

    def _new_state(self, kind: str, meta: C.StateMeta, serializer: Any) -> _State:
        """A state object of `kind` bound to this backend (not yet registered)."""


def replay_snapshots(backend: RestoreTarget, snapshots: Sequence[KeyedStateSnapshot], serializers: Dict[str, Any]) -> List[Any]:
    # log_changes / log_bytes: the restored data changes that are not materialized key-group
    # snapshots, i.e. what was logged since the last materialization; the backend counts it on
    stats = {"handles": 0, "change_sets": 0, "changes_read": 0, "changes_applied": 0,
             "meta_changes": 0, "bytes_read": 0, "log_changes": 0, "log_bytes": 0}
    backend.restore_stats = stats
    reader = backend.storage.create_reader()
    base: List[Any] = []
    for snap in snapshots:
        if not isinstance(snap, KeyedStateSnapshot):
            raise TypeError(f"expected KeyedStateSnapshot objects, got {type(snap).__name__}")
        if snap.max_parallelism is not None and snap.max_parallelism != backend.max_parallelism:
            raise ValueError(f"snapshot was taken with max_parallelism {snap.max_parallelism}; a restore "
                             f"must use the same value, not {backend.max_parallelism}")
        for handle in snap.handles():
            part = handle.get_intersection(backend.key_group_range)
            if part is None:
                continue
            base.append(part)
            _replay_handle(backend, reader, part, serializers, stats)
    # this backend's own log starts backend-described
    for state in backend._states.values():
        backend._writer.append_meta(C.encode_meta(state.meta))
    return base

def _replay_handle(backend: RestoreTarget, reader, handle, serializers: Dict[str, Any], stats: Dict[str, int]) -> None:
    local: Dict[int, _State] = {}   # state ids are per log
    stats["handles"] += 1
    META, KG_SNAPSHOT, names = C.METADATA, C.KEY_GROUP_SNAPSHOT, C.OP_NAMES
    applied = meta_changes = snapshots = 0
    read = not_logged = 0           # payload bytes: all, and those of metadata and snapshots
    cur_kg: Optional[int] = None    # key group whose per-state tables are cached in `cur`
    cur: Dict[Any, dict] = {}
    it = reader.get_changes_arrays(handle)
    try:
        for buf, kgs, offs, lens in it:
            stats["change_sets"] += 1
            stats["changes_read"] += len(kgs)
            read += int(lens.sum())
            view = buf if isinstance(buf, (bytes, memoryview)) else memoryview(buf)
            for kg, off, ln in zip(kgs.tolist(), offs.tolist(), lens.tolist()):
                if ln == 0:
                    raise CorruptChangelogError("empty state change payload", off)
                op = view[off]
                if op not in names:
                    raise CorruptChangelogError(f"unknown state change operation code {op}", off)
                try:
                    body = unpackb(view[off + 1:off + ln])
                except Exception as exc:  # msgpack raises several unrelated types
                    raise CorruptChangelogError(f"undecodable {names[op]} change body: {exc}", off) from exc
                if op == META:
                    meta_changes += 1
                    not_logged += ln
                    meta = C.decode_meta(body)
                    local[meta.state_id] = _restore_meta(backend, meta, serializers)
                    continue
                applied += 1
                if op == KG_SNAPSHOT:
                    snapshots += 1
                    not_logged += ln
                    cur_kg = None
                    _apply_kg_snapshot(backend, kg, body, local)
                    continue
                try:
                    state = local[body[0]]
                except (KeyError, TypeError, IndexError):
                    raise CorruptChangelogError(
                        f"{names[op]} change refers to state id {body[0] if body else None!r} "
                        f"without a preceding METADATA change", off) from None
                if op in state._fast_ops:
                    # hot path (value/reducing state, msgpack values): no method calls per change
                    if kg != cur_kg:
                        cur_kg, cur = kg, {}
                    tbl = cur.get(state)
                    if tbl is None:
                        tbl = cur[state] = state._table(kg)
                    tbl[body[1]] = body[2]
                    continue
                cur_kg = None  # other ops may create/replace per-key-group tables
                state._apply(op, kg, body)
    finally:
        it.close()
        stats["changes_applied"] += applied
        stats["meta_changes"] += meta_changes
        stats["bytes_read"] += read
        stats["log_changes"] += applied - snapshots
        stats["log_bytes"] += read - not_logged

def _restore_meta(backend: RestoreTarget, meta: C.StateMeta, serializers: Dict[str, Any]) -> _State:
    existing = backend._states.get(meta.name)
    if existing is not None:
        if not existing.meta.same_definition(C.StateMeta(existing.meta.state_id, meta.name, meta.kind,
                                                         meta.serializer_id, meta.options)):
            raise ValueError(f"state {meta.name!r} is defined differently in two snapshots: "
                             f"{existing.meta} vs {meta}")
        return existing
    ser = get_serializer(meta.serializer_id, serializers)
    own = C.StateMeta(backend._next_sid, meta.name, meta.kind, meta.serializer_id, meta.options)
    backend._next_sid += 1
    state = backend._new_state(meta.kind, own, ser)
    backend._states[meta.name] = state
    return state

def _apply_kg_snapshot(backend: RestoreTarget, kg: int, body: Any, local: Dict[int, _State]) -> None:
    if kg < 0:
        raise CorruptChangelogError("KEY_GROUP_SNAPSHOT change in the metadata group", 0)
    t = backend._table.setdefault(kg, {})
    for sid, entries in body:
        state = local.get(sid)
        if state is None:
            raise CorruptChangelogError(f"key-group snapshot refers to unknown state id {sid!r}", 0)
        restore = state._restore_value
        # merge: a big key group comes as several changes (materialize.CHUNK_ENTRIES)
        dst = t.get(state.name)
        if dst is None:
            dst = t[state.name] = {}
        dst.update({k: restore(w) for k, w in entries.items()})
