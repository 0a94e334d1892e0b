"""Where a batch's subtasks ran and how each got its state: the figures the driver logs once per
batch (INFO, logger ``dstl.spark.placement``), records in the checkpoint's properties
(``placement``) and `dstl state ls` shows."""
from __future__ import annotations

import logging
from typing import Any, Dict, List, Optional, Sequence

log = logging.getLogger(__name__)


def placement_figures(reports: Sequence[Any], previous_executors: Optional[Sequence[str]] = None) -> Dict[str, Any]:
    """Per-batch figures from the task reports (ordered by subtask).

    A subtask is *warm* when it continued from its worker's memory, *restored* when it rebuilt its
    state from a checkpoint (``sources`` says from where: this host's local copy or the base path),
    *new* on a job's first batch; *moved* when it ran on another executor than in the previous
    checkpoint (`previous_executors`, same parallelism only)."""
    executors = [r.executor for r in reports]
    same = previous_executors is not None and len(previous_executors) == len(reports)
    moved = [i for i, r in enumerate(reports) if same and previous_executors[i] != r.executor]
    restored = [r for r in reports if r.restored]
    return {
        "subtasks": len(reports),
        "warm": sum(1 for r in reports if r.continued),
        "restored": len(restored),
        "moved": len(moved),
        "restore_ms_max": round(max((r.restore_ms for r in restored), default=0.0), 1),
        "executors": executors,
        "sources": [r.restore_source or ("memory" if r.continued else "dfs" if r.restored else "new")
                    for r in reports],
        "restore_ms": [round(r.restore_ms, 1) for r in reports],
        "moved_subtasks": moved,
    }


def describe(batch: int, checkpoint_id: int, figures: Dict[str, Any]) -> str:
    """The one INFO line per batch: counts, then subtask@executor:how[restore ms]."""
    parts: List[str] = []
    for i, (ex, src, ms) in enumerate(zip(figures["executors"], figures["sources"], figures["restore_ms"])):
        how = "warm" if src == "memory" else src if src == "new" else f"restored from {src} {ms:.0f} ms"
        if i in figures.get("moved_subtasks", ()):
            how += ", moved"
        parts.append(f"{i}@{ex or '?'}:{how}")
    return (f"batch {batch} (checkpoint {checkpoint_id}): {figures['subtasks']} subtasks, {figures['warm']} warm, "
            f"{figures['restored']} restored (max {figures['restore_ms_max']:.0f} ms), {figures['moved']} moved; "
            + "; ".join(parts))


def log_batch(batch: int, checkpoint_id: int, figures: Dict[str, Any]) -> None:
    log.info("%s", describe(batch, checkpoint_id, figures))
