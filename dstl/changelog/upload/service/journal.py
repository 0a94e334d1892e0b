"""The registry's state on local disk: an append-only journal of operations plus a compacted snapshot.

State = tracked files (path -> [count, {client: outstanding}]), orphans (files a dead client still held
a share of: path -> [since wall-clock ms, outstanding]) and files waiting for deletion.
Every operation carries an id given by the service; the journal records it, so after a restart the
service re-sends only what the registry had not applied (exactly-once, no double release).

Durability rule: an operation is applied and acknowledged only after its record is wholly in the
journal (short writes are continued), and fsynced for the records that protect a file from deletion
(start of tracking, confirm). A write that fails (ENOSPC, EIO, a read-only file system) is cut off
again (the file is truncated back to its last whole record) and the operation fails to its client
unapplied; while that cut cannot be made, every later operation fails too, so a torn record is only
ever the journal's last one and only ever an operation that was never acknowledged.
"""
from __future__ import annotations

import errno
import json
import logging
import os
import time
from typing import Dict, List, Optional, Set

from dstl.changelog.registry import RefCounts

log = logging.getLogger(__name__)

SNAPSHOT = "snapshot.json"
LOG = "journal.log"
SYNCED = frozenset({"start", "stop"})  # records that keep a file from being deleted: fsynced


class JournalError(OSError):
    """The registry journal could not record an operation; the operation was not applied."""


def write(fd: int, data) -> int:
    """One write(2) of `data` to `fd` (the seam the fault tests replace: short writes, ENOSPC)."""
    return os.write(fd, data)


def fsync(fd: int) -> None:
    """fsync(2) of `fd` (a seam like `write`)."""
    os.fsync(fd)


class RegistryState(RefCounts):
    """The service's registry: the one reference-counting core (`RefCounts`, shares per client) driven
    by journaled operations, plus what the journal must remember besides the counts: the last
    applied operation id, deletions not yet done, and files attempts are writing (intents).
    `apply` returns the paths that became deletable."""

    def __init__(self) -> None:
        super().__init__()
        self.pending_delete: Set[str] = set()
        self.intents: Dict[str, int] = {}  # files an attempt of the running service may be writing
        self.last_id = 0

    def apply(self, op: list) -> List[str]:
        kind, op_id = op[0], op[1]
        if op_id <= self.last_id:
            return []  # already applied (re-sent after a restart)
        self.last_id = op_id
        doomed: List[str] = []
        if kind == "intent":  # an attempt is about to create `path`
            self.intents[op[2]] = int(op[3]) if len(op) > 3 else int(time.time() * 1000)
        elif kind == "start":
            _, _, path, n, owners = op
            self.start(path, n, owners)
            self.intents.pop(path, None)
        elif kind == "stop":
            self.stop(op[2])
        elif kind == "release":
            if self.release(op[2], op[3], 1):
                doomed.append(op[2])
        elif kind == "drop_client":
            # A dead client's shares become orphans, settled after a grace period (`resolve_orphan`).
            # "*": a new service; every client and attempt of the previous one is gone.
            client = str(op[2])
            since = int(op[3]) if len(op) > 3 else int(time.time() * 1000)
            if client == "*":
                for path in list(self.intents):  # files its attempts may have left: orphans too
                    self.adopt_orphan(path, since)
                self.intents.clear()
            self.drop_owner(None if client == "*" else client, since)
        elif kind == "discard":
            self.intents.pop(op[2], None)
            self.entries.pop(op[2], None)
            self.orphans.pop(op[2], None)
            doomed.append(op[2])
        elif kind == "deleted":
            self.pending_delete.discard(op[2])
        else:
            raise ValueError(f"unknown registry operation {kind!r}")
        self.pending_delete.update(doomed)
        return doomed

    def resolve_orphan(self, path: str, keep: bool) -> List[str]:  # type: ignore[override]
        """`RefCounts.resolve_orphan`, returning the deletable paths (and remembering them)."""
        doomed = [path] if super().resolve_orphan(path, keep) else []
        self.pending_delete.update(doomed)
        return doomed

    def to_json(self) -> dict:
        return {"last_id": self.last_id, "entries": self.entries, "pending_delete": sorted(self.pending_delete),
                "orphans": self.orphans, "intents": self.intents}

    @classmethod
    def from_json(cls, d: dict) -> "RegistryState":
        s = cls()
        s.last_id = int(d.get("last_id", 0))
        s.entries = {p: [int(v[0]), {str(c): int(k) for c, k in v[1].items()}] for p, v in d["entries"].items()}
        s.pending_delete = set(d.get("pending_delete", ()))
        s.orphans = {p: [int(v[0]), int(v[1])] for p, v in d.get("orphans", {}).items()}
        s.intents = {p: int(v) for p, v in d.get("intents", {}).items()}
        return s


class Journal:
    """Append-only log + snapshot in `directory`; `load()` rebuilds the state, `append()` records an op.

    Deletions finished ("deleted" records) carry id 0: they are facts about the file system, not
    service operations, and never advance `last_id`.
    """

    def __init__(self, directory: str, compact_every: int = 20000):
        self.directory = directory
        self.compact_every = compact_every
        os.makedirs(directory, mode=0o700, exist_ok=True)
        self._log_path = os.path.join(directory, LOG)
        self._snap_path = os.path.join(directory, SNAPSHOT)
        self._fd: Optional[int] = None
        self._records = 0
        self._size = 0  # bytes of whole records in the log
        self._torn: Optional[int] = None  # set while a failed record could not be cut off

    def load(self) -> RegistryState:
        state = RegistryState()
        try:
            with open(self._snap_path) as f:
                state = RegistryState.from_json(json.load(f))
        except FileNotFoundError:
            pass
        good_bytes = 0
        try:
            with open(self._log_path, "rb") as f:
                data = f.read()
        except FileNotFoundError:
            data = b""
        for line in data.split(b"\n"):
            if not line:
                continue
            try:
                op = json.loads(line)
            except ValueError:
                log.warning("registry journal: ignoring a torn record at byte %d", good_bytes)
                break
            self._replay(state, op)
            good_bytes += len(line) + 1
            self._records += 1
        if good_bytes < len(data):
            with open(self._log_path, "r+b") as f:
                f.truncate(good_bytes)
        self._fd = os.open(self._log_path, os.O_WRONLY | os.O_CREAT | os.O_APPEND, 0o600)
        self._size = good_bytes
        return state

    @staticmethod
    def _replay(state: RegistryState, op: list) -> None:
        if op[0] == "deleted":
            state.pending_delete.discard(op[2])
        elif op[0] == "orphan":  # ["orphan", 0, path, keep]: the registry's own decision, a fact
            state.resolve_orphan(op[2], bool(op[3]))
        else:
            state.apply(op)

    def append(self, op: list, sync: Optional[bool] = None) -> None:
        """Record `op` wholly (and fsynced if `sync`, default: for SYNCED kinds) or raise JournalError
        with the journal cut back to its last whole record."""
        assert self._fd is not None, "load() first"
        if sync is None:
            sync = op[0] in SYNCED
        data = memoryview(json.dumps(op, separators=(",", ":")).encode() + b"\n")
        if self._torn is not None:
            self._cut(self._torn)  # raises while the tail cannot be cut off
        start = self._size
        try:
            done = 0
            while done < len(data):  # a short write is not an error: write the rest
                n = write(self._fd, data[done:])
                if n <= 0:
                    raise OSError(errno.EIO, "write(2) wrote nothing")
                done += n
            if sync:
                fsync(self._fd)
        except OSError as exc:
            self._cut(start, exc)
            raise JournalError(exc.errno or errno.EIO,
                               f"the registry journal {self._log_path} could not record a {op[0]!r} "
                               f"operation ({exc.strerror or exc}); it was not applied") from exc
        self._size = start + len(data)
        self._records += 1

    def _cut(self, size: int, cause: Optional[OSError] = None) -> None:
        """Truncate the log back to `size` bytes (drop a partial record); remember if that fails."""
        try:
            os.ftruncate(self._fd, size)
            self._torn = None
        except OSError as exc:
            self._torn = size
            log.error("registry journal %s: cannot cut off a failed record (%s); every operation fails "
                      "until it can", self._log_path, exc)
            if cause is None:
                raise JournalError(exc.errno or errno.EIO,
                                   f"the registry journal {self._log_path} cannot be repaired ({exc}); "
                                   "the operation was not applied") from exc

    def needs_compaction(self) -> bool:
        return self._records >= self.compact_every

    def compact(self, state: RegistryState) -> None:
        """Write the snapshot atomically (whole, fsync, rename), then start an empty log. On failure
        (e.g. ENOSPC) the old snapshot and log stay as they were: raises JournalError."""
        tmp = self._snap_path + ".tmp"
        try:
            fd = os.open(tmp, os.O_WRONLY | os.O_CREAT | os.O_TRUNC, 0o600)
            try:
                data = memoryview(json.dumps(state.to_json()).encode())
                done = 0
                while done < len(data):
                    done += write(fd, data[done:])
                fsync(fd)
            finally:
                os.close(fd)
            os.replace(tmp, self._snap_path)
        except OSError as exc:
            try:
                os.unlink(tmp)
            except OSError:
                pass
            self._records = max(0, self._records - self.compact_every // 4)  # try again a little later
            raise JournalError(exc.errno or errno.EIO, f"the registry snapshot could not be written ({exc})") \
                from exc
        if self._fd is not None:
            os.close(self._fd)
        self._fd = os.open(self._log_path, os.O_WRONLY | os.O_CREAT | os.O_TRUNC | os.O_APPEND, 0o600)
        self._records = 0
        self._size = 0
        self._torn = None
        dfd = os.open(self.directory, os.O_RDONLY)
        try:
            os.fsync(dfd)
        finally:
            os.close(dfd)

    def close(self) -> None:
        if self._fd is not None:
            os.close(self._fd)
            self._fd = None


__all__ = ["RegistryState", "Journal", "JournalError", "SYNCED"]
