"""Read a job's state as rows: the live values of a checkpoint, and the changes between checkpoints.

Everything here works on one key-group range at a time, so the Spark reader (dstl.spark.state_reader)
runs the same functions in one task per range on the executors; `read_state_pandas` and
`read_changes_pandas` loop over the ranges in this process.

Rows of `read_state_pandas` (one per live value):

| column | meaning |
|---|---|
| key | the state key (int, str or bytes) |
| key_group | its key group |
| state, kind | state name and kind (value, list, map, reducing) |
| user_key | map state: the user key as JSON (else null) |
| position | list state: the element's index (else null) |
| value | the value as JSON (one element for list state, one entry for map state) |

Rows of `read_changes_pandas`: checkpoint_id (the first checkpoint that contains the change), key,
key_group, state, op (update, clear, add, add_all, put, put_all, remove), user_key, value.

`storage_options` everywhere: the base path file system's keyword arguments (key, secret,
client_kwargs, ...), as pandas takes them; `options`: dstl's storage options (docs/options.md).
"""
from __future__ import annotations

import base64
import json
import math
from typing import Any, Dict, Iterator, List, Optional, Sequence, Tuple

from dstl.errors import DstlError
from dstl.types import KeyGroupRange

__all__ = ["StateReadError", "open_checkpoint", "restored_range", "state_rows", "read_state_pandas",
           "change_rows", "read_changes_pandas", "new_entries", "key_group_ranges", "to_json",
           "STATE_COLUMNS", "CHANGE_COLUMNS", "state_names", "first_look", "read_timers_pandas",
           "state_schema", "expand_values", "TIMER_STATE"]

STATE_COLUMNS = ["key", "key_group", "state", "kind", "user_key", "position", "value"]
CHANGE_COLUMNS = ["checkpoint_id", "key", "key_group", "state", "op", "user_key", "value"]
_READER_OPERATOR = "dstl-state-reader"


class StateReadError(DstlError, ValueError):
    """A base path without checkpoints, an unknown checkpoint or an unknown state."""


# ------------------------------------------------------------------ values as JSON

def _json_default(v: Any) -> Any:
    if isinstance(v, (bytes, bytearray, memoryview)):
        return {"$bytes": base64.b64encode(bytes(v)).decode("ascii")}
    if hasattr(v, "tolist"):  # numpy scalars and arrays
        return v.tolist()
    if isinstance(v, (set, frozenset)):
        return sorted(v, key=repr)
    if hasattr(v, "_asdict"):
        return v._asdict()
    return repr(v)


def _clean(v: Any) -> Any:
    """JSON has no bytes keys or NaN: spell them so `json.loads` gives them back recognisably."""
    if isinstance(v, dict):
        return {(k if isinstance(k, str) else to_json(k)): _clean(x) for k, x in v.items()}
    if isinstance(v, (list, tuple)):
        return [_clean(x) for x in v]
    if isinstance(v, float) and not math.isfinite(v):
        return repr(v)
    return v


_ENCODER = json.JSONEncoder(default=_json_default, separators=(",", ":"), ensure_ascii=False, allow_nan=False)
_LENIENT = json.JSONEncoder(default=_json_default, separators=(",", ":"), ensure_ascii=False)


def to_json(v: Any) -> str:
    """Compact JSON of a state value (bytes as {"$bytes": base64})."""
    t = type(v)
    if t is int:  # the common scalars without the encoder's machinery
        return str(v)
    if t is bytes:
        return '{"$bytes":"' + base64.b64encode(v).decode("ascii") + '"}'
    try:
        return _ENCODER.encode(v)
    except (TypeError, ValueError):
        return _LENIENT.encode(_clean(v))


# ------------------------------------------------------------------ checkpoints and ranges

def open_checkpoint(base_path: str, checkpoint_id: Optional[int] = None, *,
                    storage_options: Optional[Dict[str, Any]] = None):
    """The metadata of `checkpoint_id` (default: the latest complete one) at `base_path`."""
    from dstl.config import register_storage_options
    from dstl.state.metadata import (CheckpointMetadata, CorruptCheckpointError, latest_checkpoint,
                                     list_checkpoints, read_checkpoint)

    register_storage_options(base_path, storage_options)  # before the first file system is opened
    try:
        ids = list_checkpoints(base_path)
    except (OSError, ValueError) as exc:
        raise StateReadError(f"cannot read {base_path}: {exc}") from None
    if not ids:
        raise StateReadError(f"{base_path} holds no checkpoints (no checkpoints/chk-*/_metadata)")
    if checkpoint_id is None:
        meta = latest_checkpoint(base_path)
        if meta is None:
            raise StateReadError(f"{base_path}: no readable checkpoint among {_ids(ids)}")
        return meta
    if isinstance(checkpoint_id, bool) or not isinstance(checkpoint_id, int):
        raise StateReadError(f"checkpoint id must be an int, got {checkpoint_id!r}")
    if checkpoint_id not in ids:
        raise StateReadError(f"{base_path} has no checkpoint {checkpoint_id} (retained: {_ids(ids)})")
    try:
        meta = read_checkpoint(base_path, checkpoint_id)
    except CorruptCheckpointError as exc:
        raise StateReadError(str(exc)) from None
    assert isinstance(meta, CheckpointMetadata)
    return meta


def _ids(ids: Sequence[int]) -> str:
    return ", ".join(map(str, ids))


def key_group_ranges(max_parallelism: int, parts: int) -> List[KeyGroupRange]:
    """`parts` contiguous key-group ranges covering 0..max_parallelism-1 (Flink's operator split)."""
    from dstl.keygroups import compute_key_group_range_for_operator_index

    parts = max(1, min(int(parts), max_parallelism))
    return [compute_key_group_range_for_operator_index(max_parallelism, parts, i) for i in range(parts)]


def _storage(base_path: str, job_id: Optional[str], storage_options: Optional[Dict[str, Any]],
             options: Any = None):
    from dstl.changelog.storage import FsStateChangelogStorage
    from dstl.config import storage_config

    config = storage_config(base_path, options, storage_options)
    # nothing is uploaded: the reader never persists
    return FsStateChangelogStorage(config.replace(upload_mode="direct"), job_id=job_id)


def _overlaps(a: KeyGroupRange, b: KeyGroupRange) -> bool:
    return not a.is_empty() and not b.is_empty() and max(a.start, b.start) <= min(a.end, b.end)


class restored_range:
    """Context manager: a `KeyedStateBackend` holding checkpoint `meta`'s state of `kgr` only."""

    def __init__(self, base_path: str, meta, kgr: KeyGroupRange, *, serializers=None, storage_options=None,
                 options=None):
        self.base_path, self.meta, self.kgr = base_path, meta, kgr
        self.serializers, self.storage_options, self.options = serializers, storage_options, options
        self._storage = self._backend = None

    def __enter__(self):
        from dstl.state import KeyedStateBackend

        snaps = [s.to_keyed_snapshot(self.meta.max_parallelism) for s in self.meta.subtasks
                 if _overlaps(s.key_group_range, self.kgr)]
        self._storage = _storage(self.base_path, self.meta.job_id, self.storage_options, self.options)
        try:
            self._backend = KeyedStateBackend.restore(self._storage, _READER_OPERATOR, self.kgr,
                                                      self.meta.max_parallelism, snaps,
                                                      serializers=self.serializers)
        except BaseException:
            self._storage.close()
            raise
        return self._backend

    def __exit__(self, *exc) -> None:
        try:
            self._backend.close()
        finally:
            self._storage.close()


def first_look(meta, storage_options=None, options=None):
    """(state name -> kind, Python type of the keys or None), from the first change set of each of the
    checkpoint's handles only (states registered later in a log are not seen)."""
    from dstl.changelog.handles import ChangelogStateHandleStreamImpl
    from dstl.state import changes as C
    from dstl.state.serializers import unpackb

    names: Dict[str, str] = {}
    key_type = None
    from dstl.config import register_storage_options

    # the handles name their files by full URL: the file system's arguments go with their folders
    for folder in {h.path.rsplit("/", 1)[0] for s in meta.subtasks for hd in s.materialized + s.changelog
                   for h, _ in hd.handles_and_offsets}:
        register_storage_options(folder, storage_options)
    storage = _storage("memory://unused", None, None, options)
    try:
        reader = storage.create_reader()
        for s in meta.subtasks:
            for hd in s.materialized + s.changelog:
                pairs = hd.handles_and_offsets
                if not pairs:
                    continue
                one = ChangelogStateHandleStreamImpl(pairs[:1], hd.key_group_range, 0)
                it = reader.get_changes_arrays(one)
                try:
                    for buf, kgs, offs, lens in it:
                        view = buf if isinstance(buf, (bytes, memoryview)) else memoryview(buf)
                        for kg, o, ln in zip(kgs.tolist(), offs.tolist(), lens.tolist()):
                            op = view[o]
                            body = unpackb(view[o + 1:o + ln])
                            if op == C.METADATA:
                                m = C.decode_meta(body)
                                names[m.name] = m.kind
                            elif key_type is None and op == C.KEY_GROUP_SNAPSHOT:
                                for _, entries in body:
                                    for k in entries:
                                        key_type = type(k)
                                        break
                            elif key_type is None:
                                key_type = type(body[1])
                finally:
                    it.close()
    finally:
        storage.close()
    return names, key_type


# ------------------------------------------------------------------ live values

#: states whose names start with this are dstl's own (timers); read_state lists them only by name
RESERVED_PREFIX = "_dstl_"
TIMER_STATE = "_dstl_timers"  # dstl.state.timers keeps every key's timers in this map state
_TTL_OPTION = "ttl"           # dstl.state.ttl: values stored as [value, expires_at_ms]


def _now_ms() -> int:
    import time

    return int(time.time() * 1000)


def state_rows(backend, state_name: Optional[str] = None, *, now_ms: Optional[int] = None,
               encode=to_json) -> Iterator[Tuple]:
    """One tuple per live value (STATE_COLUMNS order) of a restored backend, in key-group order.

    Values of a TTL state that expired at `now_ms` (default: now) are left out, the others are
    unwrapped from their [value, expires_at_ms] pair. `encode` turns values and user keys into the
    value column (default JSON; `None` keeps the Python objects).
    """
    enc = encode or (lambda v: v)
    states = {n: backend.get_state(n) for n in backend.state_names}
    if state_name is not None:
        states = {state_name: states[state_name]} if state_name in states else {}
    else:
        states = {n: s for n, s in states.items() if not n.startswith(RESERVED_PREFIX)}
    now = _now_ms() if now_ms is None else int(now_ms)
    table = backend._table
    for kg in sorted(table):
        per_state = table[kg]
        for name, st in states.items():
            entries = per_state.get(name)
            if not entries:
                continue
            kind = st.kind
            ttl = bool(st.meta.options.get(_TTL_OPTION))
            rows_of = st._entry_rows  # the kind knows its entries' layout (a value, a list, a map)
            for key, value in entries.items():
                for user_key, position, cell in rows_of(value, ttl, now, enc):
                    yield key, kg, name, kind, user_key, position, cell


def state_names(base_path: str, meta, kgr: Optional[KeyGroupRange] = None, **kw) -> Dict[str, str]:
    """Name -> kind of every state of checkpoint `meta` (restores `kgr`, default one key group)."""
    rng = kgr or KeyGroupRange(0, 0)
    with restored_range(base_path, meta, rng, **kw) as backend:
        return {n: backend.get_state(n).kind for n in backend.state_names}


def _check_state(state_name: Optional[str], names: Dict[str, str], base_path: str, cid: int) -> None:
    if state_name is not None and state_name not in names:
        known = ", ".join(sorted(names)) or "none"
        raise StateReadError(f"checkpoint {cid} at {base_path} has no state {state_name!r} (states: {known})")


def state_schema(meta, state_name: Optional[str]):
    """(field names, decode) of a state's declared value schema recorded with the checkpoint (the
    `state_schemas` property StatefulStream writes), or None when it is not known."""
    if state_name is None:
        return None
    rec = (meta.properties.get("state_schemas") or {}).get(state_name)
    if not isinstance(rec, dict) or not isinstance(rec.get("value"), dict):
        return None
    names = [f["name"] for f in rec["value"].get("fields", [])]
    if not names:
        return None
    try:
        from dstl.state.schema import ValueSchema

        decode = ValueSchema(rec["value"]).decode
    except ImportError:  # pragma: no cover - the schema module ships with StatefulStream
        def decode(stored):
            return tuple(stored)
    return names, decode


def read_state_pandas(base_path: str, state_name: Optional[str] = None, *, checkpoint_id: Optional[int] = None,
                      key: Any = None, serializers: Optional[Dict[str, Any]] = None,
                      storage_options: Optional[Dict[str, Any]] = None, now_ms: Optional[int] = None,
                      options: Any = None):
    """The live state of a checkpoint (default: the latest) as a pandas DataFrame, one row per live
    value (see the module docstring for the columns). `key`: only this key (restores its key group
    only). For one state whose schema the job recorded, the value's fields are columns instead of
    `value`. `now_ms`: the time TTL expiry is judged at (default: now)."""
    import pandas as pd

    meta = open_checkpoint(base_path, checkpoint_id, storage_options=storage_options)
    kw = {"serializers": serializers, "storage_options": storage_options, "options": options}
    key, show = _composite_keys(base_path, storage_options, key)
    ranges = _ranges_for(meta, key)
    schema = state_schema(meta, state_name)
    rows: List[Tuple] = []
    names: Dict[str, str] = {}
    for rng in ranges:
        with restored_range(base_path, meta, rng, **kw) as backend:
            names.update({n: backend.get_state(n).kind for n in backend.state_names})
            rows.extend(r for r in state_rows(backend, state_name, now_ms=now_ms,
                                              encode=None if schema else to_json)
                        if key is None or r[0] == key)
    _check_state(state_name, names, base_path, meta.checkpoint_id)
    df = pd.DataFrame(rows, columns=STATE_COLUMNS)
    df = _show_keys(df.astype({"key_group": "int64", "position": "Int64"}), show)
    if schema is not None:
        df = expand_values(df, *schema)
    return df


def expand_values(df, names: List[str], decode):
    """`df` with its `value` column (stored lists of a declared schema) replaced by one column per
    field; user keys become JSON."""
    import pandas as pd

    values = [decode(v) for v in df["value"]]
    out = df.drop(columns=["value"])
    out["user_key"] = [None if u is None else to_json(u) for u in out["user_key"]]
    cols = pd.DataFrame(values, columns=names, index=df.index) if values else pd.DataFrame(columns=names)
    return pd.concat([out, cols], axis=1)


def read_timers_pandas(base_path: str, *, checkpoint_id: Optional[int] = None, key: Any = None, **kw):
    """The registered timers of a checkpoint: columns key, key_group, timestamp_ms (one row each)."""
    import pandas as pd

    meta = open_checkpoint(base_path, checkpoint_id, storage_options=kw.get("storage_options"))
    key, show = _composite_keys(base_path, kw.get("storage_options"), key)
    ranges = _ranges_for(meta, key)
    rows = []
    for rng in ranges:
        with restored_range(base_path, meta, rng, serializers=kw.get("serializers"),
                            storage_options=kw.get("storage_options"), options=kw.get("options")) as backend:
            if TIMER_STATE in backend.state_names:
                rows.extend((r[0], r[1], r[4]) for r in state_rows(backend, TIMER_STATE, encode=None)
                            if key is None or r[0] == key)
    return _show_keys(pd.DataFrame(sorted(rows, key=lambda r: (r[2], repr(r[0]))),
                                   columns=["key", "key_group", "timestamp_ms"]).astype({"key_group": "int64",
                                                                                         "timestamp_ms": "int64"}),
                      show)


def _ranges_for(meta, key: Any) -> List[KeyGroupRange]:
    from dstl.keygroups import assign_to_key_group

    if key is not None:
        kg = assign_to_key_group(key, meta.max_parallelism)
        return [KeyGroupRange(kg, kg)]
    return [s.key_group_range for s in meta.subtasks if not s.key_group_range.is_empty()]


def _composite_keys(base_path: str, storage_options: Optional[Dict[str, Any]], key: Any):
    """For a StatefulStream job with several key columns (dstl.state.composite_keys): (the stored form of
    `key`, the function that shows a stored key as its values, a JSON list such as `["ann", 7]`), as
    `read_state` and `dstl state show` show them. `key` may be given as that JSON text or as a
    tuple/list of the values. Any other job: (key, None)."""
    from dstl.state.composite_keys import display_key, job_key_columns, pack_key, parse_display_key

    if job_key_columns(base_path, storage_options) is None:
        return key, None
    if isinstance(key, str):
        key = parse_display_key(key)
    elif isinstance(key, (tuple, list)):
        key = pack_key(list(key))
    return key, display_key


def _show_keys(df, show):
    if show is not None and len(df):
        df["key"] = df["key"].map(show)
    return df


# ------------------------------------------------------------------ changes between checkpoints

def new_entries(base_path: str, from_checkpoint: int, to_checkpoint: int, *,
                storage_options: Optional[Dict[str, Any]] = None):
    """For each retained checkpoint c in (from, to]: (c, [(subtask, kgr, [(file, offset), ...]), ...]),
    the change sets c's changelog handles reference that no earlier checkpoint in the range does.

    Only the metadata is read. Both ends must be retained checkpoints.
    """
    from dstl.state.metadata import list_checkpoints

    if from_checkpoint >= to_checkpoint:
        raise StateReadError(f"--from ({from_checkpoint}) must be before --to ({to_checkpoint})")
    first = open_checkpoint(base_path, from_checkpoint, storage_options=storage_options)
    open_checkpoint(base_path, to_checkpoint)
    ids = [c for c in list_checkpoints(base_path) if from_checkpoint < c <= to_checkpoint]
    missing = [c for c in range(from_checkpoint + 1, to_checkpoint + 1) if c not in ids]
    if missing:
        raise StateReadError(f"checkpoints {_ids(missing)} between {from_checkpoint} and {to_checkpoint} are "
                             f"no longer retained at {base_path}: their changes cannot be listed")
    seen = {(h.path, off) for s in first.subtasks for hd in s.materialized + s.changelog
            for h, off in hd.handles_and_offsets}
    out = []
    for c in ids:
        meta = open_checkpoint(base_path, c)
        per_subtask = []
        fresh = set()
        for s in meta.subtasks:
            for hd in s.changelog:
                entries = [(h.path, h.size, off) for h, off in hd.handles_and_offsets if (h.path, off) not in seen]
                if entries:
                    per_subtask.append((s.index, hd.key_group_range, hd.to_bytes(), entries))
                fresh.update((p, off) for p, _, off in entries)
        seen |= fresh
        out.append((c, per_subtask))
    return out


def change_rows(base_path: str, checkpoint_id: int, handle_bytes: bytes, entries, *,
                storage_options=None, serializers=None, options=None) -> Iterator[Tuple]:
    """CHANGE_COLUMNS tuples of the change sets `entries` [(file, size, offset)] of one changelog
    handle (its earlier change sets are read only for the state definitions they hold)."""
    from dstl.changelog.handles import ChangelogStateHandleStreamImpl, StreamStateHandle
    from dstl.state import changes as C
    from dstl.state.kinds import kind_class
    from dstl.state.serializers import get_serializer, unpackb

    handle = ChangelogStateHandleStreamImpl.from_bytes(handle_bytes)
    wanted = {(p, off) for p, _, off in entries}
    kgr = handle.key_group_range
    storage = _storage(base_path, None, storage_options, options)
    try:
        reader = storage.create_reader()
        states: Dict[int, Any] = {}   # state id -> (name, kind class, serializer, ttl); ids are per log
        for h, off in handle.handles_and_offsets:
            new = (h.path, off) in wanted
            one = ChangelogStateHandleStreamImpl([(StreamStateHandle(h.path, h.size), off)], kgr, 0)
            it = reader.get_changes_arrays(one)
            try:
                for buf, kgs, offs, lens in it:
                    view = memoryview(buf) if not isinstance(buf, (bytes, memoryview)) else buf
                    for kg, o, ln in zip(kgs.tolist(), offs.tolist(), lens.tolist()):
                        op = view[o]
                        if op == C.METADATA:
                            m = C.decode_meta(unpackb(view[o + 1:o + ln]))
                            states[m.state_id] = (m.name, kind_class(m.kind),
                                                  get_serializer(m.serializer_id, serializers or {}),
                                                  bool(m.options.get(_TTL_OPTION)))
                            continue
                        if not new or op == C.KEY_GROUP_SNAPSHOT or not kgr.contains(kg):
                            continue
                        body = unpackb(view[o + 1:o + ln])
                        name, cls, ser, ttl = states[body[0]]
                        yield _change_row(checkpoint_id, kg, op, cls, name, ser, body, ttl)
            finally:
                it.close()
    finally:
        storage.close()


def _change_row(cid: int, kg: int, op: int, kind_cls: type, name: str, ser, body, ttl: bool = False) -> Tuple:
    native = bool(getattr(ser, "native", False))

    def val(w):
        v = w if native else ser.loads(w)
        return v[0] if ttl and isinstance(v, (list, tuple)) and len(v) == 2 else v  # [value, expires_at_ms]

    op_name, user_key, value = kind_cls._feed_cells(op, body, val, to_json)
    return cid, body[1], kg, name, op_name, user_key, value


def read_changes_pandas(base_path: str, from_checkpoint: int, to_checkpoint: int, *, key: Any = None,
                        state_name: Optional[str] = None, storage_options=None, serializers=None,
                        options=None):
    """Every state change after checkpoint `from_checkpoint` up to `to_checkpoint`, in log order per
    key group, as a pandas DataFrame (CHANGE_COLUMNS)."""
    import pandas as pd

    key, show = _composite_keys(base_path, storage_options, key)
    rows: List[Tuple] = []
    for cid, per_subtask in new_entries(base_path, from_checkpoint, to_checkpoint,
                                        storage_options=storage_options):
        for _, _, hb, entries in per_subtask:
            for r in change_rows(base_path, cid, hb, entries, storage_options=storage_options,
                                 serializers=serializers, options=options):
                if (key is None or r[1] == key) and (state_name is None or r[3] == state_name):
                    rows.append(r)
    return _show_keys(pd.DataFrame(rows, columns=CHANGE_COLUMNS).astype({"checkpoint_id": "int64",
                                                                         "key_group": "int64"}), show)
