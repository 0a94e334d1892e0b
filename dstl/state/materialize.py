"""Materialization: keep replay bounded by writing a compact snapshot of the whole keyed state.

`materialize(backend)`:
1. encodes, per key group, the whole state of that key group as one change (KEY_GROUP_SNAPSHOT:
   `[[state_id, {key: value}], ...]`; a key group of more than CHUNK_ENTRIES keys becomes several
   changes, merged on restore), so a later restore at another parallelism keeps only the key
   groups it owns (the file is never split; `get_intersection` narrows the handle's range);
2. rolls the backend's log over: the sqn reached is where the changelog tail of every later
   checkpoint starts, and the METADATA changes are appended again so the tail is self-describing;
3. writes the snapshot through the same storage with a second writer
   (`<operator_id>/materialized-<n>`: METADATA changes, then the key-group changes, appended as they
   are encoded) and persists it to a handle. This blocks until the upload is done (Flink materializes asynchronously;
   here the call is explicit or triggered by the configured interval).

A checkpoint is then "materialized handle(s) + changelog since the materialization". When the first
checkpoint that includes materialization n is confirmed, the log before it is truncated and older
materializations are discarded (files never confirmed by a checkpoint are released, so the registry
deletes them; confirmed ones belong to their checkpoints and are left to `dstl gc`).
"""
from __future__ import annotations

import logging
from typing import Any, List, Optional

from dstl.state import changes as C
from dstl.state.serializers import packb

log = logging.getLogger(__name__)

__all__ = ["Materialization", "materialize", "encode_key_group"]


class Materialization:
    """One completed materialization (or, with `writer=None`, the base a restore started from)."""

    __slots__ = ("id", "sqn", "handles", "writer", "end", "confirmed", "closed")

    def __init__(self, mat_id: int, sqn: Any, handles: List[Any], writer: Any = None, end: Any = None):
        self.id = mat_id
        self.sqn = sqn            # where the backend's changelog tail starts
        self.handles = handles    # replayed before the tail, in order
        self.writer = writer      # the materialized-<n> writer (None for a restored base)
        self.end = end            # its next sqn after the persist
        self.confirmed = False
        self.closed = False

    @classmethod
    def restored(cls, handles: List[Any], sqn: Any) -> "Materialization":
        return cls(0, sqn, handles)

    def confirm(self, checkpoint_id: int) -> None:
        """A checkpoint that includes this materialization completed: it owns the files now."""
        if self.writer is not None and not self.confirmed:
            self.writer.confirm(self.writer.initial_sequence_number(), self.end, checkpoint_id)
        self.confirmed = True

    def discard(self) -> None:
        """Superseded by a newer confirmed materialization."""
        if self.closed:
            return
        self.closed = True
        if self.writer is None:
            return
        if self.confirmed:
            self.writer.close()
        else:  # no checkpoint owns it: release its files
            self.writer.truncate_and_close(self.writer.initial_sequence_number())

    def close(self) -> None:
        """Backend closing: release nothing (handles given out stay valid)."""
        if not self.closed and self.writer is not None:
            self.writer.close()
        self.closed = True

    def __repr__(self) -> str:
        return (f"Materialization(id={self.id}, sqn={int(self.sqn)}, handles={len(self.handles)}, "
                f"confirmed={self.confirmed})")


# entries (keys) per KEY_GROUP_SNAPSHOT change: bounds the size of one change (docs/format.md lengths are
# int32) and the memory a materialization holds at once; a big key group becomes several changes
CHUNK_ENTRIES = 50_000


def encode_key_group(backend, kg: int, chunk_entries: Optional[int] = None) -> List[bytes]:
    """The KEY_GROUP_SNAPSHOT payloads of one key group ([] if it holds no state).

    Each payload is `[[state_id, {key: value, ...}], ...]` with at most `chunk_entries` keys in
    all; a restore merges them, so the split is invisible."""
    limit = chunk_entries or CHUNK_ENTRIES
    t = backend._table.get(kg)
    if not t:
        return []
    out: List[bytes] = []
    entries: List[list] = []
    count = 0
    for name, per_key in t.items():
        if not per_key:
            continue
        state = backend._states[name]
        snap = state._snapshot_value
        part: dict = {}
        for k, v in per_key.items():
            part[k] = snap(v)
            count += 1
            if count >= limit:
                entries.append([state._sid, part])
                out.append(bytes((C.KEY_GROUP_SNAPSHOT,)) + packb(entries))
                entries, part, count = [], {}, 0
        if part:
            entries.append([state._sid, part])
    if entries:
        out.append(bytes((C.KEY_GROUP_SNAPSHOT,)) + packb(entries))
    return out


def materialize(backend, force: bool = False) -> Materialization:
    """Materialize `backend` now (see the module docstring); returns the new Materialization."""
    cur = backend._mat
    if not force and cur is not None and cur.writer is not None and backend._since_changes == 0:
        return cur  # nothing changed since the last one
    backend._materializing = True
    try:
        n = backend._mat_counter + 1
        metas = [C.encode_meta(st.meta) for st in backend._states.values()]
        # the tail of later checkpoints starts here; make it self-describing. Nothing mutates the
        # state until this call returns, so the snapshot below is exactly the state at `sqn`.
        sqn = backend._writer.next_sequence_number()
        for m in metas:
            backend._writer.append_meta(m)
        writer = backend.storage.create_writer(f"{backend.operator_id}/materialized-{n}",
                                               backend.key_group_range)
        groups = 0
        try:
            for m in metas:
                writer.append_meta(m)
            for kg in sorted(backend._table):
                payloads = encode_key_group(backend, kg)
                groups += bool(payloads)
                for p in payloads:  # appended as encoded: pre-emptive uploads bound the memory
                    writer.append(kg, p)
            result = writer.persist(writer.initial_sequence_number(), -1).result()
            end = writer.next_sequence_number()
        except BaseException:
            try:
                writer.truncate_and_close(writer.initial_sequence_number())
            except Exception:  # pragma: no cover - best effort cleanup
                log.exception("cleanup of failed materialization %d", n)
            raise
        mat = Materialization(n, sqn, [result.job_manager_owned_snapshot], writer, end)
        backend._mat_counter = n
        if cur is not None:
            backend._old_mats.append(cur)
        backend._mat = mat
        backend._since_changes = 0
        backend._since_bytes = 0
        backend.materializations += 1
        log.debug("materialized %s %s: %d key groups, sqn %s", backend.operator_id,
                  backend.key_group_range, groups, sqn)
        return mat
    finally:
        backend._materializing = False
