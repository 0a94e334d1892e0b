"""Type stubs for the Cython module `dstl._fast._statecols` (twin: `_statecols_py.py`): vectorised state rows."""
from typing import Any, List, Optional, Sequence, Tuple

import numpy as np

def encode_rows(prefix: bytes, specs: Sequence[tuple], n: int) -> Tuple[np.ndarray, np.ndarray]: ...
def dict_update_rows(tables: List[Optional[dict]], kg_start: int, kgs: np.ndarray, keys: Any, values: Any) -> None: ...
