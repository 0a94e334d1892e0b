"""One upload attempt: a batch of tasks -> one changelog file (docs/semantics.md §7.1, docs/format.md §5, §9)."""
from __future__ import annotations

import abc
import errno
import logging
import mmap
import os
import threading
import time
import uuid
from typing import Optional, Sequence

from dstl.changelog import fs as dfs
from dstl.format import FLAG_RAW, write_bodies, write_bodies_at, write_file
from dstl.changelog.handles import StreamStateHandle

from dstl.changelog.upload.task import UploadTask, UploadTasksResult

log = logging.getLogger(__name__)


class StateChangeUploader(abc.ABC):
    """Uploads the change sets of several tasks as one file; one call = one attempt."""

    @abc.abstractmethod
    def upload(self, tasks: Sequence[UploadTask]) -> UploadTasksResult:
        """Write one file holding every change set of `tasks`; raise on any failure (tasks untouched)."""

    def close(self) -> None:
        """Release resources; the default has none."""


class _Tee:
    """A write-only file object that writes every chunk to two files (remote and local copy)."""

    def __init__(self, a, b):
        self._a, self._b = a, b

    def write(self, data) -> int:
        self._a.write(data)
        self._b.write(data)
        return len(data)

    def flush(self) -> None:
        self._a.flush()
        self._b.flush()

    def writable(self) -> bool:
        return True


class FileSpan:
    """A change-set body that is a byte range of an open file (the upload service's shared-memory
    segment), read with pread: nothing is mapped into the uploader. A raw local file gets it through
    `send_to`; everything else (compression, remote filesystems) streams it through `write_to`, like
    any other streaming body."""

    __slots__ = ("fd", "offset", "length", "mapped")

    def __init__(self, fd: int, offset: int, length: int, mapped=None):
        # `mapped`: the whole segment, mapped read-only by the uploader process and kept (MappedSegments)
        self.fd, self.offset, self.length, self.mapped = fd, offset, length, mapped

    def __len__(self) -> int:
        return self.length

    def write_to(self, write, chunk_size: int = 1 << 20) -> int:
        """Call `write(piece)` with the span's bytes in order (fresh bytes per piece); returns the length."""
        pos, end = self.offset, self.offset + self.length
        while pos < end:
            piece = os.pread(self.fd, min(chunk_size, end - pos), pos)
            if not piece:
                raise EOFError(f"the shared-memory segment ends at {pos}, before its change set's end {end}")
            write(piece)
            pos += len(piece)
        return self.length

    def send_to(self, out_fd: int) -> None:
        """Append the span to `out_fd` (at its file position). A large span is mapped with
        MAP_POPULATE and written in one write(2): the kernel copies straight from the segment's pages
        into the page cache, one copy, with the page tables filled in one go instead of one fault per
        page (a plain mapping) or a pread into a buffer first (docs/service.md). Small spans, and
        systems without MAP_POPULATE, go a piece at a time through one reused buffer the size of the
        L2 cache (about twice as fast as sendfile(2) from tmpfs into ext4). A span whose segment the
        uploader keeps mapped is written from that mapping: no mapping work per attempt at all."""
        if self.mapped is not None:
            with memoryview(self.mapped) as whole:
                _write_all(out_fd, whole[self.offset:self.offset + self.length])
            return
        if self.length >= MAP_MIN and _POPULATE:
            self._map_to(out_fd)
            return
        buf = _pieces.pop() if _pieces else bytearray(SEND_PIECE)
        view = memoryview(buf)
        try:
            pos, end = self.offset, self.offset + self.length
            while pos < end:
                n = os.preadv(self.fd, [view[:min(SEND_PIECE, end - pos)]], pos)
                if n == 0:
                    raise EOFError(f"the shared-memory segment ends at {pos}, before its change set's end {end}")
                _write_all(out_fd, view[:n])
                pos += n
        finally:
            view.release()
            _pieces.append(buf)

    def _map_to(self, out_fd: int) -> None:
        end = self.offset + self.length
        size = os.fstat(self.fd).st_size
        if size < end:  # checked first: touching a mapping past the file's end is SIGBUS, not an error
            raise EOFError(f"the shared-memory segment ends at {size}, before its change set's end {end}")
        start = self.offset - self.offset % mmap.ALLOCATIONGRANULARITY
        m = mmap.mmap(self.fd, end - start, flags=mmap.MAP_SHARED | _POPULATE, prot=mmap.PROT_READ,
                      offset=start)
        try:
            view = memoryview(m)
            try:
                _write_all(out_fd, view[self.offset - start:])
            finally:
                view.release()
        finally:
            m.close()


_FLAG_RAW = bytes([FLAG_RAW])
SEND_PIECE = 1 << 20
MAP_MIN = 1 << 20  # spans from this size on are mapped (MAP_POPULATE) rather than copied through a buffer
_POPULATE = getattr(mmap, "MAP_POPULATE", 0)
_pieces: list = []  # reused FileSpan.send_to buffers (one per concurrent copy; touched once)


def _write_all(fd: int, data) -> None:
    view = memoryview(data)
    while view:
        view = view[os.write(fd, view):]


class HeldSpan:
    """A change-set body still held by the process that wrote it (the upload service's client): the
    file's region for it is left open here and filled there, at its offset (`delegate` of
    `StateChangeFsUploader.upload`). `owner` and `ref` say whose and which body it is."""

    __slots__ = ("length", "owner", "ref")

    def __init__(self, length: int, owner, ref):
        self.length, self.owner, self.ref = length, owner, ref

    def __len__(self) -> int:
        return self.length


def _offsets(bodies) -> tuple:
    """(logical offset of each body, logical size) of raw bodies back to back."""
    offsets, pos = [], 0
    for body in bodies:
        offsets.append(pos)
        pos += len(body)
    return offsets, pos


def _write_raw(files, bodies, paths=(), delegate=None) -> tuple:
    """The file bytes of uncompressed `bodies` (flag byte, bodies back to back) into each of the
    local `files`, written to their descriptors: the service's segments (`FileSpan`) by the kernel's
    copy, every run of other bodies (sealed bodies, bytes) by one `write_bodies` call, which holds the
    GIL only around it. The regions of `HeldSpan`s are skipped, then `delegate(paths, [(file offset,
    span)])` has their holders fill them and returns once they did (it raises if one did not).
    Returns (logical offset of each body, logical size) as `write_file` does."""
    offsets, pos = _offsets(bodies)
    fds = []
    for f in files:
        f.write(bytes([FLAG_RAW]))
        f.flush()
        fds.append(f.fileno())
    run: list = []
    held: list = []
    for off, body in zip(offsets, bodies):
        kind = type(body)
        if kind is FileSpan or kind is HeldSpan:
            if run:
                write_bodies(fds, run)
                run = []
            if kind is FileSpan:
                for fd in fds:
                    body.send_to(fd)
            else:
                held.append((1 + off, body))
                for fd in fds:
                    os.lseek(fd, len(body), os.SEEK_CUR)
        else:
            run.append(body)
    if run:
        write_bodies(fds, run)
    if held:
        if delegate is None:
            raise ValueError("bodies held by other processes need a delegate to write them")
        delegate(list(paths), held)
    return offsets, pos


_PREALLOCATE_MIN = 1 << 20  # smaller files gain nothing from reserving their blocks first
_libc_fallocate = None


def _fallocate(fd: int, size: int) -> bool:
    """fallocate(2) `size` bytes (no glibc fallback that writes zeros where it is unsupported)."""
    global _libc_fallocate
    if _libc_fallocate is None:
        try:
            import ctypes

            fn = ctypes.CDLL(None, use_errno=True).fallocate
            fn.argtypes = [ctypes.c_int, ctypes.c_int, ctypes.c_int64, ctypes.c_int64]
            fn.restype = ctypes.c_int
            _libc_fallocate = fn
        except (OSError, AttributeError):
            _libc_fallocate = False
    return bool(_libc_fallocate) and _libc_fallocate(fd, 0, 0, size) == 0


def _open_local_exclusive(path: str, size: Optional[int]):
    """Create a local file exclusively; with a known final `size`, reserve its blocks up front: the
    writes then skip most per-page block reservation work (ext4/xfs; about a third of a large write's
    cost). Best effort: where it fails or is unsupported the file is written as usual."""
    fd = os.open(path, os.O_WRONLY | os.O_CREAT | os.O_EXCL | getattr(os, "O_CLOEXEC", 0), 0o666)
    try:
        if size is not None and size >= _PREALLOCATE_MIN and not _fallocate(fd, size):
            os.ftruncate(fd, 0)  # a failed attempt may have left a partial reservation
        return os.fdopen(fd, "wb")
    except BaseException:
        os.close(fd)
        raise


_FULL = (errno.ENOSPC, errno.EDQUOT)
_full_dirs: set = set()  # local-recovery directories found full and not written to since
_full_lock = threading.Lock()


def _note_local_full(local_dir: str, exc: OSError) -> None:
    with _full_lock:
        first = local_dir not in _full_dirs
        _full_dirs.add(local_dir)
    if first:
        log.warning("the local-recovery directory %s is full (%s): changelog files go to the base path "
                    "only, without a local copy, until it has room again", local_dir, exc.strerror or exc)


def _note_local_ok(local_dir: str) -> None:
    if local_dir in _full_dirs:
        with _full_lock:
            _full_dirs.discard(local_dir)
        log.warning("the local-recovery directory %s has room again: local copies resume", local_dir)


def _file_size(bodies, compression: Optional[str]) -> Optional[int]:
    """The exact file size of raw `bodies` (flag byte + bodies); None when compressed (unknown)."""
    if compression is not None:
        return None
    return 1 + sum(len(b) for b in bodies)


def _open_exclusive(fs, path: str):
    """Create `path` exclusively ("xb"); an existing file is never overwritten (docs/format.md §9)."""
    try:
        return fs.open(path, "xb")
    except (ValueError, NotImplementedError):
        # filesystems without "x": check first; uuid4 names make a race practically impossible
        if fs.exists(path):
            raise FileExistsError(path) from None
        return fs.open(path, "wb")


class StateChangeFsUploader(StateChangeUploader):
    """Writes `<base>/<job id>/dstl/<uuid4>` through fsspec, plus the local-recovery copy if enabled.

    `compression` is None, "snappy" or "zstd"; `buffer_size` is the write buffer of the stream.
    """

    def __init__(self, base_path: str, job_id: str, compression: Optional[str], buffer_size: int,
                 registry, metrics, local_recovery_dir: Optional[str] = None):
        if not base_path:
            raise ValueError("base path must be non-empty")
        self.base_path = base_path
        self.job_id = job_id
        self.compression = compression
        self.buffer_size = int(buffer_size)
        self.registry = registry
        self.metrics = metrics
        # plain paths only for the real local disk; wrappers (e.g. a test filesystem) keep their URL
        self._fs, self._dir = dfs.changelog_dir(base_path, job_id)
        self._local_fs = dfs.is_local(self._fs)
        self._local_dir = (os.path.join(local_recovery_dir, f"jid_{job_id}", "taskowned")
                           if local_recovery_dir else None)
        self._dirs_ready = False
        self._dirs_lock = threading.Lock()

    @property
    def directory(self) -> str:
        """Where the files go (a path on the uploader's filesystem)."""
        return self._dir

    @property
    def local_raw(self) -> bool:
        """Whether files go uncompressed to the local disk (bodies then go to the descriptor directly)."""
        return self._local_fs and self.compression is None

    def _url(self, path: str) -> str:
        return dfs.url_of(self._fs, path)

    def _ensure_dirs(self) -> None:
        if self._dirs_ready:
            return
        with self._dirs_lock:
            if not self._dirs_ready:
                dfs.make_parent_dirs(self._fs, self._dir)
                if self._local_dir:
                    os.makedirs(self._local_dir, exist_ok=True)
                self._dirs_ready = True

    def _create(self, path: str, size: Optional[int]):
        """Open the new file exclusively; a job directory deleted meanwhile is made again."""
        self._ensure_dirs()
        try:
            return _open_local_exclusive(path, size) if self._local_fs else _open_exclusive(self._fs, path)
        except FileNotFoundError:
            with self._dirs_lock:
                self._dirs_ready = False
            self._ensure_dirs()
            return _open_local_exclusive(path, size) if self._local_fs else _open_exclusive(self._fs, path)

    def _create_local(self, local_path: str, size: Optional[int]):
        try:
            return _open_local_exclusive(local_path, size)
        except FileNotFoundError:  # the local-recovery directory went away
            os.makedirs(self._local_dir, exist_ok=True)
            return _open_local_exclusive(local_path, size)

    def upload(self, tasks: Sequence[UploadTask], *, file_name: Optional[str] = None,
               delegate=None) -> UploadTasksResult:
        """One attempt. `file_name` (default: a fresh uuid4) is the name of the file in the job's
        directory; the upload service passes one it announced beforehand. `delegate` writes the
        regions of `HeldSpan` bodies (raw local files only; see `_write_raw`).

        A local-recovery directory that is full (ENOSPC, EDQUOT) costs the file its local copy,
        not the upload: the attempt writes the file again without one (logged once per full spell)."""
        if file_name is not None and (not file_name or "/" in file_name or file_name in (".", "..")):
            raise ValueError(f"invalid changelog file name {file_name!r}")
        self.metrics.upload_requests.inc()
        with_local = self._local_dir is not None
        if with_local:
            try:
                result = self._upload(tasks, file_name, delegate, True)
            except OSError as exc:
                if exc.errno not in _FULL:
                    raise
                # the local copy's file system or the base path's is full: without the copy, a
                # success says it was the former (a full local base path fails again, as before)
                result = self._upload(tasks, file_name, delegate, False)
                _note_local_full(self._local_dir, exc)
                return result
            _note_local_ok(self._local_dir)
            return result
        return self._upload(tasks, file_name, delegate, False)

    def _upload(self, tasks: Sequence[UploadTask], file_name: Optional[str], delegate,
                with_local: bool) -> UploadTasksResult:
        start = time.perf_counter_ns()
        # batch order between tasks, (log id, sqn) order inside a task (docs/format.md §5.1)
        ordered = [(t, sorted(t.change_sets, key=lambda cs: cs.sort_key())) for t in tasks]
        bodies = [cs.body for _, sets in ordered for cs in sets]
        name = file_name if file_name is not None else str(uuid.uuid4())
        path = f"{self._dir}/{name}"
        local_path = os.path.join(self._local_dir, name) if with_local else None
        created = []
        size = _file_size(bodies, self.compression)
        # raw bodies to the local disk go to the file descriptors, without Python per piece
        direct = self.local_raw and bool(bodies)
        if not direct and any(type(b) is HeldSpan for b in bodies):
            raise ValueError("bodies held by other processes can only go to raw local files")
        plain = direct and not any(type(b) is FileSpan or type(b) is HeldSpan for b in bodies)
        if plain:  # this process's bodies: made, written and closed in one GIL release
            try:
                offsets, logical_size = self._write_new([path] + ([local_path] if local_path else []), size,
                                                        bodies)
            except BaseException as exc:
                if isinstance(exc, OSError):
                    self.metrics.upload_failures.inc()
                raise  # write_bodies_at removed what it made
        else:
            try:
                opened = self._create(path, size)
                with opened as out:
                    created.append("remote")
                    if direct:
                        if local_path is None:
                            offsets, logical_size = _write_raw([out], bodies, [path], delegate)
                        else:
                            with self._create_local(local_path, size) as local_out:
                                created.append("local")
                                offsets, logical_size = _write_raw([out, local_out], bodies, [path, local_path],
                                                                   delegate)
                    elif local_path is None:
                        offsets, logical_size = write_file(
                            out, bodies, compression=self.compression, buffer_size=self.buffer_size)
                    else:
                        with self._create_local(local_path, size) as local_out:
                            created.append("local")
                            offsets, logical_size = write_file(
                                _Tee(out, local_out), bodies, compression=self.compression,
                                buffer_size=self.buffer_size)
                    if size is not None and logical_size + 1 != size:  # preallocated: must match exactly
                        raise RuntimeError(f"wrote {logical_size + 1} bytes to {path}, expected {size}")
            except BaseException as exc:
                if isinstance(exc, OSError):
                    self.metrics.upload_failures.inc()
                self._delete_partial(path, local_path, created)
                raise
        handle = StreamStateHandle(self._url(path), logical_size)
        local_handle = StreamStateHandle(local_path, logical_size) if local_path else None
        n = len(bodies)
        self.registry.start_tracking(handle, n)
        if local_handle is not None:
            self.registry.start_tracking(local_handle, n)
        self.metrics.upload_sizes.update(logical_size)
        self.metrics.upload_latencies_nanos.update(max(1, time.perf_counter_ns() - start))
        tasks_offsets = []
        i = 0
        for task, sets in ordered:
            entries = []
            for cs in sets:
                entries.append((cs, offsets[i], offsets[i]))  # the local copy has the same offsets
                i += 1
            tasks_offsets.append((task, entries))
        return UploadTasksResult(tasks_offsets, handle, local_handle, self.registry)

    def _write_new(self, paths: list, size: int, bodies) -> tuple:
        """Raw `bodies` into the new local files `paths` with one `write_bodies_at` call: an upload
        thread beside a busy appending thread waits up to the switch interval (5 ms) for the GIL after
        every system call it makes without it, and making, reserving, writing and closing a file took
        six. A job directory deleted meanwhile is made again."""
        offsets, pos = _offsets(bodies)
        self._ensure_dirs()
        try:
            n = write_bodies_at(paths, 0, [_FLAG_RAW] + list(bodies), create=True, size=size)
        except FileNotFoundError:
            with self._dirs_lock:
                self._dirs_ready = False
            self._ensure_dirs()
            n = write_bodies_at(paths, 0, [_FLAG_RAW] + list(bodies), create=True, size=size)
        if n != size:
            for p in paths:
                os.remove(p)
            raise RuntimeError(f"wrote {n} bytes to {paths[0]}, expected {size}")
        return offsets, pos

    def _delete_partial(self, path: str, local_path: Optional[str], created) -> None:
        # only what this attempt created: an exclusive open that failed may have met someone else's file
        try:
            if "remote" in created:
                self._fs.rm_file(path)
        except FileNotFoundError:
            pass
        except Exception:
            log.warning("could not delete the partial file %s of a failed upload", path, exc_info=True)
        if local_path is not None and "local" in created:
            try:
                os.remove(local_path)
            except FileNotFoundError:
                pass
            except Exception:
                log.warning("could not delete the partial local copy %s", local_path, exc_info=True)

    def __repr__(self) -> str:
        return f"StateChangeFsUploader({self._url(self._dir)!r}, compression={self.compression!r})"


__all__ = ["StateChangeUploader", "StateChangeFsUploader", "FileSpan", "HeldSpan"]
