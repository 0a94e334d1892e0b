"""Uploader pool process: one attempt per job, payload read straight from shared memory.

The attempt itself is C2's `StateChangeFsUploader.upload` (compression, CRCs, exclusive create,
partial-file cleanup, local-recovery copy); this module only rebuilds the tasks around byte ranges of
the segments' descriptors (`FileSpan`: copied through one reused buffer into a raw local file,
streamed in chunks otherwise; nothing is mapped) and reports the outcome as plain data.
`start_tracking` calls are collected and returned: the service applies them in its registry only for
the winning attempt.
"""
from __future__ import annotations

import logging
import os
import signal
import time
import uuid
from typing import Dict, List, Tuple

log = logging.getLogger("dstl.changelog.upload.service.worker")


class _Counter:
    __slots__ = ("count",)

    def __init__(self) -> None:
        self.count = 0

    def inc(self, n: int = 1) -> None:
        self.count += n


class _Values:
    __slots__ = ("values",)

    def __init__(self) -> None:
        self.values: List[int] = []

    def update(self, v) -> None:
        self.values.append(int(v))


class _AttemptMetrics:
    """What one attempt records; shipped back to the clients whose tasks were in the batch."""

    def __init__(self) -> None:
        self.upload_requests = _Counter()
        self.upload_failures = _Counter()
        self.upload_sizes = _Values()
        self.upload_latencies_nanos = _Values()

    def as_dict(self) -> dict:
        return {"requests": self.upload_requests.count, "failures": self.upload_failures.count,
                "sizes": self.upload_sizes.values, "latencies": self.upload_latencies_nanos.values}


class _CollectingRegistry:
    def __init__(self) -> None:
        self.started: List[Tuple[str, int]] = []

    def start_tracking(self, handle, n: int) -> None:
        self.started.append((handle.path, n))

    def stop_tracking(self, handle) -> None:  # never called on an attempt's own path
        pass


def _noop(*_a) -> None:
    pass


_uploaders: Dict[tuple, object] = {}
_mapped = None  # MappedSegments of this uploader process, made on first use


def intended_url(job: dict) -> str:
    """The URL the attempt of `job` will create (what the uploader builds from its directory)."""
    from dstl.changelog import fs as dfs

    fs, directory = dfs.changelog_dir(job["base_path"], job["job_id"])
    return dfs.url_of(fs, f"{directory}/{job['file_name']}")


def run_attempt(job: dict, delegate=None) -> dict:
    """Upload one batch. `job`: base_path, job_id, local_dir, compression, buffer_size and
    `tasks`: [(task_key, segment, [(offset, length, log_id_bytes, sqn, size, num_changes)])].
    A task whose segment is "" is held by its client: its regions are left to `delegate` (see
    `StateChangeFsUploader.upload`), with `HeldSpan(length, task's position in tasks, item index)`.
    The upload service runs such attempts in its own threads, each with an uploader of its own.

    Returns path, local_path, logical_size, started ([(path, n)]), metrics and per task
    [(sqn, offset, local_offset, size)] in file order.
    """
    from dstl.types import SealedChangeSet
    from dstl.changelog.upload.service import shm
    from dstl.changelog.upload.task import UploadTask
    from dstl.changelog.upload.uploader import FileSpan, HeldSpan, StateChangeFsUploader

    global _mapped
    metrics = _AttemptMetrics()
    registry = _CollectingRegistry()
    key = (job["base_path"], job["job_id"], job["local_dir"], job["compression"], job["buffer_size"])
    uploader = _uploaders.get(key) if delegate is None else None
    if uploader is None:
        uploader = StateChangeFsUploader(job["base_path"], job["job_id"], job["compression"],
                                         job["buffer_size"], registry, metrics, job["local_dir"])
        if delegate is None:  # kept per uploader process (one attempt at a time there)
            _uploaders[key] = uploader
    uploader.registry = registry
    uploader.metrics = metrics
    if delegate is None:
        if _mapped is None:
            from dstl.changelog.upload.service.mapped import MappedSegments

            _mapped = MappedSegments()
        _mapped.prune()
    segments: Dict[str, int] = {}  # segment name -> read-only descriptor
    tasks = []
    try:
        for position, (_task_key, seg_name, items) in enumerate(job["tasks"]):
            if not seg_name:
                sets = [SealedChangeSet(uuid.UUID(bytes=log_id), sqn, HeldSpan(length, position, index), size, num)
                        for index, (_off, length, log_id, sqn, size, num) in enumerate(items)]
                tasks.append(UploadTask(sets, _noop, _noop))
                continue
            fd = segments.get(seg_name)
            if fd is None:
                fd = segments[seg_name] = shm.open_readonly(seg_name)
            # mapped only where the kernel copies from it: raw bodies into a local file
            m = (_mapped.get(seg_name, fd, max(off + length for off, length, *_ in items))
                 if uploader.local_raw and items and delegate is None else None)
            sets = [SealedChangeSet(uuid.UUID(bytes=log_id), sqn, FileSpan(fd, off, length, m), size, num)
                    for off, length, log_id, sqn, size, num in items]
            tasks.append(UploadTask(sets, _noop, _noop))
        try:
            # the service chose and announced the name, so a worker killed mid-write leaves no unknown file
            result = uploader.upload(tasks, file_name=job.get("file_name"), delegate=delegate)
        except BaseException as exc:
            exc.dstl_metrics = metrics.as_dict()  # type: ignore[attr-defined]
            raise
        out_tasks = []
        for _task, entries in result.tasks_offsets:
            out_tasks.append([(int(cs.sequence_number), off, loff, cs.size) for cs, off, loff in entries])
        return {
            "path": result.handle.path,
            "local_path": result.local_handle.path if result.local_handle is not None else None,
            "logical_size": result.handle.state_size,
            "started": registry.started,
            "metrics": metrics.as_dict(),
            "tasks": out_tasks,
        }
    finally:
        del tasks
        for fd in segments.values():
            os.close(fd)


def portable_error(exc: BaseException) -> BaseException:
    """An exception that survives pickling (else an OSError carrying its text)."""
    import pickle

    try:
        pickle.loads(pickle.dumps(exc))
        return exc
    except Exception:
        err = OSError(f"{type(exc).__name__}: {exc}")
        err.dstl_metrics = getattr(exc, "dstl_metrics", None)  # type: ignore[attr-defined]
        return err


def worker_main(conn) -> None:
    """Serve Job messages from `conn` until Stop or end of file (the service is gone)."""
    from dstl.changelog.upload.service.protocol import (AttemptDone, AttemptFailed, Intent, Job, Stop,
                                                         WorkerReady, dispatch)

    from dstl.changelog.upload.service.mapped import IDLE_S

    signal.signal(signal.SIGINT, signal.SIG_IGN)
    logging.basicConfig(level=logging.WARNING, format="%(asctime)s uploader %(levelname)s %(message)s")
    _preload_user_modules()

    def attempt(msg: Job):
        job = msg.spec
        start = time.perf_counter_ns()
        try:
            if job.get("file_name"):
                conn.send(Intent(intended_url(job)))
            res = run_attempt(job)
            res["wall_ns"] = time.perf_counter_ns() - start
            return AttemptDone(res)
        except BaseException as exc:  # an attempt's failure is data, not the worker's death
            return AttemptFailed(portable_error(exc), getattr(exc, "dstl_metrics", None))

    table = {Job: attempt, Stop: lambda _msg: None}
    conn.send(WorkerReady(os.getpid()))
    while True:
        try:
            if _mapped is not None and len(_mapped) and not conn.poll(IDLE_S):
                _mapped.clear()  # idle: kept mappings would only pin segments the clients let go
                continue
            msg = conn.recv()
        except (EOFError, OSError):
            return
        answer = dispatch(table, msg)
        if answer is None:
            return
        try:
            conn.send(answer)
        except (BrokenPipeError, EOFError, OSError):
            return


def user_modules() -> List[str]:
    """The modules named in DSTL_SERVICE_IMPORTS (e.g. ones registering fsspec protocols)."""
    return [n for n in (s.strip() for s in os.environ.get("DSTL_SERVICE_IMPORTS", "").split(",")) if n]


def _preload_user_modules() -> None:
    """Import the modules named in DSTL_SERVICE_IMPORTS."""
    import importlib

    for name in user_modules():
        importlib.import_module(name)


__all__ = ["run_attempt", "worker_main", "portable_error"]
