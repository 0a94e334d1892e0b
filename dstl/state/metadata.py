"""Checkpoint metadata: what a completed checkpoint consists of, written atomically per checkpoint.

Layout: `<base>/checkpoints/chk-<id>/_metadata`, on any fsspec filesystem. The file is
`MAGIC + msgpack body + CRC-32 (big endian) of the body`, so a torn or truncated file is detected and
such a checkpoint is skipped by `latest_checkpoint`. Changelog and materialized handles are stored
with `ChangelogStateHandleStreamImpl.to_bytes`, operator state handles (small, inline streams) with
`OperatorStateHandle.to_bytes`.

Relocatable: `write_checkpoint` stores every file under the base path relative to it
(dstl.state.relpaths) and `read_checkpoint` resolves them against the base path it reads from, so a
copied or moved base path restores from its new place. Metadata written with absolute paths still
reads; the next checkpoint a resumed job writes stores them relative.
"""
from __future__ import annotations

import logging
import os
import struct
import time
import zlib
from typing import Any, Dict, Iterable, List, Optional, Sequence, Set

import msgpack

from dstl.changelog import fs as dfs
from dstl.changelog.checkpoints import (_CHK_RE, CHECKPOINTS_DIR, MAGIC, METADATA_FILE, list_complete,
                                         unwrap_envelope)
from dstl.errors import DstlError
from dstl.types import KeyGroupRange

log = logging.getLogger(__name__)

# Version 1 throughout: a stored path without a scheme and without a leading "/" is relative to the
# base path (dstl.state.relpaths), so metadata with absolute paths (as written before) reads unchanged.
_FORMAT_VERSION = 1
_READABLE_VERSIONS = (1,)

__all__ = [
    "SubtaskState", "CheckpointMetadata", "CorruptCheckpointError", "CheckpointJobMismatchError",
    "write_checkpoint", "read_checkpoint", "latest_checkpoint", "list_checkpoints", "retained_files",
    "checkpoint_path", "remove_checkpoint", "base_of_metadata_file", "CheckpointExistsError",
]


class CorruptCheckpointError(DstlError, ValueError):
    """A `_metadata` file that is truncated, torn or not dstl checkpoint metadata."""


class CheckpointJobMismatchError(DstlError, ValueError):
    """The base path holds checkpoints of another job."""


def _changelog_handle_type():
    from dstl.changelog.handles import ChangelogStateHandleStreamImpl

    return ChangelogStateHandleStreamImpl


def _operator_handle_type():
    from dstl.state.operator import OperatorStateHandle

    return OperatorStateHandle


def _int(name: str, value: Any, lo: int = 0) -> int:
    if isinstance(value, bool) or not isinstance(value, int):
        try:
            import numpy as np

            if isinstance(value, np.integer):
                return _int(name, int(value), lo)
        except ImportError:  # pragma: no cover
            pass
        raise ValueError(f"{name} must be an int, got {type(value).__name__}: {value!r}")
    if value < lo:
        raise ValueError(f"{name} must be >= {lo}, got {value}")
    return value


class SubtaskState:
    """The state of one subtask in a checkpoint: keyed (materialized + changelog handles) and operator state."""

    __slots__ = ("index", "key_group_range", "materialized", "changelog", "operator_state")

    def __init__(self, index: int, key_group_range: KeyGroupRange, materialized: Sequence[Any] = (),
                 changelog: Sequence[Any] = (), operator_state: Sequence[Any] = ()):
        H, O = _changelog_handle_type(), _operator_handle_type()
        self.index = _int("subtask index", index)
        if not isinstance(key_group_range, KeyGroupRange):
            raise ValueError(f"key_group_range must be a KeyGroupRange, got {type(key_group_range).__name__}")
        self.key_group_range = key_group_range
        self.materialized = list(materialized)
        if changelog is None:
            changelog = []
        elif isinstance(changelog, H):  # a single handle, as a KeyedStateSnapshot carries it
            changelog = [changelog]
        self.changelog = list(changelog)
        self.operator_state = list(operator_state)
        for what, handles, cls in (("materialized", self.materialized, H), ("changelog", self.changelog, H),
                                   ("operator_state", self.operator_state, O)):
            for h in handles:
                if not isinstance(h, cls):
                    raise ValueError(f"subtask {self.index}: {what} handles must be {cls.__name__}, "
                                     f"got {type(h).__name__}")

    @classmethod
    def from_keyed_snapshot(cls, index: int, snapshot: Any, operator_state: Sequence[Any] = ()) -> "SubtaskState":
        """From a `KeyedStateSnapshot` (dstl.state.snapshot) and the subtask's operator state handles."""
        return cls(index, snapshot.key_group_range, snapshot.materialized,
                   [snapshot.changelog] if snapshot.changelog is not None else [], operator_state)

    def to_keyed_snapshot(self, max_parallelism: Optional[int] = None, checkpoint_id: Optional[int] = None):
        """The keyed part as a `KeyedStateSnapshot` for `KeyedStateBackend.restore`."""
        from dstl.state.snapshot import KeyedStateSnapshot

        if len(self.changelog) > 1:
            raise ValueError(f"subtask {self.index} has {len(self.changelog)} changelog handles; "
                             "a keyed state snapshot holds one")
        return KeyedStateSnapshot(self.key_group_range, self.materialized,
                                  self.changelog[0] if self.changelog else None, max_parallelism, checkpoint_id)

    def files(self) -> List[str]:
        """Distinct files the keyed handles read (operator state is inline in the metadata)."""
        seen: Dict[str, None] = {}
        for h in self.materialized + self.changelog:
            for f in h.files():
                seen.setdefault(f, None)
        return list(seen)

    def to_dict(self, base: Optional[str] = None) -> Dict[str, Any]:
        """Plain form; with `base`, files under it are stored relative to it."""
        def enc(h):
            if base is not None:
                from dstl.state.relpaths import map_handle_paths, relative_to

                h = map_handle_paths(h, lambda p: relative_to(base, p))
            return h.to_bytes()

        return {
            "index": self.index,
            "kgr": [self.key_group_range.start, self.key_group_range.end],
            "materialized": [enc(h) for h in self.materialized],
            "changelog": [enc(h) for h in self.changelog],
            "operator_state": [h.to_bytes() for h in self.operator_state],
        }

    @classmethod
    def from_dict(cls, d: Dict[str, Any], base: Optional[str] = None) -> "SubtaskState":
        """From `to_dict`'s form; with `base`, relative file paths are resolved against it."""
        H, O = _changelog_handle_type(), _operator_handle_type()

        def dec(b):
            h = H.from_bytes(b)
            if base is not None:
                from dstl.state.relpaths import map_handle_paths, resolve

                h = map_handle_paths(h, lambda p: resolve(base, p))
            return h

        start, end = d["kgr"]
        return cls(d["index"], KeyGroupRange(start, end), [dec(b) for b in d["materialized"]],
                   [dec(b) for b in d["changelog"]], [O.from_bytes(b) for b in d["operator_state"]])

    def __eq__(self, other) -> bool:
        if isinstance(other, SubtaskState):
            return self.to_dict() == other.to_dict()
        return NotImplemented

    __hash__ = None  # mutable

    def __repr__(self) -> str:
        return (f"SubtaskState({self.index}, {self.key_group_range!r}, materialized={len(self.materialized)}, "
                f"changelog={len(self.changelog)}, operator_state={len(self.operator_state)})")


class CheckpointMetadata:
    """One completed checkpoint: id, max parallelism, and the state of every subtask."""

    __slots__ = ("checkpoint_id", "max_parallelism", "parallelism", "subtasks", "properties", "job_id",
                 "timestamp_ms")

    def __init__(self, checkpoint_id: int, max_parallelism: int, parallelism: int,
                 subtasks: Sequence[SubtaskState], properties: Optional[Dict[str, Any]] = None, *,
                 job_id: Optional[str] = None, timestamp_ms: Optional[int] = None):
        self.checkpoint_id = _int("checkpoint_id", checkpoint_id)
        self.max_parallelism = _int("max_parallelism", max_parallelism, 1)
        if self.max_parallelism > 32768:
            raise ValueError(f"max_parallelism must be <= 32768, got {self.max_parallelism}")
        self.parallelism = _int("parallelism", parallelism, 1)
        if self.parallelism > self.max_parallelism:
            raise ValueError(f"parallelism {self.parallelism} exceeds max_parallelism {self.max_parallelism}")
        self.subtasks = sorted(subtasks, key=lambda s: s.index if isinstance(s, SubtaskState) else -1)
        self.properties = dict(properties or {})
        if job_id is not None and (not isinstance(job_id, str) or not job_id):
            raise ValueError(f"job_id must be a non-empty string or None, got {job_id!r}")
        self.job_id = job_id
        self.timestamp_ms = int(time.time() * 1000) if timestamp_ms is None else _int("timestamp_ms", timestamp_ms)
        self._validate()

    def _validate(self) -> None:
        for s in self.subtasks:
            if not isinstance(s, SubtaskState):
                raise ValueError(f"subtasks must be SubtaskState objects, got {type(s).__name__}")
        indices = [s.index for s in self.subtasks]
        if indices != list(range(self.parallelism)):
            raise ValueError(f"a checkpoint of parallelism {self.parallelism} needs subtasks 0..{self.parallelism - 1} "
                             f"exactly once each, got {indices}")
        for s in self.subtasks:
            r = s.key_group_range
            if not r.is_empty() and r.end >= self.max_parallelism:
                raise ValueError(f"subtask {s.index}: key group range {r!r} exceeds max_parallelism "
                                 f"{self.max_parallelism}")
            for h in s.materialized + s.changelog:
                if not h.key_group_range.is_empty() and h.key_group_range.end >= self.max_parallelism:
                    raise ValueError(f"subtask {s.index}: a handle covers {h.key_group_range!r}, beyond "
                                     f"max_parallelism {self.max_parallelism}")
        owned = sorted((s for s in self.subtasks if not s.key_group_range.is_empty()),
                       key=lambda s: s.key_group_range.start)
        for a, b in zip(owned, owned[1:]):  # two owners of one key group would restore it twice
            if b.key_group_range.start <= a.key_group_range.end:
                raise ValueError(f"key group ranges of subtasks {a.index} {a.key_group_range!r} and "
                                 f"{b.index} {b.key_group_range!r} overlap")

    def files(self) -> Set[str]:
        """Every file the checkpoint's keyed state handles read."""
        return {f for s in self.subtasks for f in s.files()}

    def keyed_snapshots(self) -> List[Any]:
        """Every subtask's keyed state as a `KeyedStateSnapshot` (subtask order), for a restore."""
        return [s.to_keyed_snapshot(self.max_parallelism, self.checkpoint_id) for s in self.subtasks]

    def operator_states(self) -> List[List[Any]]:
        """Every subtask's operator state handles: the input of `dstl.state.operator.repartition`."""
        return [list(s.operator_state) for s in self.subtasks]

    def to_dict(self, base: Optional[str] = None) -> Dict[str, Any]:
        """Plain form; with `base`, handle files under it are stored relative to it."""
        return {
            "v": _FORMAT_VERSION, "checkpoint_id": self.checkpoint_id, "job_id": self.job_id,
            "timestamp_ms": self.timestamp_ms, "max_parallelism": self.max_parallelism,
            "parallelism": self.parallelism, "properties": self.properties,
            "subtasks": [s.to_dict(base) for s in self.subtasks],
        }

    @classmethod
    def from_dict(cls, d: Dict[str, Any], base: Optional[str] = None) -> "CheckpointMetadata":
        """From `to_dict`'s form; with `base`, relative handle paths are resolved against it."""
        if not isinstance(d, dict):
            raise CorruptCheckpointError(f"checkpoint metadata: expected a map, got {type(d).__name__}")
        if d.get("v") not in _READABLE_VERSIONS:
            raise CorruptCheckpointError(f"checkpoint metadata: unsupported version {d.get('v')!r}")
        try:
            return cls(d["checkpoint_id"], d["max_parallelism"], d["parallelism"],
                       [SubtaskState.from_dict(s, base) for s in d["subtasks"]], d["properties"],
                       job_id=d["job_id"], timestamp_ms=d["timestamp_ms"])
        except (KeyError, TypeError, ValueError) as exc:
            raise CorruptCheckpointError(f"checkpoint metadata: malformed ({exc})") from exc

    def to_bytes(self, base: Optional[str] = None) -> bytes:
        """MAGIC + msgpack body + CRC-32 of the body (files under `base` stored relative to it)."""
        try:
            body = msgpack.packb(self.to_dict(base), use_bin_type=True)
        except (TypeError, ValueError, OverflowError) as exc:
            raise ValueError(f"checkpoint properties must be msgpack-serialisable: {exc}") from None
        return MAGIC + body + struct.pack(">I", zlib.crc32(body))

    @classmethod
    def from_bytes(cls, data: bytes, *, source: str = "checkpoint metadata",
                   base: Optional[str] = None) -> "CheckpointMetadata":
        """Parse `to_bytes`' output; relative file paths are resolved against `base` when given
        (see `base_of_metadata_file`), else left relative."""
        d = unwrap_envelope(data, source, CorruptCheckpointError)
        try:
            return cls.from_dict(d, base)
        except CorruptCheckpointError as exc:
            raise CorruptCheckpointError(f"{source}: {exc}") from exc

    def __eq__(self, other) -> bool:
        if isinstance(other, CheckpointMetadata):
            return self.to_dict() == other.to_dict()
        return NotImplemented

    __hash__ = None  # mutable

    def __repr__(self) -> str:
        return (f"CheckpointMetadata(checkpoint_id={self.checkpoint_id}, job_id={self.job_id!r}, "
                f"max_parallelism={self.max_parallelism}, parallelism={self.parallelism}, "
                f"files={len(self.files())})")


# ------------------------------------------------------------------------------ storage


def _fs(base_path: str):
    if hasattr(base_path, "__fspath__"):
        base_path = os.fspath(base_path)
    if not isinstance(base_path, str) or not base_path:
        raise ValueError(f"base_path must be a non-empty path or URL, got {base_path!r}")
    return dfs.root_of(base_path)


_is_local = dfs.is_local


_join = dfs.join


def checkpoint_path(base_path: str, checkpoint_id: int) -> str:
    """`<base>/checkpoints/chk-<id>/_metadata`, in the spelling of `base_path`."""
    return _join(os.fspath(base_path), CHECKPOINTS_DIR, f"chk-{_int('checkpoint_id', checkpoint_id)}",
                 METADATA_FILE)


class CheckpointExistsError(FileExistsError, DstlError):
    """A checkpoint id another writer (or an earlier attempt) completed first."""

    def __init__(self, message: str, holder: Optional[Dict[str, Any]] = None):
        super().__init__(message)
        self.holder = holder or {}


def _writer_of(fs, root: str, checkpoint_id: int) -> Dict[str, Any]:
    """Who wrote an existing checkpoint: its job id and the run's start (properties["writer"])."""
    try:
        meta = _read(fs, root, checkpoint_id, None)
    except (CorruptCheckpointError, FileNotFoundError, OSError):
        return {}
    info = dict(meta.properties.get("writer") or {})
    info.setdefault("job_id", meta.job_id)
    return info


def write_checkpoint(base_path: str, metadata: CheckpointMetadata, *, overwrite: bool = False,
                     check_job: bool = True) -> str:
    """Write `metadata` atomically to `<base>/checkpoints/chk-<id>/_metadata`; returns that path.

    Refuses (CheckpointJobMismatchError) when the base path holds checkpoints of another job id, and
    (CheckpointExistsError, a FileExistsError) to replace a completed checkpoint unless `overwrite`.
    Without `overwrite` the create is exclusive and atomic on local disk and S3 (dstl.changelog.fs.
    create_file): of two writers racing for one id exactly one succeeds; other stores rely on the
    writer lease (dstl.state.fencing).

    `check_job=False` skips reading the newest checkpoint back for its job id: for a writer that
    holds the base path's lease and wrote that checkpoint itself (a LIST and a GET saved per write).
    """
    if not isinstance(metadata, CheckpointMetadata):
        raise TypeError(f"expected CheckpointMetadata, got {type(metadata).__name__}")
    fs, root = _fs(base_path)
    if check_job and metadata.job_id is not None:
        other = _existing_job_id(fs, root, exclude=metadata.job_id)
        if other is not None:
            raise CheckpointJobMismatchError(
                f"{base_path} holds checkpoints of job {other}, not of job {metadata.job_id}; "
                "use another base path (or the same job id to continue that job)")
    path = _join(root, CHECKPOINTS_DIR, f"chk-{metadata.checkpoint_id}", METADATA_FILE)
    fs.invalidate_cache(path.rsplit("/", 1)[0])
    data = metadata.to_bytes(base=base_path)
    if overwrite:
        dfs.replace_file(fs, path, data)
    else:
        try:
            dfs.create_file(fs, path, data)
        except FileExistsError:
            holder = _writer_of(fs, root, metadata.checkpoint_id)
            who = ""
            if holder.get("job_id"):
                who = f" by job {holder['job_id']}"
                if holder.get("started_at"):
                    who += f" (query started at {holder['started_at']})"
            raise CheckpointExistsError(
                f"checkpoint {metadata.checkpoint_id} already exists at "
                f"{checkpoint_path(base_path, metadata.checkpoint_id)}, written{who or ' earlier'}; "
                f"base path {base_path.rstrip('/') if isinstance(base_path, str) else base_path} is being "
                "written by another run: stop that query, or use another base path", holder) from None
    # an atomic create is one PUT the store acknowledges whole (S3 checks its length); elsewhere the
    # write may have been cut short unnoticed, so its size is read back
    if not _is_local(fs) and (overwrite or not dfs.has_atomic_create(fs)):
        fs.invalidate_cache(path.rsplit("/", 1)[0])
        size = fs.info(path)["size"]
        if size != len(data):
            raise OSError(f"{path}: wrote {len(data)} bytes but the store holds {size}")
    return checkpoint_path(base_path, metadata.checkpoint_id)


def _existing_job_id(fs, root: str, exclude: str) -> Optional[str]:
    """The job id of the newest readable checkpoint if it differs from `exclude`, else None."""
    for cp in reversed(_list(fs, root)):
        try:
            meta = _read(fs, root, cp, None)
        except (CorruptCheckpointError, FileNotFoundError):
            continue
        if meta.job_id is not None and meta.job_id != exclude:
            return meta.job_id
        return None
    return None


_list = list_complete  # ids of the checkpoints with a `_metadata` file, ascending


def _read(fs, root: str, checkpoint_id: int, base: Optional[str]) -> CheckpointMetadata:
    path = _join(root, CHECKPOINTS_DIR, f"chk-{checkpoint_id}", METADATA_FILE)
    data = fs.cat_file(path)
    meta = CheckpointMetadata.from_bytes(data, source=path, base=base)
    if meta.checkpoint_id != checkpoint_id:
        raise CorruptCheckpointError(f"{path}: holds checkpoint {meta.checkpoint_id}, not {checkpoint_id}")
    return meta


def list_checkpoints(base_path: str) -> List[int]:
    """Ids of the checkpoints that have a `_metadata` file, ascending (contents not checked)."""
    fs, root = _fs(base_path)
    return _list(fs, root)


def read_checkpoint(base_path: str, checkpoint_id: int) -> CheckpointMetadata:
    """The metadata of one checkpoint; FileNotFoundError if it has none, CorruptCheckpointError if damaged."""
    fs, root = _fs(base_path)
    checkpoint_id = _int("checkpoint_id", checkpoint_id)
    try:
        return _read(fs, root, checkpoint_id, os.fspath(base_path))
    except FileNotFoundError:
        raise FileNotFoundError(f"no checkpoint {checkpoint_id} at {base_path} "
                                f"(missing {checkpoint_path(base_path, checkpoint_id)})") from None


def latest_checkpoint(base_path: str, *, job_id: Optional[str] = None) -> Optional[CheckpointMetadata]:
    """The newest complete, readable checkpoint, or None. Incomplete and corrupt ones are skipped.

    With `job_id`, a newest checkpoint of another job raises CheckpointJobMismatchError.
    """
    fs, root = _fs(base_path)
    for cp in reversed(_list(fs, root)):
        try:
            meta = _read(fs, root, cp, os.fspath(base_path))
        except FileNotFoundError:
            continue  # removed while we looked
        except CorruptCheckpointError as exc:
            log.warning("skipping checkpoint %d: %s", cp, exc)
            continue
        if job_id is not None and meta.job_id is not None and meta.job_id != job_id:
            raise CheckpointJobMismatchError(f"{base_path} holds checkpoints of job {meta.job_id}, not {job_id}")
        return meta
    return None


def base_of_metadata_file(path: str) -> str:
    """The base path of a `<base>/checkpoints/chk-<id>/_metadata` file (what its relative paths
    are relative to)."""
    p = os.fspath(path).rstrip("/")
    parts = p.rsplit("/", 3)
    if len(parts) != 4 or parts[1] != CHECKPOINTS_DIR or not _CHK_RE.match(parts[2]):
        raise ValueError(f"{path} is not <base>/{CHECKPOINTS_DIR}/chk-<id>/{METADATA_FILE}")
    return parts[0] or "/"


def remove_checkpoint(base_path: str, checkpoint_id: int) -> None:
    """Delete a checkpoint's directory (its `_metadata` first, so it never looks complete half-deleted)."""
    fs, root = _fs(base_path)
    directory = _join(root, CHECKPOINTS_DIR, f"chk-{_int('checkpoint_id', checkpoint_id)}")
    try:
        fs.rm_file(_join(directory, METADATA_FILE))
    except FileNotFoundError:
        pass
    try:
        fs.rm(directory, recursive=True)
    except FileNotFoundError:
        pass


def retained_files(metadata_list: Iterable[CheckpointMetadata]) -> Set[str]:
    """Every file the given checkpoints reference: what `dstl gc` must keep."""
    out: Set[str] = set()
    for meta in metadata_list:
        if not isinstance(meta, CheckpointMetadata):
            raise TypeError(f"expected CheckpointMetadata, got {type(meta).__name__}")
        out |= meta.files()
    return out
