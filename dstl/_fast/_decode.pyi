"""Type stubs for the Cython module `dstl._fast._decode` (twin: `_decode_py.py`): change-set decoding."""
from typing import Any, Iterator, List, Optional, Tuple

import numpy as np

from dstl.types import StateChange

def decode_change_set(logical: Any, offset: int = ..., key_group_range: Optional[Any] = ...) -> Tuple[List[StateChange], int]: ...
def decode_change_set_arrays(logical: Any, offset: int = ..., key_group_range: Optional[Any] = ...) -> Tuple[np.ndarray, np.ndarray, np.ndarray, int]:
    """(key_groups int32, offsets int64, lengths int64, end_offset)."""

class ChangeIterator(Iterator[StateChange]):
    def __next__(self) -> StateChange: ...
    def close(self) -> None: ...

def iter_change_set(logical: Any, offset: int = ..., key_group_range: Optional[Any] = ...) -> ChangeIterator: ...
def walk(logical: Any) -> List[Any]: ...
