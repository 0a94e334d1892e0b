"""The registry's state on local disk: an append-only journal of operations plus a compacted snapshot.

State = tracked files (path -> [count, {client: outstanding}]), orphans (files a dead client still held
a share of: path -> [since wall-clock ms, outstanding]) and files waiting for deletion.
Every operation carries an id given by the service; the journal records it, so after a restart the
service re-sends only what the registry had not applied (exactly-once, no double release).

Records are JSON lines written with one `write()` each and flushed: a killed process loses nothing the
kernel has (fsync happens at compaction; a power loss may drop the last records, which only leaves
files for `dstl gc`). A torn last line is ignored.
"""
from __future__ import annotations

import json
import logging
import os
import time
from typing import Dict, List, Optional, Set

log = logging.getLogger(__name__)

SNAPSHOT = "snapshot.json"
LOG = "journal.log"


class RegistryState:
    """Reference counts with per-client shares; `apply` returns the paths that became deletable."""

    def __init__(self) -> None:
        self.entries: Dict[str, List] = {}  # path -> [count, {client: outstanding}]
        self.pending_delete: Set[str] = set()
        self.orphans: Dict[str, List[int]] = {}  # path -> [since_ms, outstanding change sets]
        self.last_id = 0

    def apply(self, op: list) -> List[str]:
        kind, op_id = op[0], op[1]
        if op_id <= self.last_id:
            return []  # already applied (re-sent after a restart)
        self.last_id = op_id
        doomed: List[str] = []
        if kind == "start":
            _, _, path, n, owners = op
            self.entries[path] = [int(n), {str(c): int(k) for c, k in (owners or {}).items()}]
            self.orphans.pop(path, None)
        elif kind == "stop":
            self.entries.pop(op[2], None)
            self.orphans.pop(op[2], None)
        elif kind == "release":
            self._release(op[2], op[3], 1, doomed)
        elif kind == "drop_client":
            # A dead client's shares are not released: a checkpoint written by someone else (a Spark
            # driver) may already reference the file. They become orphans, resolved after a grace
            # period by `resolve_orphan` (kept if a checkpoint references the file, else released).
            client = str(op[2])
            since = int(op[3]) if len(op) > 3 else int(time.time() * 1000)
            for path in [p for p, (_, shares) in self.entries.items() if shares.get(client)]:
                outstanding = self.entries[path][1].pop(client)
                orphan = self.orphans.setdefault(path, [since, 0])
                orphan[1] += outstanding
        elif kind == "discard":
            self.entries.pop(op[2], None)
            self.orphans.pop(op[2], None)
            doomed.append(op[2])
        elif kind == "deleted":
            self.pending_delete.discard(op[2])
        else:
            raise ValueError(f"unknown registry operation {kind!r}")
        self.pending_delete.update(doomed)
        return doomed

    def resolve_orphan(self, path: str, keep: bool) -> List[str]:
        """Settle an orphan: `keep` (a checkpoint references it) untracks the file like `stop`;
        otherwise its outstanding change sets are released (deleted at 0). Returns deletable paths."""
        orphan = self.orphans.pop(path, None)
        doomed: List[str] = []
        if orphan is None or path not in self.entries:
            return doomed
        if keep:
            del self.entries[path]
        else:
            self._release(path, None, orphan[1], doomed)
        self.pending_delete.update(doomed)
        return doomed

    def expired_orphans(self, now_ms: int, grace_ms: int) -> List[str]:
        return sorted(p for p, (since, _) in self.orphans.items() if since + grace_ms <= now_ms)

    def _release(self, path: str, client: Optional[str], times: int, doomed: List[str]) -> None:
        entry = self.entries.get(path)
        if entry is None:
            log.warning("release of untracked changelog file %s ignored", path)
            return
        shares = entry[1]
        if client is not None and shares.get(client):
            left = shares[client] - times
            if left > 0:
                shares[client] = left
            else:
                del shares[client]
        entry[0] -= times
        if entry[0] <= 0:
            del self.entries[path]
            self.orphans.pop(path, None)
            doomed.append(path)

    def ref_count(self, path: str) -> Optional[int]:
        entry = self.entries.get(path)
        return None if entry is None else entry[0]

    def to_json(self) -> dict:
        return {"last_id": self.last_id, "entries": self.entries, "pending_delete": sorted(self.pending_delete),
                "orphans": self.orphans}

    @classmethod
    def from_json(cls, d: dict) -> "RegistryState":
        s = cls()
        s.last_id = int(d.get("last_id", 0))
        s.entries = {p: [int(v[0]), {str(c): int(k) for c, k in v[1].items()}] for p, v in d["entries"].items()}
        s.pending_delete = set(d.get("pending_delete", ()))
        s.orphans = {p: [int(v[0]), int(v[1])] for p, v in d.get("orphans", {}).items()}
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
        return state

    @staticmethod
    def _replay(state: RegistryState, op: list) -> None:
        if op[0] == "deleted":
            state.pending_delete.discard(op[2])
        elif op[0] == "orphan":  # ["orphan", 0, path, keep]: the registry's own decision, a fact
            state.resolve_orphan(op[2], bool(op[3]))
        else:
            state.apply(op)

    def append(self, op: list) -> None:
        assert self._fd is not None, "load() first"
        os.write(self._fd, json.dumps(op, separators=(",", ":")).encode() + b"\n")
        self._records += 1

    def needs_compaction(self) -> bool:
        return self._records >= self.compact_every

    def compact(self, state: RegistryState) -> None:
        """Write the snapshot atomically (fsync + rename), then start an empty log."""
        tmp = self._snap_path + ".tmp"
        with open(tmp, "w") as f:
            json.dump(state.to_json(), f)
            f.flush()
            os.fsync(f.fileno())
        os.replace(tmp, self._snap_path)
        if self._fd is not None:
            os.close(self._fd)
        self._fd = os.open(self._log_path, os.O_WRONLY | os.O_CREAT | os.O_TRUNC | os.O_APPEND, 0o600)
        self._records = 0
        dfd = os.open(self.directory, os.O_RDONLY)
        try:
            os.fsync(dfd)
        finally:
            os.close(dfd)

    def close(self) -> None:
        if self._fd is not None:
            os.close(self._fd)
            self._fd = None


__all__ = ["RegistryState", "Journal"]
