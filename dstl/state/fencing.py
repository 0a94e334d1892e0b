"""One writer per base path: the writer lease (docs/semantics.md, "One writer per base path").

Every run of a job that writes checkpoints (a StatefulStream query, `dstl pipeline`) takes the base
path over when it opens: it creates `<base>/_dstl_writers/epoch-<n>.json` with the next epoch n,
naming its job, its run (a random writer id) and when it started. Before it writes a checkpoint,
commits output or deletes a file, a writer checks that the newest epoch is still its own; a writer
whose base path was taken over fails there with `BasePathInUseError`, before it changes anything.

Creating the epoch file and a checkpoint's `_metadata` is atomic where the store allows it
(dstl.changelog.fs.create_file: local disk, S3 conditional writes), so two writers racing for one
epoch or one checkpoint id cannot both succeed. On other stores the create is an existence check and
a write; the lease check before every commit is the fence there, and a writer that reads back
another writer's epoch file loses.
"""
from __future__ import annotations

import datetime
import json
import os
import re
import socket
import uuid
from typing import Any, Dict, List, Optional, Tuple

from dstl.changelog import fs as dfs
from dstl.errors import DstlError

LEASE_DIR = "_dstl_writers"
_EPOCH_RE = re.compile(r"^epoch-(\d{12})\.json$")
_KEEP_EPOCHS = 1  # older epochs are deleted by a takeover: their runs are fenced by the newest


class BasePathInUseError(DstlError, RuntimeError):
    """Another run writes this base path: this one must stop before it changes anything."""

    def __init__(self, base_path: str, holder: Dict[str, Any]):
        self.base_path = base_path
        self.holder = dict(holder)
        job = holder.get("job_id") or "?"
        started = holder.get("started_at") or "?"
        where = ""
        if holder.get("host") or holder.get("pid"):
            where = f" on {holder.get('host', '?')} pid {holder.get('pid', '?')}"
        super().__init__(f"base path {base_path} is being written by job {job} (query started at "
                         f"{started}{where}); stop that query, or use another base path")


def _now() -> str:
    return datetime.datetime.now(datetime.timezone.utc).strftime("%Y-%m-%dT%H:%M:%S.%fZ")


def _epoch_path(root: str, epoch: int) -> str:
    return dfs.join(root, LEASE_DIR, f"epoch-{epoch:012d}.json")


def _listing(fs, root: str) -> Dict[int, Dict[str, Any]]:
    """{epoch: the listing's entry of its file} (one LIST on an object store)."""
    directory = dfs.join(root, LEASE_DIR)
    fs.invalidate_cache(directory)
    try:
        entries = fs.ls(directory, detail=True)
    except FileNotFoundError:
        return {}
    finally:
        fs.invalidate_cache(directory)
    out = {}
    for e in entries:
        m = _EPOCH_RE.match(e["name"].rstrip("/").rsplit("/", 1)[-1])
        if m:
            out[int(m.group(1))] = e
    return out


def _epochs(fs, root: str) -> List[int]:
    return sorted(_listing(fs, root))


def _identity(entry: Dict[str, Any]) -> Optional[str]:
    """What an object store's listing says of one object's content (its ETag), or None where the
    listing has none (local disk): then the file itself is read."""
    for key in ("ETag", "etag", "md5Hash"):
        if entry.get(key):
            return str(entry[key])
    return None


def _read_epoch(fs, root: str, epoch: int) -> Optional[Dict[str, Any]]:
    try:
        return json.loads(fs.cat_file(_epoch_path(root, epoch)).decode())
    except FileNotFoundError:
        return None
    except ValueError:  # torn (a non-atomic store's partial write): unknown holder
        return {"epoch": epoch}


def current_holder(base_path: str) -> Optional[Dict[str, Any]]:
    """The newest epoch's record (job_id, writer, started_at, host, pid), or None if no run took
    the base path yet."""
    fs, root = dfs.root_of(base_path)
    epochs = _epochs(fs, root)
    return _read_epoch(fs, root, epochs[-1]) if epochs else None


class WriterLease:
    """This run's claim on a base path (see the module docstring)."""

    def __init__(self, base_path: str, job_id: str, epoch: int, writer: str, started_at: str,
                 identity: Optional[str] = None):
        self.base_path = base_path.rstrip("/")
        self.job_id = job_id
        self.epoch = epoch
        self.writer = writer
        self.started_at = started_at
        # the listing's ETag of our epoch file, once read back from its content: a check is then one
        # LIST (another writer's file, under any epoch number, has another ETag: its writer id differs)
        self.identity = identity

    @classmethod
    def acquire(cls, base_path: str, job_id: str) -> "WriterLease":
        """Take the base path over (the next epoch). BasePathInUseError if another run takes the
        same epoch at the same moment and wins it."""
        fs, root = dfs.root_of(base_path)
        epochs = _epochs(fs, root)
        epoch = (epochs[-1] + 1) if epochs else 1
        record = {"epoch": epoch, "writer": uuid.uuid4().hex, "job_id": job_id, "started_at": _now(),
                  "host": socket.gethostname(), "pid": os.getpid()}
        path = _epoch_path(root, epoch)
        try:
            atomic = dfs.create_file(fs, path, json.dumps(record, sort_keys=True).encode())
        except FileExistsError:
            raise BasePathInUseError(base_path, _read_epoch(fs, root, epoch) or {}) from None
        if not atomic:  # two writers may both have written: the file's content decides
            got = _read_epoch(fs, root, epoch) or {}
            if got.get("writer") != record["writer"]:
                raise BasePathInUseError(base_path, got)
        for old in epochs[:-(_KEEP_EPOCHS - 1) or None]:
            try:
                fs.rm_file(_epoch_path(root, old))
            except FileNotFoundError:
                pass
        return cls(base_path, job_id, epoch, record["writer"], record["started_at"])

    def holder(self) -> Tuple[int, Optional[Dict[str, Any]]]:
        """(newest epoch, its record) at the base path now."""
        fs, root = dfs.root_of(self.base_path)
        epochs = _epochs(fs, root)
        if not epochs:
            return 0, None
        return epochs[-1], _read_epoch(fs, root, epochs[-1])

    def check(self) -> None:
        """BasePathInUseError unless this run still holds the base path (call before writing a
        checkpoint, committing output or deleting a file)."""
        fs, root = dfs.root_of(self.base_path)
        listing = _listing(fs, root)
        epoch = max(listing) if listing else 0
        seen = _identity(listing[epoch]) if epoch else None
        if epoch == self.epoch and seen is not None and seen == self.identity:
            return
        record = _read_epoch(fs, root, epoch) if epoch else None
        if epoch == self.epoch and record is not None and record.get("writer") == self.writer:
            self.identity = seen  # read once: later checks compare the listing's ETag
            return
        if record is None:  # the lease directory was removed under us: someone else manages it
            record = {"job_id": "?", "started_at": "?"}
        raise BasePathInUseError(self.base_path, record)

    def __repr__(self) -> str:
        return f"WriterLease({self.base_path!r}, job={self.job_id}, epoch={self.epoch})"


__all__ = ["WriterLease", "BasePathInUseError", "current_holder", "LEASE_DIR"]
