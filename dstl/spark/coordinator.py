"""CheckpointCoordinator: the driver side of exactly-once micro-batches.

One micro-batch is one checkpoint (id = batch + 1, or the latest checkpoint's id + 1 after an offline
`dstl state rescale` added one). For each batch:

1. `plan()` tells the tasks which checkpoint to write and which completed one to continue from
   (with the attempt token each subtask's snapshot came from, so a worker's cache can tell whether
   its backend is exactly the one the checkpoint recorded).
2. The tasks stage their output files and return their serialised snapshots.
3. `complete()` writes the checkpoint metadata atomically (K's `write_checkpoint`), then commits the
   batch's output: staged files are renamed to `<output>/batch-NNNNNN/part-SSSSS.parquet` and a
   `_SUCCESS` marker is written. The commit is idempotent; a restart finishes the commit of the
   latest checkpoint (its staged files are listed in the metadata), so a crash anywhere yields each
   batch's output exactly once.
4. The next batch's tasks confirm the checkpoint (their registries stop tracking its files).
5. Old checkpoints beyond `retain` are deleted, and changelog files that no retained checkpoint
   references are garbage collected (two passes in a row during the run, so files a running writer
   has just uploaded are never touched; all of them at `finish()`).

The base path holds one job: `<base>/_dstl_job.json` names it; a different job there is an error.
Paths under the base path (the output directory in the job file, the staged and final output files
in the checkpoint properties, the changelog files in the metadata) are stored relative to it, so the
whole base path can be copied or moved and resumed from its new place (dstl.state.relpaths).
"""
from __future__ import annotations

import json
import logging
import posixpath
import time
import uuid
from dataclasses import asdict, dataclass, field
from typing import Any, Callable, Dict, List, Mapping, Optional, Sequence, Set, Tuple

from dstl.spark import faults
from dstl.spark.plan import CheckpointPlan
from dstl.spark.report import TaskReport, snapshot_to_subtask_state
from dstl.spark.placement import log_batch
from dstl.state.composite_keys import JOB_FILE  # noqa: F401 - the job file, named below this layer
from dstl.state.relpaths import relative_to, resolve

log = logging.getLogger(__name__)

#: committed output of batch N: <output>/batch-NNNNNN/ (the pipeline); StatefulStream uses
#: "batch_id={batch}", a partition column Spark reads back
DEFAULT_OUTPUT_LAYOUT = "batch-{batch:06d}"


class JobConflictError(ValueError):
    """The base path holds another job, or a resume does not match the job it finds."""


@dataclass
class JobSpec:
    """What identifies a job at a base path (stored as `<base>/_dstl_job.json`)."""

    job_id: str
    operator_id: str
    max_parallelism: int
    output_path: Optional[str] = None
    #: whatever else must not change across restarts (e.g. the source definition)
    params: Dict[str, Any] = field(default_factory=dict)

    @staticmethod
    def new(operator_id: str, max_parallelism: int, output_path: Optional[str] = None,
            params: Optional[Dict[str, Any]] = None) -> "JobSpec":
        """A new job's spec; `max_parallelism` 0 = "take the stored one" (resume). This is where the
        Spark layer validates max parallelism: plans and tasks trust the value they are given."""
        from dstl.keygroups import UPPER_BOUND_MAX_PARALLELISM

        if isinstance(max_parallelism, bool) or not isinstance(max_parallelism, int) \
                or not 0 <= max_parallelism <= UPPER_BOUND_MAX_PARALLELISM:
            raise ValueError(f"max_parallelism must be an int in 1..{UPPER_BOUND_MAX_PARALLELISM}, "
                             f"got {max_parallelism!r}")
        return JobSpec(uuid.uuid4().hex, operator_id, max_parallelism, output_path, dict(params or {}))


@dataclass
class CheckpointStats:
    checkpoint_id: int
    batch: int
    metadata_ms: float
    commit_ms: float
    gc_ms: float
    new_files: int
    new_bytes: int
    deleted_files: int
    state_size: int
    #: where the subtasks ran and how they got their state (dstl.spark.placement)
    placement: Dict[str, Any] = field(default_factory=dict)


def _fs(url: str):
    from dstl.changelog.fs import filesystem

    return filesystem(url)


def _ls(fs, path: str, detail: bool = False):
    """A fresh listing that leaves no cached listing behind: object-store filesystems (s3fs) would
    otherwise answer later existence checks of new files from a stale directory cache."""
    fs.invalidate_cache(path)
    try:
        return fs.ls(path, detail=detail)
    finally:
        fs.invalidate_cache(path)


def _join(base: str, *parts: str) -> str:
    return "/".join([base.rstrip("/")] + [p.strip("/") for p in parts])


class CheckpointCoordinator:
    """Driver-side checkpoint bookkeeping for one job at `base_path` (any fsspec URL)."""

    def __init__(self, base_path: str, spec: JobSpec, options: Any = None, *,
                 storage_options: Optional[Mapping[str, Any]] = None, retain: int = 2,
                 backend_options: Optional[Dict[str, Any]] = None, durable: bool = True,
                 output_layout: str = DEFAULT_OUTPUT_LAYOUT):
        from dstl.config import storage_config

        if retain < 1:
            raise ValueError(f"retain must be >= 1, got {retain}")
        self.base_path = base_path.rstrip("/")
        self.spec = spec
        #: the changelog storage: dstl `options` and the file system's keyword arguments `storage_options`
        self.storage_config = storage_config(self.base_path, options, storage_options)
        #: what tasks receive, in memory (file system arguments as dstl.dfs.fs.<name>)
        self.storage_mapping = self.storage_config.to_mapping()
        self.retain = retain
        self.backend_options = dict(backend_options or {})
        self.durable = durable
        #: the committed folder of a batch under the output path (`{batch}` is replaced)
        self.output_layout = output_layout
        self._memory_batch: Optional[int] = None
        self._memory_executors: Optional[List[str]] = None
        self.latest = None  # CheckpointMetadata of the latest completed checkpoint
        self._suspects: Set[str] = set()
        self._known_files: Dict[str, int] = {}
        self.recovered_output = False
        self.rolled_back = None  # RollbackResult when opened with resume_from
        self.lease = None  # WriterLease: this run's claim on the base path (dstl.state.fencing)
        #: checkpoint id -> the metadata this run wrote: garbage collection reads none of them back
        self._written: Dict[int, Any] = {}
        #: ids of the checkpoints at the base path, listed once and then kept by this run
        self._ids: Optional[List[int]] = None

    # ---------------------------------------------------------------- opening a job
    @classmethod
    def open(cls, base_path: str, spec: JobSpec, options: Any = None, *, resume: bool,
             storage_options: Optional[Mapping[str, Any]] = None,
             retain: int = 2, backend_options: Optional[Dict[str, Any]] = None,
             durable: bool = True, resume_from: Optional[int] = None,
             output_layout: str = DEFAULT_OUTPUT_LAYOUT) -> "CheckpointCoordinator":
        """Start a new job (`resume=False`: the base path must not hold one) or resume the one there.

        `options`: dstl's storage options (`{"upload.mode": "thread"}`, `dstl.dfs.*` keys, or a
        StorageConfig); `storage_options`: the base path file system's keyword arguments, as pandas
        and fsspec take them (`{"key": ..., "secret": ..., "client_kwargs": {...}}`), in memory only.

        On resume the stored spec wins for the job id; operator, max parallelism, output and params
        must match what the caller passes (`spec.max_parallelism` 0 = take the stored one).
        `resume_from`: roll back to this retained checkpoint first (dstl.spark.rollback): later
        checkpoints are abandoned and their committed output moves under `<output>/_rolled_back/`.
        """
        from dstl.state.metadata import latest_checkpoint, list_checkpoints

        from dstl.config import storage_config

        base = base_path.rstrip("/")
        config = storage_config(base, options, storage_options)  # registers the file system's arguments
        fs, root = _fs(base)
        job_file = _join(root, JOB_FILE)
        stored = None
        stored_raw = None
        if fs.exists(job_file):
            with fs.open(job_file, "rb") as f:
                try:
                    stored = JobSpec(**json.loads(f.read().decode()))
                except (ValueError, TypeError) as exc:
                    raise JobConflictError(f"{_join(base, JOB_FILE)} is not a dstl job file: {exc}") from None
            stored_raw = stored.output_path
            if stored.output_path:
                stored.output_path = resolve(base, stored.output_path)
        if resume_from is not None and not resume:
            raise JobConflictError("resume_from (--from-checkpoint) needs resume (--resume)")
        if not resume:
            if spec.max_parallelism < 1:
                raise ValueError(f"a new job needs max_parallelism >= 1, got {spec.max_parallelism}")
            if stored is not None:
                raise JobConflictError(f"base path {base} already holds job {stored.job_id} "
                                       f"(operator {stored.operator_id}); use --resume or another base path")
            if list_checkpoints(base):
                raise JobConflictError(f"base path {base} already holds checkpoints of another job; "
                                       f"use another base path")
            fs.makedirs(root, exist_ok=True)
            _write_job_file(fs, job_file, base, spec, exclusive=True)  # two new jobs: one wins here
            coord = cls(base, spec, config, retain=retain, backend_options=backend_options,
                        durable=durable, output_layout=output_layout)
            coord.lease = _take_over(base, spec.job_id)
            return coord
        if stored is None:
            raise JobConflictError(f"nothing to resume: base path {base} holds no dstl job ({JOB_FILE} missing)")
        _check_same(stored, spec, base)
        lease = _take_over(base, stored.job_id)  # before this run changes anything at the base path
        if stored_raw and stored.output_path and relative_to(base, stored.output_path) != stored_raw:
            _write_job_file(fs, job_file, base, stored)  # upgrade an absolute-path job file
        coord = cls(base, stored, config, retain=retain, backend_options=backend_options,
                    output_layout=output_layout)
        coord.lease = lease
        from dstl.spark.rollback import finish_roll_back, roll_back
        from dstl.state.metadata import CheckpointJobMismatchError
        from dstl.state.reader import StateReadError

        finish_roll_back(base)  # one that a crash interrupted
        if resume_from is not None:
            out = relative_to(base, stored.output_path) if stored.output_path else None
            try:
                coord.rolled_back = roll_back(base, resume_from, out)
            except StateReadError as exc:
                raise JobConflictError(str(exc)) from None

        try:
            coord.latest = latest_checkpoint(base, job_id=stored.job_id)
        except CheckpointJobMismatchError as exc:
            raise JobConflictError(str(exc)) from None
        if coord.latest is not None:
            if coord.latest.max_parallelism != stored.max_parallelism \
                    and coord.latest.properties.get("rescaled_from") is not None \
                    and not spec.max_parallelism:
                # an offline max-parallelism change; a crash may have kept it from the job file
                from dstl.state.rescale import update_job_file

                update_job_file(base, coord.latest.max_parallelism)
                stored.max_parallelism = coord.latest.max_parallelism
            if coord.latest.max_parallelism != stored.max_parallelism:
                raise JobConflictError(f"checkpoint {coord.latest.checkpoint_id} has max parallelism "
                                       f"{coord.latest.max_parallelism}, the job file says {stored.max_parallelism}")
            coord.recovered_output = coord.commit_output(coord.latest)
        coord._clean_uncommitted_staging()
        return coord

    # ---------------------------------------------------------------- per batch
    @property
    def next_batch(self) -> int:
        if not self.durable:
            return 0 if self._memory_batch is None else self._memory_batch + 1
        return 0 if self.latest is None else int(self.latest.properties["batch"]) + 1

    def plan(self, batch: int, parallelism: int) -> CheckpointPlan:
        """The plan for `batch` (checkpoint id batch + 1) at `parallelism` (may differ: rescale)."""
        if batch != self.next_batch:
            raise ValueError(f"batch {batch} is not the next one ({self.next_batch})")
        latest = self.latest
        tokens = None
        if latest is not None and latest.parallelism == parallelism \
                and latest.max_parallelism == self.spec.max_parallelism:
            tokens = tuple(latest.properties["tokens"])
        return CheckpointPlan(
            job_id=self.spec.job_id, operator_id=self.spec.operator_id, base_path=self.base_path,
            storage_mapping=self.storage_mapping,
            checkpoint_id=batch + 1 if latest is None else max(batch + 1, latest.checkpoint_id + 1), batch=batch,
            parallelism=parallelism, max_parallelism=self.spec.max_parallelism,
            output_path=self.spec.output_path,
            restore_checkpoint_id=None if latest is None else latest.checkpoint_id,
            restore_tokens=tokens, backend_options=self.backend_options, durable=self.durable)

    def complete(self, plan: CheckpointPlan, reports: Sequence[TaskReport], *,
                 properties: Optional[Dict[str, Any]] = None,
                 after_metadata: Optional[Callable[[], None]] = None) -> CheckpointStats:
        """Write the checkpoint metadata, then commit the batch's output, then clean up."""
        from dstl.state.metadata import CheckpointMetadata, write_checkpoint

        by_subtask = {r.subtask: r for r in reports}
        if sorted(by_subtask) != list(range(plan.parallelism)) or len(reports) != plan.parallelism:
            raise RuntimeError(f"checkpoint {plan.checkpoint_id}: expected one report per subtask "
                               f"0..{plan.parallelism - 1}, got subtasks {sorted(r.subtask for r in reports)}")
        ordered = [by_subtask[i] for i in range(plan.parallelism)]
        placement = self._placement(plan, ordered)
        if not self.durable:
            return self._complete_in_memory(plan, ordered, placement)
        subtasks = [snapshot_to_subtask_state(r.subtask, r.snapshot) for r in ordered]
        files: List[List[str]] = []
        for r in ordered:
            if r.staged:  # relative to the base path when under it: the job stays relocatable
                files.append([relative_to(self.base_path, r.staged),
                              relative_to(self.base_path, self._final_path(plan.batch, r.subtask))])
        props = dict(properties or {})
        if self.lease is not None:
            props["writer"] = {"epoch": self.lease.epoch, "writer": self.lease.writer,
                               "started_at": self.lease.started_at}
        props.update({"batch": plan.batch, "job_id": self.spec.job_id, "operator_id": self.spec.operator_id,
                      "tokens": [r.token for r in ordered], "placement": placement,
                      "output": {"batch": plan.batch, "files": files},
                      "completed_at": time.time()})
        meta = CheckpointMetadata(plan.checkpoint_id, plan.max_parallelism, plan.parallelism, subtasks, props,
                                  job_id=self.spec.job_id)
        t0 = time.perf_counter()
        self._check_lease(ordered)  # the fence: nothing of this batch is visible before it
        try:
            # the lease just checked is ours and `latest` is what we wrote: the newest checkpoint's job
            # id needs no reading back
            write_checkpoint(self.base_path, meta, check_job=self.latest is None or self.lease is None)
        except FileExistsError as exc:  # another run completed this checkpoint first
            self._drop_staged(ordered)
            from dstl.state.fencing import BasePathInUseError

            holder = dict(getattr(exc, "holder", None) or {"job_id": self.spec.job_id})
            raise BasePathInUseError(self.base_path, holder) from exc
        t1 = time.perf_counter()
        self.latest = meta
        self._written[meta.checkpoint_id] = meta
        if self._ids is not None:
            self._ids.append(meta.checkpoint_id)
        if after_metadata is not None:
            after_metadata()  # checkpoint durable, output not yet committed (a fault point's place)
        # no second lease check: the checkpoint is durable, and a run that took over meanwhile
        # commits this same checkpoint's output (the same bytes, idempotently)
        deletes: List[Tuple[Any, str]] = []
        self.commit_output(meta, fresh=True, deletes=deletes)
        t2 = time.perf_counter()
        new_files, new_bytes, deleted = self.collect_garbage(deletes=deletes)
        t3 = time.perf_counter()
        log_batch(plan.batch, plan.checkpoint_id, placement)
        return CheckpointStats(plan.checkpoint_id, plan.batch, (t1 - t0) * 1e3, (t2 - t1) * 1e3,
                               (t3 - t2) * 1e3, new_files, new_bytes, deleted,
                               sum(r.state_size for r in ordered), placement)

    def _placement(self, plan: CheckpointPlan, ordered: Sequence[TaskReport]) -> Dict[str, Any]:
        """This batch's placement figures (against the previous checkpoint's executors)."""
        from dstl.spark.placement import placement_figures

        prev = None
        latest = self.latest if self.durable else None
        if latest is not None and latest.parallelism == plan.parallelism:
            prev = (latest.properties.get("placement") or {}).get("executors")
        elif not self.durable:
            prev = self._memory_executors
        figures = placement_figures(ordered, prev)
        self._memory_executors = figures["executors"]
        return figures

    def _complete_in_memory(self, plan: CheckpointPlan, ordered: Sequence[TaskReport],
                            placement: Dict[str, Any]) -> CheckpointStats:
        """Baseline without durability: no metadata, no changelog; the output is still committed."""
        from types import SimpleNamespace

        files = [[r.staged, self._final_path(plan.batch, r.subtask)] for r in ordered if r.staged]
        meta = SimpleNamespace(checkpoint_id=plan.checkpoint_id,
                               properties={"batch": plan.batch, "output": {"batch": plan.batch, "files": files}})
        t0 = time.perf_counter()
        self._check_lease(ordered)
        self.commit_output(meta)
        self._memory_batch = plan.batch
        log_batch(plan.batch, plan.checkpoint_id, placement)
        return CheckpointStats(plan.checkpoint_id, plan.batch, 0.0, (time.perf_counter() - t0) * 1e3, 0.0,
                               0, 0, 0, 0, placement)

    # ---------------------------------------------------------------- fencing
    def _check_lease(self, reports: Sequence[TaskReport]) -> None:
        """Fail (BasePathInUseError) if another run took the base path over; this run's staged
        output of the batch (files only it wrote, token-named) is removed first."""
        if self.lease is None:
            return
        from dstl.state.fencing import BasePathInUseError

        try:
            self.lease.check()
        except BasePathInUseError:
            self._drop_staged(reports)
            raise

    def _drop_staged(self, reports: Sequence[TaskReport]) -> None:
        for r in reports:
            if not r.staged:
                continue
            try:
                fs, path = _fs(r.staged)
                fs.rm_file(path)
            except (FileNotFoundError, OSError):
                pass

    # ---------------------------------------------------------------- output (two-phase commit)
    def _final_path(self, batch: int, subtask: int) -> str:
        return _join(self.spec.output_path, self.batch_dir_name(batch), f"part-{subtask:05d}.parquet")

    def batch_dir_name(self, batch: int) -> str:
        return self.output_layout.format(batch=batch)

    def batch_output_dir(self, batch: int) -> Optional[str]:
        """The committed output folder of `batch` (None without an output path)."""
        return _join(self.spec.output_path, self.batch_dir_name(batch)) if self.spec.output_path else None

    def commit_output(self, meta, fresh: bool = False, deletes: Optional[List[Tuple[Any, str]]] = None) -> bool:
        """Move the staged files of `meta`'s batch into place; idempotent. True if it did any work.

        On an object store a move is a copy and a delete, and each existence check a request; the
        driver waits for each in turn, so the commit lists the batch's staging folder once, copies
        each staged file still there (server side), writes ``_SUCCESS`` and deletes the folder in one
        bulk request: on S3 2P + 6 requests for P files, where a move per file took 6P + 3. A commit
        cut short copies again what it had copied (the same bytes); a file missing from staging must
        be in place already.

        `fresh`: `meta` was created by this run a moment ago (its id was new), so no commit of it
        can have begun: on an object store the marker is not looked for and the staged files are
        the ones the tasks reported, copied and deleted without listing (2P + 2 requests). With
        `deletes`, those deletions are appended to it (file system, path) for one bulk delete later."""
        from dstl.changelog.fs import is_local, make_parent_dirs

        if not self.spec.output_path:
            return False
        out = meta.properties.get("output") or {}
        batch = int(out.get("batch", meta.properties["batch"]))
        if batch < 0:  # a bootstrapped first checkpoint: no batch, no output
            return False
        fs, root = _fs(self.spec.output_path)
        batch_dir = _join(root, self.batch_dir_name(batch))
        marker = _join(batch_dir, "_SUCCESS")
        local = is_local(fs)
        known = fresh and not local
        if not known and fs.exists(marker):
            return False
        make_parent_dirs(fs, batch_dir)
        staging = _join(root, "_staging", f"batch-{batch:06d}")
        if known:
            present = {_fs(resolve(self.base_path, staged))[1] for staged, _ in out.get("files", [])}
        else:
            present = self._staged_files(fs, staging)
        for staged, final in out.get("files", []):
            staged, final = resolve(self.base_path, staged), resolve(self.base_path, final)
            _, staged_p = _fs(staged)
            _, final_p = _fs(final)
            here = staged_p in present if known or staged_p.startswith(staging + "/") else fs.exists(staged_p)
            if here:
                if local:
                    fs.mv(staged_p, final_p)  # a rename
                else:
                    fs.cp_file(staged_p, final_p)  # server-side; the staging folder goes in one delete
                faults.point("coordinator.mid_commit", batch)
            elif not fs.exists(final_p):
                raise RuntimeError(f"output of batch {batch} is lost: neither {staged} nor {final} exists")
        with fs.open(marker, "wb") as f:
            f.write(f"checkpoint {meta.checkpoint_id}\n".encode())
        if known and present:
            if deletes is not None:
                deletes.extend((fs, p) for p in sorted(present))
            else:
                _bulk_delete([(fs, p) for p in sorted(present)])
        elif present:
            try:
                fs.rm(staging, recursive=True)
            except FileNotFoundError:
                pass
        else:  # a redone commit: at most an empty folder is left
            self._rm(fs, staging)
        return True

    @staticmethod
    def _staged_files(fs, staging: str) -> Set[str]:
        """The files under a batch's staging folder, in one listing."""
        fs.invalidate_cache(staging)
        try:
            return {p.rstrip("/") for p in fs.find(staging)}
        except FileNotFoundError:
            return set()
        finally:
            fs.invalidate_cache(staging)

    def _clean_uncommitted_staging(self) -> None:
        """On resume: staged files of batches after the latest checkpoint belong to no checkpoint."""
        if not self.spec.output_path:
            return
        fs, root = _fs(self.spec.output_path)
        staging = _join(root, "_staging")
        if not fs.exists(staging):
            return
        for entry in _ls(fs, staging):
            name = posixpath.basename(entry.rstrip("/"))
            if name.startswith("batch-") and int(name[6:]) >= self.next_batch:
                self._rm(fs, entry)

    @staticmethod
    def _rm(fs, path: str) -> None:
        try:
            if fs.exists(path):
                fs.rm(path, recursive=True)
        except FileNotFoundError:
            pass

    # ---------------------------------------------------------------- retention and garbage
    def changelog_dir(self) -> str:
        return _join(self.base_path, self.spec.job_id, "dstl")

    def changelog_files(self) -> Dict[str, int]:
        """Changelog file name -> size, for every file under `<base>/<job>/dstl/`."""
        fs, root = _fs(self.changelog_dir())
        try:
            entries = _ls(fs, root, detail=True)
        except FileNotFoundError:
            return {}
        return {posixpath.basename(e["name"].rstrip("/")): int(e.get("size") or 0)
                for e in entries if e.get("type") != "directory"}

    def referenced_files(self) -> Set[str]:
        """Names of the files the retained checkpoints reference."""
        from dstl.changelog.checkpoints import files_referenced

        return {posixpath.basename(k.rstrip("/")) for k in files_referenced(self.base_path, latest=self.retain)}

    def collect_garbage(self, final: bool = False,
                        deletes: Optional[List[Tuple[Any, str]]] = None) -> Tuple[int, int, int]:
        """Drop old checkpoints and unreferenced changelog files; returns (new files, new bytes, deleted).

        A batch's pass (`deletes`: the batch's staged files, deleted in the same bulk request as the
        old checkpoints' metadata) follows the lease check that batch made before its checkpoint: a
        run that took over since then continues from a checkpoint this pass retains, and its new
        files are unknown here, so not deleted. `final` checks the lease again and lists afresh."""
        from dstl.changelog.fs import is_local
        from dstl.state.metadata import checkpoint_path, list_checkpoints, remove_checkpoint

        if final or deletes is None:
            self._check_lease(())  # deletes nothing on a base path another run has taken over
            self._ids = None
        if self._ids is None:
            self._ids = list_checkpoints(self.base_path)
        ids, retained = self._ids[:-self.retain], self._ids[-self.retain:]
        bfs, _ = _fs(self.base_path)
        batched = deletes is not None and not is_local(bfs)
        todo = list(deletes or ())
        if batched:  # on an object store a checkpoint is its `_metadata` object alone
            todo += [(bfs, _fs(checkpoint_path(self.base_path, cid))[1]) for cid in ids]
        _bulk_delete(todo)
        for cid in ids:
            if not batched:
                remove_checkpoint(self.base_path, cid)
            faults.point("coordinator.mid_gc_checkpoints", self.next_batch - 1)
        self._ids = retained
        self._written = {c: m for c, m in self._written.items() if c in retained}
        files = self.changelog_files()
        new = {n: s for n, s in files.items() if n not in self._known_files}
        if retained and all(c in self._written for c in retained):
            keep = {posixpath.basename(f.rstrip("/")) for c in retained for f in self._written[c].files()}
        else:  # a retained checkpoint this run did not write: read what it references
            keep = self.referenced_files()
        garbage = set(files) - keep
        doomed = garbage if final else garbage & self._suspects
        cfs, croot = _fs(self.changelog_dir())
        deleted = 0
        if doomed and not is_local(cfs):
            # after the checkpoints' metadata: a crash never leaves a checkpoint without its files
            deleted = _bulk_delete([(cfs, _join(croot, n)) for n in sorted(doomed)])
            faults.point("coordinator.mid_gc_files", self.next_batch - 1)
        for name in sorted(doomed) if is_local(cfs) else ():
            try:
                cfs.rm(_join(croot, name))
                deleted += 1
                faults.point("coordinator.mid_gc_files", self.next_batch - 1)
            except FileNotFoundError:
                pass
        self._suspects = garbage - doomed
        self._known_files = {n: s for n, s in files.items() if n not in doomed}
        return len(new), sum(new.values()), deleted

    def finish(self) -> int:
        """End of a successful run (no task running): delete every unreferenced changelog file."""
        self._check_lease(())
        if self.spec.output_path:
            fs, root = _fs(self.spec.output_path)
            staging = _join(root, "_staging")
            try:
                fs.invalidate_cache(staging)
                if fs.exists(staging) and not fs.find(staging):
                    fs.rm(staging, recursive=True)
            except FileNotFoundError:
                pass
            fs.invalidate_cache(staging)
        if not self.durable:
            return 0
        return self.collect_garbage(final=True)[2]


def _bulk_delete(items: Sequence[Tuple[Any, str]]) -> int:
    """Delete (file system, path) pairs, one bulk request per file system where it has them (S3
    deletes up to 1,000 keys in one); returns how many were asked for."""
    groups: Dict[Tuple[int, str], Tuple[Any, List[str]]] = {}
    for fs, path in items:  # s3fs deletes the keys of one bucket per request
        groups.setdefault((id(fs), path.lstrip("/").split("/", 1)[0]), (fs, []))[1].append(path)
    for fs, paths in groups.values():
        try:
            fs.rm(paths)
        except FileNotFoundError:
            pass
    return len(items)


def _write_job_file(fs, job_file: str, base: str, spec: JobSpec, exclusive: bool = False) -> None:
    from dstl.changelog.fs import create_file

    d = asdict(spec)
    if d.get("output_path"):
        d["output_path"] = relative_to(base, d["output_path"])
    data = json.dumps(d, indent=1, sort_keys=True).encode()
    if not exclusive:
        with fs.open(job_file, "wb") as f:
            f.write(data)
        return
    try:
        create_file(fs, job_file, data)
    except FileExistsError:  # another new job created it a moment ago
        from dstl.state.fencing import BasePathInUseError, current_holder

        holder = None
        for _ in range(20):  # the winner takes its lease right after creating the job file
            holder = current_holder(base)
            if holder is not None:
                break
            time.sleep(0.05)
        raise BasePathInUseError(base, holder or {}) from None


def _take_over(base: str, job_id: str):
    from dstl.state.fencing import WriterLease

    return WriterLease.acquire(base, job_id)


def _same_place(base: str, a: str, b: str) -> bool:
    return relative_to(base, a).rstrip("/") == relative_to(base, b).rstrip("/")


def _check_same(stored: JobSpec, asked: JobSpec, base: str) -> None:
    if asked.operator_id != stored.operator_id:
        raise JobConflictError(f"base path holds job {stored.job_id} of operator {stored.operator_id!r}, "
                               f"not {asked.operator_id!r}")
    if asked.max_parallelism and asked.max_parallelism != stored.max_parallelism:
        raise JobConflictError(f"job {stored.job_id} was started with max parallelism {stored.max_parallelism}; "
                               f"it cannot change (asked for {asked.max_parallelism})")
    if asked.output_path and stored.output_path and not _same_place(base, asked.output_path, stored.output_path):
        raise JobConflictError(f"job {stored.job_id} writes its output to {stored.output_path}, "
                               f"not {asked.output_path}")
    for k, v in asked.params.items():
        if k in stored.params and stored.params[k] != v:
            raise JobConflictError(f"job {stored.job_id} was started with {k}={stored.params[k]!r}; "
                                   f"resuming with {k}={v!r} would change its input (repeat the original "
                                   f"source options)")
