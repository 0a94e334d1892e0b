"""Pure-Python twin of `dstl._fast._writer`: the append path of the changelog writer.

Same checks, same errors and a byte-identical buffer as the compiled `WriterCore`.
"""
from __future__ import annotations

import threading

from dstl._fast._buffer_common import META_KEY_GROUP, concurrent_append_error, writer_key_group
from dstl._fast._buffer_py import ChangeBuffer
from dstl.errors import WriterClosedError


class WriterCore:
    """Twin of the Cython `WriterCore`: the append path of `FsStateChangelogWriter` (its base class).

    Same checks and errors as the Cython class. This one takes the writer's `_lock` per append, which
    makes each append atomic as the GIL makes the Cython one.
    """

    def __new__(cls, *args, **kwargs):
        self = super().__new__(cls)
        self._buffer = ChangeBuffer()
        self._closed = False
        self._kg_start = 0
        self._kg_end = -1
        self._threshold = 0
        self._flusher = 0
        return self

    def _enter(self) -> None:
        if self._flusher and self._flusher != threading.get_ident():
            raise concurrent_append_error(self, self._flusher, threading.get_ident())
        if self._closed:
            raise WriterClosedError(f"changelog writer {self.log_id} is closed")

    def _after(self) -> None:
        if self._buffer.size < self._threshold:
            return
        prev, self._flusher = self._flusher, threading.get_ident()
        try:
            self._preemptive()
        finally:
            self._flusher = prev

    def append(self, key_group, data) -> None:
        """Add one data change; may upload pre-emptively (and then block on back-pressure)."""
        with self._lock:
            self._enter()
            if type(key_group) is not int:
                key_group = writer_key_group(key_group)
            if key_group < self._kg_start or key_group > self._kg_end:
                raise ValueError(f"key group {key_group!r} is outside the writer's range {self.key_group_range}")
            self._buffer.append(key_group, data)
        self._after()

    def append_meta(self, data) -> None:
        """Add one metadata change (key group -1; read back by every subtask on restore)."""
        with self._lock:
            self._enter()
            self._buffer.append(META_KEY_GROUP, data)
        self._after()

    def _take_active(self):
        """Seal the active change set: `(body, payload size, number of changes)`, or None when empty."""
        buf = self._buffer
        n = len(buf)
        if n == 0:
            return None
        size = buf.size
        return buf.seal_body(), size, n
