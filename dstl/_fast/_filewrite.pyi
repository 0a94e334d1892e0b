"""Type stubs for the Cython module `dstl._fast._filewrite` (twin: `_filewrite_py.py`).

Sealed bodies and bytes written back to back to files, in one release of the GIL.
"""
from typing import Any, Sequence

def write_bodies(fds: Sequence[int], bodies: Sequence[Any]) -> int: ...
def write_bodies_at(paths: Sequence[str], offset: int, bodies: Sequence[Any], create: bool = ...,
                    size: int = ...) -> int: ...
