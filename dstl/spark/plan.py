"""CheckpointPlan: what the driver ships to every task of one micro-batch (built by
dstl.spark.coordinator, pickled into the task)."""
from __future__ import annotations

from dataclasses import dataclass, field
from typing import Any, Dict, Optional, Tuple


@dataclass(frozen=True)
class CheckpointPlan:
    """Everything a task needs for one micro-batch (built by the coordinator, pickled into the task)."""

    job_id: str
    operator_id: str
    base_path: str
    #: the changelog storage's options as `dstl.dfs.*` keys, the file system's keyword arguments as
    #: `dstl.dfs.fs.<name>` (credentials among them: in memory only, left out of the repr)
    storage_mapping: Dict[str, Any] = field(repr=False)
    checkpoint_id: int
    batch: int
    parallelism: int
    max_parallelism: int
    output_path: Optional[str]
    #: latest completed checkpoint (None: fresh start) and its accepted attempt tokens per subtask
    #: (None when its parallelism or max parallelism differs: then nothing can be continued from memory)
    restore_checkpoint_id: Optional[int] = None
    restore_tokens: Optional[Tuple[str, ...]] = None
    backend_options: Dict[str, Any] = field(default_factory=dict)
    #: False: the benchmark baseline, state only in the worker's memory (no changelog, no recovery)
    durable: bool = True
    #: call `fn` also for a subtask without rows (StatefulStream: timers fire without input)
    call_without_rows: bool = False

    def staging_dir(self) -> str:
        return f"{self.output_path.rstrip('/')}/_staging/batch-{self.batch:06d}"
