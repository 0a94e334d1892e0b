"""A running query's parallelism changed between two micro-batches (`StatefulStream.rescale`,
`StatefulJob.rescale`): the bounds check, done before anything changes, and what a batch reports
when it moved state to a new parallelism.

The move itself is the restore that a restart at another parallelism runs: the next batch's plan
carries the new parallelism (dstl.spark.coordinator.plan), each task evicts its backends of the
old parallelism and restores its new key-group range from the latest checkpoint, this host's local
copies first (dstl.spark.restore), and the checkpoint it completes records the new parallelism.
"""
from __future__ import annotations

from typing import Any, Optional


def check_rescale(parallelism: Any, max_parallelism: int) -> int:
    """`parallelism` if it is an int in 1..max_parallelism, else ValueError naming it and the bounds."""
    if isinstance(parallelism, bool) or not isinstance(parallelism, int) \
            or not 1 <= parallelism <= max_parallelism:
        raise ValueError(f"rescale({parallelism!r}): parallelism must be an int in 1..{max_parallelism} "
                         f"(the job's max parallelism)")
    return parallelism


def rescaled_from(latest: Any, parallelism: int) -> Optional[int]:
    """The parallelism of the checkpoint `latest` when a batch at `parallelism` moved state from it."""
    if latest is None or getattr(latest, "parallelism", parallelism) == parallelism:
        return None
    return int(latest.parallelism)
