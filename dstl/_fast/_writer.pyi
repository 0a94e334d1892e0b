"""Type stubs for the Cython module `dstl._fast._writer` (twin: `_writer_py.py`).

`WriterCore` is the changelog writer's append path (no lock, one thread).
"""
from typing import Any

class WriterCore:
    """Base of `FsStateChangelogWriter`: the per-record append path."""
    _closed: bool
    _kg_start: int
    _kg_end: int
    _threshold: int
    def append(self, key_group: int, data: Any) -> None: ...
    def append_meta(self, data: Any) -> None: ...
