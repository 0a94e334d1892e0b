"""What a keyed state kind needs from the backend that holds it.

`KeyedStateBackend` (dstl.state.backend) builds the kinds (value, list, map, reducing) and hands each
itself; the kinds call back only into the members listed here. Writing the kinds against this
Protocol instead of the backend class keeps the imports one way: the backend imports the kinds, the
kinds import this module, and nothing here imports the backend.
"""
from __future__ import annotations

from typing import Any, Callable, Dict, Protocol

import numpy as np

from dstl.state.columns import Column
from dstl.types import KeyGroupRange


class StateHost(Protocol):
    """The backend as a state kind sees it: the table, the key-group checks and the append paths."""

    max_parallelism: int
    key_group_range: KeyGroupRange
    _kg_start: int
    #: key group -> state name -> key -> value
    _table: Dict[int, Dict[str, dict]]
    #: the kernel's single-key appender (dstl/_fast/_keyed); `for_state` binds one state to it
    _k: Any
    #: key -> key group, refusing keys of the wrong type or outside `key_group_range`
    _kg: Callable[[Any], int]

    def _check_kgs(self, kgs: np.ndarray, col: Column) -> None:
        """Raise ValueError naming the first row whose key group is outside the range."""

    def _append(self, kg: int, payload: bytes) -> None:
        """Append one change to key group `kg`."""

    def _append_many(self, kgs: np.ndarray, data: np.ndarray, offsets: np.ndarray) -> None:
        """Append one change per row of a batch."""

    def _mutated(self, n: int = 1) -> None:
        """After the table changed: raise a deferred append error, or materialize when due."""
