"""Exceptions raised by dstl."""
from __future__ import annotations

from typing import Optional


class DstlError(Exception):
    """Base class of dstl's own errors."""


class CorruptChangelogError(DstlError, ValueError):
    """Malformed changelog bytes (docs/format.md §8): carries the file, the offset and the reason."""

    def __init__(self, reason: str, offset: int, file: Optional[str] = None, *, file_offset: bool = False):
        self.reason = reason
        self.offset = offset
        self.file = file
        self.file_offset = file_offset
        where = "file offset" if file_offset else "offset"
        prefix = f"{file}: " if file else ""
        super().__init__(f"{prefix}corrupt changelog at {where} {offset}: {reason}")

    def with_file(self, file: str) -> "CorruptChangelogError":
        """The same error, naming `file` (decoders raise without knowing the path)."""
        if self.file == file:
            return self
        err = CorruptChangelogError(self.reason, self.offset, file, file_offset=self.file_offset)
        err.__cause__ = self.__cause__
        return err


class WriterClosedError(DstlError, RuntimeError):
    """An operation on a closed writer (docs/semantics.md §4.1, §12 row 1 and 3)."""


class UploadServiceError(DstlError, OSError):
    """The host's upload service (process mode) died or cannot be reached."""
