"""Spark's event-time watermark rule for a StatefulStream.

Spark keeps two watermarks per micro-batch (IncrementalExecution, WatermarkTracker):

* the **eviction watermark** of batch N is the global watermark computed after batch N-1: timers
  fire and state expires against it, and `TimerValues.getCurrentWatermarkInMs()` returns it;
* the **late-events watermark** of batch N is the eviction watermark of batch N-1: input rows whose
  event time is at or before it (``event_time <= watermark``) are dropped as late.

After a batch, each watermarked column's watermark becomes ``max(event time of every input row,
late rows included) - its delay`` when that is higher than before (a column that saw no rows
keeps its value; one never seen counts as 0), and the global watermark becomes the policy's choice
over the columns (`spark.sql.streaming.multipleWatermarkPolicy`: ``min``, the default, or ``max``),
if that is higher. A checkpoint records the next batch's eviction watermark (``watermark_ms``), this
batch's (``batch_watermark_ms``, the next batch's late-events watermark), the per-column
watermarks and the policy, so a restart or a rescale continues with the same rule.
"""
from __future__ import annotations

from dataclasses import dataclass, field
from typing import Any, Dict, List, Mapping, Optional, Sequence

__all__ = ["POLICIES", "DEFAULT_POLICY", "POLICY_CONF", "Watermarks", "normalize_policy"]

POLICIES = ("min", "max")
DEFAULT_POLICY = "min"
#: the Spark SQL conf a stream takes its policy from when none is given
POLICY_CONF = "spark.sql.streaming.multipleWatermarkPolicy"


def normalize_policy(policy: Any) -> str:
    """'min' or 'max' (Spark accepts any capitalisation)."""
    name = policy.strip().lower() if isinstance(policy, str) else None
    if name not in POLICIES:
        raise ValueError(f"multiple watermark policy must be 'min' or 'max' "
                         f"({POLICY_CONF}), got {policy!r}")
    return name


@dataclass
class Watermarks:
    """One batch's watermarks, read from the checkpoint it continues from."""

    #: timers and state expiry (and TimerValues) use this one
    eviction_ms: int = 0
    #: rows with event time <= this are late
    late_ms: int = 0
    #: per watermarked column: its own watermark, None until it has seen a row
    columns: Dict[str, Optional[int]] = field(default_factory=dict)
    policy: str = DEFAULT_POLICY

    @classmethod
    def from_properties(cls, props: Optional[Mapping[str, Any]], columns: Sequence[str],
                        policy: str) -> "Watermarks":
        """The watermarks of the batch after the checkpoint with `props` (None: the first batch).
        A recorded policy wins over `policy`, as Spark's checkpointed one does."""
        if not props:
            return cls(0, 0, {c: None for c in columns}, policy)
        eviction = int(props.get("watermark_ms", 0) or 0)
        late = int(props.get("batch_watermark_ms", 0) or 0)
        recorded = dict(props.get("column_watermarks_ms") or {})
        if not recorded and columns:
            # a checkpoint from before per-column watermarks: its single column held the global one
            recorded = {columns[0]: eviction if eviction else None}
        cols = {c: (None if recorded.get(c) is None else int(recorded[c])) for c in columns}
        return cls(eviction, late, cols, normalize_policy(props.get("watermark_policy") or policy))

    def advance(self, max_event_ms: Mapping[str, Optional[int]], delays_ms: Mapping[str, int]) -> "Watermarks":
        """The next batch's watermarks, after this batch saw `max_event_ms` per column (None: no row)."""
        cols = dict(self.columns)
        for c, m in max_event_ms.items():
            if m is None:
                continue
            cand = int(m) - int(delays_ms.get(c, 0))
            if cols.get(c) is None or cand > cols[c]:
                cols[c] = cand
        values: List[int] = [0 if v is None else v for v in cols.values()]
        chosen = (min if self.policy == "min" else max)(values) if values else self.eviction_ms
        return Watermarks(max(self.eviction_ms, chosen), self.eviction_ms, cols, self.policy)

    def properties(self, batch: "Watermarks") -> Dict[str, Any]:
        """What the checkpoint of `batch` (whose successor this is) records."""
        return {"watermark_ms": self.eviction_ms, "batch_watermark_ms": batch.eviction_ms,
                "late_watermark_ms": batch.late_ms, "column_watermarks_ms": dict(self.columns),
                "watermark_policy": self.policy}
