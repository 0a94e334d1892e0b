"""TaskReport: one subtask's result for one micro-batch, the one row its task returns to the driver
(REPORT_SCHEMA), and the state snapshot it carries as the checkpoint metadata records it."""
from __future__ import annotations

import json
from dataclasses import dataclass
from typing import Optional

from dstl.state.backend import KeyedStateSnapshot
from dstl.state.metadata import SubtaskState

REPORT_SCHEMA = (
    "subtask int, attempt int, token string, snapshot binary, staged string, rows_in long, "
    "rows_out long, restored boolean, restore_ms double, process_ms double, snapshot_ms double, "
    "state_size long, pid int, host string, cache_hits long, cache_misses long, metrics string, continued boolean, "
    "executor string, restore_source string, hop_ms double, start_ms double")


@dataclass
class TaskReport:
    """One subtask's result for one micro-batch, as the driver reads it back."""

    subtask: int
    attempt: int
    token: str
    snapshot: bytes
    staged: Optional[str]
    rows_in: int
    rows_out: int
    restored: bool
    restore_ms: float
    process_ms: float
    #: pre-commit of this checkpoint in the task: output staged + state snapshot persisted
    snapshot_ms: float
    state_size: int
    pid: int
    host: str
    cache_hits: int
    cache_misses: int
    #: JSON of the counters `fn` added through `task_metrics()` (e.g. timers fired)
    metrics: str = "{}"
    #: the backend continued from this worker's memory (a cache hit)
    continued: bool = False
    #: the Spark executor that ran the task ("driver" in local mode)
    executor: str = ""
    #: where the state came from: "memory" (continued), "local" (this host's local-recovery copy),
    #: "dfs" (the base path), "new" (no checkpoint yet)
    restore_source: str = ""
    #: the rows' way from the worker to the subtask's slot process (dstl.spark.slot_client); 0 in the worker
    hop_ms: float = 0.0
    #: from taking the subtask's state to calling fn: continuing (ms) or restoring it, confirming
    #: the completed checkpoint, pruning local copies (the hop not included)
    start_ms: float = 0.0

    @classmethod
    def from_row(cls, row) -> "TaskReport":
        d = row.asDict() if hasattr(row, "asDict") else dict(row)
        d["snapshot"] = bytes(d["snapshot"])
        if d.get("metrics") is None:
            d["metrics"] = "{}"
        d["continued"] = bool(d.get("continued"))
        d["executor"] = d.get("executor") or ""
        d["restore_source"] = d.get("restore_source") or ""
        d["hop_ms"] = float(d.get("hop_ms") or 0.0)
        d["start_ms"] = float(d.get("start_ms") or 0.0)
        return cls(**d)

    def metric(self, name: str, default: int = 0) -> int:
        return json.loads(self.metrics or "{}").get(name, default)


def snapshot_to_subtask_state(index: int, snapshot_bytes: bytes) -> SubtaskState:
    """A task's serialised KeyedStateSnapshot -> the SubtaskState the checkpoint metadata records."""
    return SubtaskState.from_keyed_snapshot(index, KeyedStateSnapshot.from_bytes(snapshot_bytes))
