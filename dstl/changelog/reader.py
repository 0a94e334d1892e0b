"""Restore side (docs/semantics.md §11): read a handle's change sets back, through a download cache.

`StateChangelogReader.get_changes(handle)` yields the `StateChange`s of every `(file, offset)` entry
in order: metadata always, data only inside `handle.key_group_range`. Local files are memory-mapped,
so only the pages of the wanted change sets are read. Files on other filesystems go through the
`DownloadCache`: downloaded and decoded once into a local temp file, then shared by every reader of
the storage until they have been idle for `download.local-cache.idle-timeout-ms`.
"""
from __future__ import annotations

import errno
import logging
import mmap
import os
import shutil
import tempfile
import weakref
import threading
import uuid
from typing import Any, Dict, List, Optional, Tuple

from dstl._timer import TimerThread
from dstl.errors import CorruptChangelogError
from dstl.changelog.handles import StreamStateHandle, is_local_filesystem
from dstl.changelog.upload.service.runtime import CACHE_PREFIX, sweep_download_caches
from dstl.types import StateChange

log = logging.getLogger(__name__)

_CHUNK = 4 << 20  # copy size for raw downloads
ArraysItem = Tuple[Any, Any, Any, Any]  # (logical buffer, key_groups, offsets, lengths)


def _format():
    from dstl import format as fmt  # imported lazily: the reader is usable before format is built

    return fmt


def _map_file(f) -> Any:
    """A read-only mmap of an open file, or b"" for an empty one (mmap refuses length 0)."""
    size = os.fstat(f.fileno()).st_size
    if size == 0:
        return b""
    return mmap.mmap(f.fileno(), 0, access=mmap.ACCESS_READ)


def _close_map(m: Any) -> None:
    if isinstance(m, mmap.mmap):
        try:
            m.close()
        except BufferError:  # a consumer still holds a view (arrays API): the GC closes it later
            pass


class _Source:
    """The logical stream of one file, open for decoding; `close()` is idempotent."""

    __slots__ = ("path", "logical", "_map", "_on_close", "_closed")

    def __init__(self, path: str, logical: Any, mapped: Any = None, on_close=None):
        self.path = path
        self.logical = logical
        self._map = mapped
        self._on_close = on_close
        self._closed = False

    def close(self, release_views: bool = True) -> None:
        if self._closed:
            return
        self._closed = True
        logical, self.logical = self.logical, None
        if release_views and isinstance(logical, memoryview):
            try:
                logical.release()
            except BufferError:
                pass
        if release_views:
            _close_map(self._map)
        self._map = None
        if self._on_close is not None:
            self._on_close()


def _open_direct(handle: StreamStateHandle) -> _Source:
    """Read a file without the cache: mmap on the local disk, whole-file download elsewhere."""
    fmt = _format()
    fs, p = handle.filesystem()
    if is_local_filesystem(fs):
        with open(p, "rb") as f:
            mapped = _map_file(f)
        try:
            logical = fmt.to_logical(mapped, handle.path)
        except BaseException:
            _close_map(mapped)
            raise
        if not (isinstance(logical, memoryview) and logical.obj is mapped):
            _close_map(mapped)  # decompressed into its own buffer: the map is no longer needed
            mapped = None
        return _Source(handle.path, logical, mapped)
    data = fs.cat_file(p)
    return _Source(handle.path, fmt.to_logical(data, handle.path))


class _Entry:
    __slots__ = ("file", "refs", "ready", "error", "size")

    def __init__(self) -> None:
        self.file: Optional[str] = None
        self.refs = 1  # the cache's own reference
        self.ready = threading.Event()
        self.error: Optional[BaseException] = None
        self.size = 0


_swept = False


def _sweep_once() -> None:
    global _swept
    if not _swept:
        _swept = True
        try:
            sweep_download_caches()
        except OSError:
            pass


class DownloadCache:
    """Decoded downloads of remote changelog files in local temp files (docs/semantics.md §11).

    One per storage, shared by its readers. Files on the local disk bypass it.
    """

    def __init__(self, idle_timeout_ms: int, directory: Optional[str] = None):
        if isinstance(idle_timeout_ms, bool) or not isinstance(idle_timeout_ms, int) or idle_timeout_ms < 0:
            raise ValueError(f"idle_timeout_ms must be an int >= 0, got {idle_timeout_ms!r}")
        self.idle_timeout_ms = idle_timeout_ms
        if directory is not None:
            os.makedirs(directory, exist_ok=True)
        _sweep_once()
        # the owner's pid in the name: a later process removes the caches of dead ones
        self.directory = tempfile.mkdtemp(prefix=f"{CACHE_PREFIX}{os.getpid()}-", dir=directory)
        # a cache nobody closed goes with its object, or at the latest when the interpreter exits
        self._finalizer = weakref.finalize(self, shutil.rmtree, self.directory, True)
        self._entries: Dict[str, _Entry] = {}
        self._lock = threading.Lock()
        self._timer = TimerThread("dstl-cache-expiry")
        self._closed = False
        self.downloads = 0  # files fetched from their filesystem
        self.hits = 0       # opens served from an existing temp file
        self._full = False  # the last download failed for want of space (see _uncached)

    def applies_to(self, handle: StreamStateHandle) -> bool:
        """False for files on the local disk (read in place) and in fsspec's in-process memory fs."""
        fs, _ = handle.filesystem()
        protocols = fs.protocol if isinstance(fs.protocol, (tuple, list)) else (fs.protocol,)
        return not is_local_filesystem(fs) and "memory" not in protocols

    def cached_paths(self) -> List[str]:
        """Remote paths with a temp file right now."""
        with self._lock:
            return [p for p, e in self._entries.items() if e.ready.is_set() and e.error is None]

    def ref_count(self, path: str) -> Optional[int]:
        with self._lock:
            entry = self._entries.get(path)
            return None if entry is None else entry.refs

    def open(self, handle: StreamStateHandle) -> _Source:
        """The decoded logical stream of `handle`'s file; close the result when done with it."""
        path = handle.path
        with self._lock:
            self._check_open()
            entry = self._entries.get(path)
            owner = entry is None
            if owner:
                entry = self._entries[path] = _Entry()
            entry.refs += 1
        if owner:
            self._download(handle, entry)
        else:
            entry.ready.wait()
        if entry.error is not None:
            self._release(path, entry)
            if isinstance(entry.error, OSError) and entry.error.errno in (errno.ENOSPC, errno.EDQUOT):
                return self._uncached(handle, entry.error)
            raise entry.error
        if owner and self._full:
            self._full = False
            log.warning("the download cache %s has room again: downloads are cached again", self.directory)
        try:
            with open(entry.file, "rb") as f:
                mapped = _map_file(f)
        except FileNotFoundError:
            self._release(path, entry)
            self._check_open()  # closed meanwhile: say so rather than "file not found"
            raise
        if not owner:
            with self._lock:
                self.hits += 1
        return _Source(path, mapped, mapped, on_close=lambda: self._release(path, entry))

    def _uncached(self, handle: StreamStateHandle, exc: OSError) -> _Source:
        """The file read straight from its filesystem into memory: the cache's disk is full (logged
        once per full spell; the next download tries the disk again)."""
        if not self._full:
            self._full = True
            log.warning("the download cache %s is full (%s): changelog files are read from the base path "
                        "without caching until it has room again", self.directory, exc.strerror or exc)
        return _open_direct(handle)

    def _download(self, handle: StreamStateHandle, entry: _Entry) -> None:
        tmp = None
        try:
            with self._lock:
                self._check_open()
            fd, tmp = tempfile.mkstemp(prefix=uuid.uuid4().hex, suffix=".logical", dir=self.directory)
            with os.fdopen(fd, "wb") as out:
                size = self._fetch_logical(handle, out)
            with self._lock:
                # close() ran during the download: it could not see this file, so drop it here
                self._check_open()
                entry.file, tmp = tmp, None
                entry.size = size
                self.downloads += 1
        except BaseException as exc:
            if self._closed and not isinstance(exc, RuntimeError):
                exc = RuntimeError("the download cache is closed")
            entry.error = exc
            if tmp is not None:
                try:
                    os.unlink(tmp)
                except OSError:
                    pass
            with self._lock:  # a later open retries the download
                if self._entries.get(handle.path) is entry:
                    del self._entries[handle.path]
        finally:
            entry.ready.set()

    @staticmethod
    def _fetch_logical(handle: StreamStateHandle, out) -> int:
        """Write the decoded logical stream of `handle`'s file to `out`; returns its length.

        A raw file (flag 0) is copied in chunks, so memory stays bounded however large the file is;
        compressed files are decoded whole (every CRC checked) by the format module.
        """
        fmt = _format()
        fs, p = handle.filesystem()
        with fs.open(p, "rb") as src:
            head = src.read(1)
            if head == bytes([fmt.FLAG_RAW]):
                size = 0
                while True:
                    chunk = src.read(_CHUNK)
                    if not chunk:
                        return size
                    out.write(chunk)
                    size += len(chunk)
            data = head + src.read()
        logical = fmt.to_logical(data, handle.path)
        out.write(logical)
        return len(memoryview(logical))

    def _release(self, path: str, entry: _Entry) -> None:
        with self._lock:
            entry.refs -= 1
            idle = entry.refs == 1 and self._entries.get(path) is entry and not self._closed
        if idle:
            try:
                self._timer.schedule(self.idle_timeout_ms / 1000.0, lambda: self._expire(path, entry))
            except RuntimeError:  # closed meanwhile; close() deletes the file
                pass

    def _expire(self, path: str, entry: _Entry) -> None:
        with self._lock:
            if entry.refs != 1 or self._entries.get(path) is not entry:
                return
            del self._entries[path]
        self._delete(entry)

    @staticmethod
    def _delete(entry: _Entry) -> None:
        if entry.file is not None:
            try:
                os.unlink(entry.file)
            except FileNotFoundError:
                pass
            except OSError:
                log.warning("could not delete cached download %s", entry.file, exc_info=True)

    def _check_open(self) -> None:
        if self._closed:
            raise RuntimeError("the download cache is closed")

    def close(self) -> None:
        """Cancel the idle checks and delete every cached file; later opens fail."""
        with self._lock:
            if self._closed:
                return
            self._closed = True
            entries = list(self._entries.values())
            self._entries.clear()
        self._timer.shutdown(wait=True)
        for entry in entries:
            self._delete(entry)
        self._finalizer()  # removes the directory (once)

    @property
    def closed(self) -> bool:
        return self._closed

    def __enter__(self) -> "DownloadCache":
        return self

    def __exit__(self, *exc) -> None:
        self.close()

    def __repr__(self) -> str:
        return (f"DownloadCache({self.directory!r}, idle_timeout_ms={self.idle_timeout_ms}, "
                f"files={len(self._entries)}, downloads={self.downloads}, hits={self.hits})")


class _HandleIterator:
    """Walks a handle's entries; keeps one file open while consecutive entries share it.

    `iter()` hands out a C-level iterator: for objects, `format.chain_changes` over one change iterator
    per entry, each building its `StateChange`s one at a time (errors surface when the entry is reached).
    """

    def __init__(self, reader: "StateChangelogReader", handle, arrays: bool):
        entries = getattr(handle, "handles_and_offsets", None)
        kgr = getattr(handle, "key_group_range", None)
        if entries is None or kgr is None:
            raise TypeError(f"expected a ChangelogStateHandleStreamImpl, got {type(handle).__name__}")
        self._reader = reader
        self._entries = entries
        self._range = kgr
        self._arrays = arrays
        self._source: Optional[_Source] = None
        self._current = None  # the change iterator of the entry being read (objects)
        self._gen = self._generate()
        self._it = self._gen if arrays else _format().chain_changes(self._gen)

    def _source_for(self, stream: StreamStateHandle) -> _Source:
        if self._source is not None and self._source.path == stream.path:
            return self._source
        self._close_source()
        self._source = self._reader._open(stream)
        return self._source

    def _close_current(self) -> None:
        current, self._current = self._current, None
        if current is not None:
            current.close()  # releases its export of the logical stream

    def _close_source(self) -> None:
        self._close_current()
        if self._source is not None:
            source, self._source = self._source, None
            source.close(release_views=not self._arrays)

    def _generate(self):
        """Per entry: the arrays tuple, or (objects) an iterator of the entry's changes."""
        fmt = _format()
        arrays = self._arrays
        try:
            for stream, offset in self._entries:
                self._close_current()  # exhausted by now: chain asks for the next entry only then
                source = self._source_for(stream)
                try:
                    if arrays:
                        kgs, offs, lens, _ = fmt.decode_change_set_arrays(source.logical, offset, self._range)
                        item = (source.logical, kgs, offs, lens)
                    else:
                        item = self._current = fmt.iter_change_set(source.logical, offset, self._range)
                except CorruptChangelogError as exc:
                    raise exc.with_file(stream.path) from None
                yield item
        finally:
            self._close_source()

    def __iter__(self):
        return self._it

    def __next__(self):
        return next(self._it)

    def close(self) -> None:
        """Close the open file; safe to call more than once."""
        self._close_current()
        self._gen.close()
        self._it = iter(())
        self._close_source()

    def __enter__(self):
        return self

    def __exit__(self, *exc) -> None:
        self.close()

    def __del__(self):
        try:
            self.close()
        except Exception:
            pass


def _open_copy(stream: StreamStateHandle, path: str) -> Optional[_Source]:
    """`stream`'s logical stream read from its local copy at `path`, or None when the copy is unusable:
    gone, unreadable, not decoding (a compressed file has every CRC or checksum checked here) or not
    of the handle's logical length. The source keeps the handle's path (errors name the file)."""
    mapped = logical = None
    try:
        with open(path, "rb") as f:
            mapped = _map_file(f)
        logical = _format().to_logical(mapped, stream.path)
        n = logical.nbytes if isinstance(logical, memoryview) else len(logical)
        if n != stream.size:
            raise ValueError(f"{n} logical bytes, the handle says {stream.size}")
    except Exception as exc:  # noqa: BLE001 - any problem with a copy means: read the base path
        log.warning("local copy %s of %s is unusable (%s); reading the base path", path, stream.path, exc)
        if isinstance(logical, memoryview):
            logical.release()
        _close_map(mapped)
        return None
    if not (isinstance(logical, memoryview) and logical.obj is mapped):
        _close_map(mapped)
        mapped = None
    return _Source(stream.path, logical, mapped)


class StateChangelogReader:
    """Reads persisted changes back; `cache` (one per storage) serves non-local files; `local`
    (a `dstl.changelog.local_recovery.LocalCopies`) lets a file be read from this host's local-recovery
    copy when there is a good one, file by file (docs/spark.md, "Local recovery")."""

    def __init__(self, cache: Optional[DownloadCache] = None, local: Any = None):
        self.cache = cache
        self.local = local
        self._local_index: Optional[Dict[str, str]] = None  # listed once, at this reader's first open

    def _open(self, stream: StreamStateHandle) -> _Source:
        if self.local is not None and self.local.enabled:
            if self._local_index is None:
                self._local_index = self.local.index()
            name = os.path.basename(stream.path.rstrip("/"))
            path = self._local_index.get(name)
            source = _open_copy(stream, path) if path is not None and path != stream.path else None
            if source is not None:
                self.local.hits += 1
                self.local.read.append(name)
                return source
            self.local.misses += 1
            self.local.rejected += path is not None and path != stream.path
        if self.cache is not None and self.cache.applies_to(stream):
            return self.cache.open(stream)
        return _open_direct(stream)

    def get_changes(self, handle) -> _HandleIterator:
        """A closeable iterator of the handle's `StateChange`s, in order (docs/semantics.md §11)."""
        return _HandleIterator(self, handle, arrays=False)

    def get_changes_arrays(self, handle) -> _HandleIterator:
        """Per change set: `(logical_buffer, key_groups, offsets, lengths)`, already filtered.

        `offsets`/`lengths` index into `logical_buffer` (no copy of the values); the buffer stays
        valid as long as it is referenced.
        """
        return _HandleIterator(self, handle, arrays=True)

    def read_all(self, handle) -> List[StateChange]:
        """Every change of the handle as a list."""
        with self.get_changes(handle) as it:
            return list(it)


__all__ = ["StateChangelogReader", "DownloadCache"]
