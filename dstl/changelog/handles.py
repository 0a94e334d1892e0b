"""State handles: one changelog file, a writer's persisted changes, and a snapshot result.

Paths are fsspec URLs (`s3://b/k`, `file:///x`, `memory://x`) or plain local paths.
"""
from __future__ import annotations

import uuid
from typing import Any, BinaryIO, Dict, Iterable, List, Optional, Sequence, Tuple

import msgpack

from dstl.types import KeyGroupRange

_FORMAT_VERSION = 1


def filesystem_of(path: str):
    """`(fsspec filesystem, path inside it)` for a URL or a plain path."""
    from dstl.changelog.fs import filesystem

    return filesystem(path)


def is_local_filesystem(fs) -> bool:
    """True for the local disk (where a download cache would only copy files)."""
    from dstl.changelog.fs import is_local

    return is_local(fs)


def _check_nonneg_int(name: str, value: Any) -> int:
    if isinstance(value, bool) or not isinstance(value, int):
        try:
            import numpy as np

            if isinstance(value, np.integer):
                return _check_nonneg_int(name, int(value))
        except ImportError:  # pragma: no cover
            pass
        raise ValueError(f"{name} must be a non-negative int, got {type(value).__name__}: {value!r}")
    if value < 0:
        raise ValueError(f"{name} must be >= 0, got {value}")
    return value


class StreamStateHandle:
    """One changelog file (Flink's `FileStateHandle`): `size` is its logical stream length."""

    __slots__ = ("_path", "_size")

    def __init__(self, path: str, size: int):
        if hasattr(path, "__fspath__"):
            import os

            path = os.fspath(path)
        if not isinstance(path, str) or not path:
            raise ValueError(f"stream handle path must be a non-empty string, got {path!r}")
        self._path = path
        self._size = _check_nonneg_int("stream handle size", size)

    @property
    def path(self) -> str:
        return self._path

    @property
    def size(self) -> int:
        return self._size

    @property
    def handle_id(self) -> str:
        return self._path

    @property
    def state_size(self) -> int:
        return self._size

    def get_state_size(self) -> int:  # Flink spelling
        return self._size

    def filesystem(self):
        """`(fs, path)` for this file."""
        return filesystem_of(self._path)

    def open(self) -> BinaryIO:
        """The file opened for binary reading."""
        fs, p = filesystem_of(self._path)
        return fs.open(p, "rb")

    def read_bytes(self) -> bytes:
        """The whole file as stored (flag byte included)."""
        fs, p = filesystem_of(self._path)
        return fs.cat_file(p)

    def discard_state(self) -> None:
        """Delete the file; a file that is already gone is fine."""
        fs, p = filesystem_of(self._path)
        try:
            fs.rm_file(p)
        except FileNotFoundError:
            pass

    def to_dict(self) -> Dict[str, Any]:
        return {"path": self._path, "size": self._size}

    @classmethod
    def from_dict(cls, d: Dict[str, Any]) -> "StreamStateHandle":
        return cls(d["path"], d["size"])

    def __eq__(self, other) -> bool:
        if isinstance(other, StreamStateHandle):
            return self._path == other._path and self._size == other._size
        return NotImplemented

    def __hash__(self) -> int:
        return hash((self._path, self._size))

    def __repr__(self) -> str:
        return f"StreamStateHandle({self._path!r}, {self._size})"

    def __reduce__(self):
        return (StreamStateHandle, (self._path, self._size))


HandleAndOffset = Tuple[StreamStateHandle, int]


class ChangelogStateHandleStreamImpl:
    """The change sets one persist returned: `(file, offset)` per change set, in sequence order."""

    __slots__ = ("_handles_and_offsets", "_key_group_range", "_state_size", "_checkpointed_size",
                 "_storage_identifier", "_state_handle_id")

    def __init__(self, handles_and_offsets: Iterable[Sequence[Any]], key_group_range: KeyGroupRange,
                 state_size: int, checkpointed_size: int = 0, storage_identifier: str = "filesystem",
                 state_handle_id: Optional[str] = None):
        pairs: List[HandleAndOffset] = []
        for i, item in enumerate(handles_and_offsets):
            try:
                handle, offset = item
            except (TypeError, ValueError):
                raise ValueError(f"handles_and_offsets[{i}] must be a (StreamStateHandle, offset) pair, "
                                 f"got {item!r}") from None
            if not isinstance(handle, StreamStateHandle):
                raise ValueError(f"handles_and_offsets[{i}]: expected a StreamStateHandle, "
                                 f"got {type(handle).__name__}")
            pairs.append((handle, _check_nonneg_int(f"handles_and_offsets[{i}] offset", offset)))
        if not isinstance(key_group_range, KeyGroupRange):
            raise ValueError(f"key_group_range must be a KeyGroupRange, got {type(key_group_range).__name__}")
        if not isinstance(storage_identifier, str) or not storage_identifier:
            raise ValueError(f"storage_identifier must be a non-empty string, got {storage_identifier!r}")
        if state_handle_id is None:
            state_handle_id = str(uuid.uuid4())
        elif not isinstance(state_handle_id, str) or not state_handle_id:
            raise ValueError(f"state_handle_id must be a non-empty string, got {state_handle_id!r}")
        self._handles_and_offsets = pairs
        self._key_group_range = key_group_range
        self._state_size = _check_nonneg_int("state_size", state_size)
        self._checkpointed_size = _check_nonneg_int("checkpointed_size", checkpointed_size)
        self._storage_identifier = storage_identifier
        self._state_handle_id = state_handle_id

    # --- accessors (Python and Flink spelling) -------------------------------------------------
    @property
    def handles_and_offsets(self) -> List[HandleAndOffset]:
        return list(self._handles_and_offsets)

    @property
    def key_group_range(self) -> KeyGroupRange:
        return self._key_group_range

    @property
    def state_size(self) -> int:
        return self._state_size

    @property
    def checkpointed_size(self) -> int:
        return self._checkpointed_size

    @property
    def storage_identifier(self) -> str:
        return self._storage_identifier

    @property
    def state_handle_id(self) -> str:
        return self._state_handle_id

    def get_handles_and_offsets(self) -> List[HandleAndOffset]:
        return self.handles_and_offsets

    def get_key_group_range(self) -> KeyGroupRange:
        return self._key_group_range

    def get_state_size(self) -> int:
        return self._state_size

    def get_checkpointed_size(self) -> int:
        return self._checkpointed_size

    def get_storage_identifier(self) -> str:
        return self._storage_identifier

    def files(self) -> List[str]:
        """Distinct file paths this handle reads, in first-use order."""
        seen: Dict[str, None] = {}
        for h, _ in self._handles_and_offsets:
            seen.setdefault(h.path, None)
        return list(seen)

    def __len__(self) -> int:
        return len(self._handles_and_offsets)

    # --- rescaling -----------------------------------------------------------------------------
    def get_intersection(self, key_group_range: KeyGroupRange) -> Optional["ChangelogStateHandleStreamImpl"]:
        """A handle over the same files restricted to `range ∩ key_group_range`; None if empty."""
        if not isinstance(key_group_range, KeyGroupRange):
            raise ValueError(f"key_group_range must be a KeyGroupRange, got {type(key_group_range).__name__}")
        r = self._key_group_range.intersection(key_group_range)
        if r.is_empty():
            return None
        # Sizes are unknown once files are shared between ranges (SEMANTICS §11).
        return ChangelogStateHandleStreamImpl(self._handles_and_offsets, r, 0, 0, self._storage_identifier)

    # --- serialization -------------------------------------------------------------------------
    def to_dict(self) -> Dict[str, Any]:
        """Plain msgpack-able form; files are stored once and entries refer to them by index."""
        paths: Dict[Tuple[str, int], int] = {}
        files: List[List[Any]] = []
        entries: List[List[int]] = []
        for h, off in self._handles_and_offsets:
            key = (h.path, h.size)
            idx = paths.get(key)
            if idx is None:
                idx = paths[key] = len(files)
                files.append([h.path, h.size])
            entries.append([idx, off])
        return {
            "v": _FORMAT_VERSION,
            "type": "changelog-stream",
            "files": files,
            "entries": entries,
            "kgr": [self._key_group_range.start, self._key_group_range.end],
            "state_size": self._state_size,
            "checkpointed_size": self._checkpointed_size,
            "storage": self._storage_identifier,
            "id": self._state_handle_id,
        }

    @classmethod
    def from_dict(cls, d: Dict[str, Any]) -> "ChangelogStateHandleStreamImpl":
        if not isinstance(d, dict):
            raise ValueError(f"changelog handle: expected a map, got {type(d).__name__}")
        if d.get("type") != "changelog-stream":
            raise ValueError(f"changelog handle: unexpected type {d.get('type')!r}")
        if d.get("v") != _FORMAT_VERSION:
            raise ValueError(f"changelog handle: unsupported version {d.get('v')!r}")
        try:
            files = [StreamStateHandle(p, s) for p, s in d["files"]]
            pairs = [(files[i], off) for i, off in d["entries"]]
            start, end = d["kgr"]
            return cls(pairs, KeyGroupRange(start, end), d["state_size"], d["checkpointed_size"],
                       d["storage"], d["id"])
        except (KeyError, IndexError, TypeError) as exc:
            raise ValueError(f"changelog handle: malformed serialized form ({exc!r})") from exc

    def to_bytes(self) -> bytes:
        """msgpack bytes; `from_bytes(to_bytes())` gives an equal handle."""
        return msgpack.packb(self.to_dict(), use_bin_type=True)

    @classmethod
    def from_bytes(cls, data: bytes) -> "ChangelogStateHandleStreamImpl":
        try:
            d = msgpack.unpackb(data, raw=False, strict_map_key=False)
        except Exception as exc:
            raise ValueError(f"changelog handle: not valid msgpack ({exc})") from exc
        return cls.from_dict(d)

    def __reduce__(self):
        return (ChangelogStateHandleStreamImpl.from_bytes, (self.to_bytes(),))

    def __eq__(self, other) -> bool:
        if isinstance(other, ChangelogStateHandleStreamImpl):
            return (self._handles_and_offsets == other._handles_and_offsets
                    and self._key_group_range == other._key_group_range
                    and self._state_size == other._state_size
                    and self._checkpointed_size == other._checkpointed_size
                    and self._storage_identifier == other._storage_identifier
                    and self._state_handle_id == other._state_handle_id)
        return NotImplemented

    def __hash__(self) -> int:
        return hash(self._state_handle_id)

    def __repr__(self) -> str:
        files = len(self.files())
        return (f"ChangelogStateHandleStreamImpl(entries={len(self._handles_and_offsets)}, files={files}, "
                f"key_group_range={self._key_group_range!r}, state_size={self._state_size}, "
                f"checkpointed_size={self._checkpointed_size}, id={self._state_handle_id!r})")


class SnapshotResult:
    """What `persist` returns: the remote handle and the local-recovery copy (or None)."""

    __slots__ = ("job_manager_owned_snapshot", "task_local_snapshot")

    def __init__(self, job_manager_owned_snapshot: Optional[ChangelogStateHandleStreamImpl],
                 task_local_snapshot: Optional[ChangelogStateHandleStreamImpl] = None):
        self.job_manager_owned_snapshot = job_manager_owned_snapshot
        self.task_local_snapshot = task_local_snapshot

    @classmethod
    def of(cls, handle: Optional[ChangelogStateHandleStreamImpl]) -> "SnapshotResult":
        return cls(handle, None)

    @classmethod
    def empty(cls) -> "SnapshotResult":
        return cls(None, None)

    def get_job_manager_owned_snapshot(self):
        return self.job_manager_owned_snapshot

    def get_task_local_snapshot(self):
        return self.task_local_snapshot

    def __eq__(self, other) -> bool:
        if isinstance(other, SnapshotResult):
            return (self.job_manager_owned_snapshot == other.job_manager_owned_snapshot
                    and self.task_local_snapshot == other.task_local_snapshot)
        return NotImplemented

    __hash__ = None  # mutable

    def __repr__(self) -> str:
        return f"SnapshotResult({self.job_manager_owned_snapshot!r}, local={self.task_local_snapshot!r})"


__all__ = ["StreamStateHandle", "ChangelogStateHandleStreamImpl", "SnapshotResult",
           "filesystem_of", "is_local_filesystem"]
