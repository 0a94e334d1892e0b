"""The "auto" parallelism policy: the next micro-batch's number of subtasks from the last batches'
durations against a target batch time (the trigger interval), with hysteresis.

Pure Python, no Spark: `StatefulStream(parallelism="auto", autoscale=(lo, hi))` feeds it each
batch's seconds and rows and applies what it returns with `rescale`.

How it decides: over the last `window` batches at the current parallelism, the median batch time
`t`. Above `up` x target the stream falls behind: it grows to the parallelism that would bring `t`
to `aim` x target (assuming time scales as 1/P), at least +1. Below `down` x target it holds cores
it does not need: it shrinks the same way, at least -1. Between the two it stays. After a change
it waits for `window` batches at the new parallelism (the batch that moves state is not counted),
so one slow batch never flips it and it never flaps between two values.
"""
from __future__ import annotations

import math
import statistics
from dataclasses import dataclass, field
from typing import Any, List, Optional


@dataclass
class AutoscalePolicy:
    """Bounds, target and hysteresis of the "auto" parallelism (see the module docstring)."""

    min_parallelism: int
    max_parallelism: int
    #: the batch time to keep under: the query's trigger interval
    target_seconds: float = 10.0
    #: grow above up x target, shrink below down x target, aim at aim x target
    up: float = 0.8
    down: float = 0.3
    aim: float = 0.5
    #: batches at one parallelism before the next decision
    window: int = 3
    _times: List[float] = field(default_factory=list, repr=False)
    _skip: int = field(default=0, repr=False)

    def __post_init__(self) -> None:
        lo, hi = self.min_parallelism, self.max_parallelism
        for name, v in (("min", lo), ("max", hi)):
            if isinstance(v, bool) or not isinstance(v, int) or v < 1:
                raise ValueError(f"autoscale {name} parallelism must be an int >= 1, got {v!r}")
        if lo > hi:
            raise ValueError(f"autoscale bounds ({lo}, {hi}): the minimum exceeds the maximum")
        if not (self.target_seconds > 0):
            raise ValueError(f"autoscale target_seconds must be > 0, got {self.target_seconds!r}")
        if not (0 < self.down < self.aim < self.up):
            raise ValueError(f"autoscale thresholds need 0 < down < aim < up, got down={self.down}, "
                             f"aim={self.aim}, up={self.up}")
        if isinstance(self.window, bool) or not isinstance(self.window, int) or self.window < 1:
            raise ValueError(f"autoscale window must be an int >= 1, got {self.window!r}")

    @classmethod
    def of(cls, spec: Any, max_parallelism: Optional[int] = None) -> "AutoscalePolicy":
        """A policy from `(lo, hi)`, `(lo, hi, target_seconds)` or a policy (returned as is)."""
        if isinstance(spec, AutoscalePolicy):
            return spec
        if not isinstance(spec, (tuple, list)) or len(spec) not in (2, 3):
            raise ValueError(f"autoscale must be (min, max) or (min, max, target_seconds), got {spec!r}")
        policy = cls(*spec)
        if max_parallelism is not None and policy.max_parallelism > max_parallelism:
            raise ValueError(f"autoscale maximum {policy.max_parallelism} exceeds max_parallelism "
                             f"{max_parallelism}")
        return policy

    def clamp(self, parallelism: int) -> int:
        return max(self.min_parallelism, min(self.max_parallelism, parallelism))

    def observe(self, parallelism: int, seconds: float, rescaled: bool = False) -> int:
        """Record one batch (run at `parallelism`, `rescaled`: it moved state) and return the
        parallelism for the next one."""
        if rescaled:
            self._times.clear()
            return parallelism
        self._times.append(float(seconds))
        if len(self._times) < self.window:
            return parallelism
        t = statistics.median(self._times[-self.window:])
        limit = self.target_seconds
        wanted = parallelism
        if t > self.up * limit:
            wanted = max(parallelism + 1, math.ceil(parallelism * t / (self.aim * limit)))
        elif t < self.down * limit:
            wanted = min(parallelism - 1, max(1, math.ceil(parallelism * t / (self.aim * limit))))
        wanted = self.clamp(wanted)
        if wanted != parallelism:
            self._times.clear()
        return wanted

