"""`dstl pipeline`: an exactly-once stateful PySpark job on dstl.

A seeded synthetic event stream (or `--input` parquet/CSV) is processed in micro-batches by a keyed
operator keeping per-user count, amount sum, distinct items (MapState) and last 10 items (ListState);
each batch's per-user updates are committed to parquet under `--output` once its checkpoint is durable.
Exit codes: 0 ok, 1 verification failed or the job failed, 2 bad options or paths.
"""
from __future__ import annotations

import argparse
import contextlib
import json
import os
import sys
import time
from dataclasses import asdict, dataclass, field
from typing import Any, Dict, List, Optional

OPERATOR_ID = "user-activity"
EVENTS_DDL = "batch long, event_id long, ts long, user_id {user}, item_id {item}, amount_cents long"


class UsageError(Exception):
    """A bad option or path: reported in one line, exit code 2."""


def add_arguments(p: argparse.ArgumentParser) -> None:
    src = p.add_argument_group("input")
    src.add_argument("--events", type=int, default=200_000, help="synthetic events in total (default 200000)")
    src.add_argument("--batches", type=int, default=10, help="micro-batches = checkpoints (default 10)")
    src.add_argument("--users", type=int, default=10_000, help="distinct synthetic users (Zipf-skewed; default 10000)")
    src.add_argument("--items", type=int, default=2_000, help="distinct synthetic items (default 2000)")
    src.add_argument("--seed", type=int, default=42, help="seed of the synthetic stream (default 42)")
    src.add_argument("--input", metavar="PATH", help="read events from a parquet/CSV file (any fsspec URL) "
                     "with user_id, item_id, amount_cents, ts instead of generating them")
    job = p.add_argument_group("job")
    job.add_argument("--parallelism", type=int, default=2, help="logical subtasks (default 2)")
    job.add_argument("--max-parallelism", type=int, default=None,
                     help="key groups (default: Flink's default for the parallelism; fixed for the job's life)")
    job.add_argument("--base-path", default="./dstl-run",
                     help="checkpoints and changelog, any fsspec URL (default ./dstl-run)")
    job.add_argument("--output", default=None, help="committed output (default <base-path>/output)")
    job.add_argument("--master", default=None,
                     help="Spark master (default local[2,4]: 2 threads, a task may fail 4 times; under "
                          "spark-submit: spark-submit's --master)")
    job.add_argument("--resume", action="store_true",
                     help="continue the job at --base-path from its latest checkpoint (any --parallelism)")
    job.add_argument("--from-checkpoint", type=int, default=None, metavar="N",
                     help="with --resume: roll back to retained checkpoint N first (later checkpoints are "
                          "abandoned, their output moves under <output>/_rolled_back/<time>/)")
    job.add_argument("--option", action="append", default=[], metavar="KEY=VALUE",
                     help="a dstl option of the changelog storage, as dstl.dfs.KEY or the bare suffix "
                          "(repeatable), e.g. upload.mode=thread, compression.enabled=true")
    job.add_argument("--fs-option", action="append", default=[], metavar="NAME=VALUE",
                     help="a keyword argument of the base path's fsspec file system (repeatable), e.g. "
                          "key=..., client_kwargs.endpoint_url=http://host:9000 (a dotted NAME fills a "
                          "nested dict; a VALUE that parses as JSON, such as true or {...}, is that value)")
    # the flag these two replaced: kept only to say so
    job.add_argument("--storage-option", action="append", default=[], help=argparse.SUPPRESS)
    job.add_argument("--materialize-every", type=int, default=200_000, metavar="CHANGES",
                     help="materialize a subtask's state after this many changes (default 200000; 0 = never)")
    job.add_argument("--retain", type=int, default=2, help="completed checkpoints kept (default 2)")
    job.add_argument("--routing", choices=("driver", "spark"), default="driver",
                     help="'driver': the driver routes each batch, run as one stage of P tasks that stay on "
                          "their executors (default); 'spark': a key-group UDF and a Spark shuffle route the rows")
    job.add_argument("--state", choices=("dstl", "memory"), default="dstl",
                     help="'memory' runs the same operator without durability (benchmark baseline)")
    chk = p.add_argument_group("failures and checks")
    chk.add_argument("--fail-at", type=int, metavar="BATCH",
                     help="subtask 0 crashes half-way through BATCH once; Spark retries it")
    chk.add_argument("--kill-at", type=int, metavar="BATCH",
                     help="the driver is SIGKILLed once BATCH's checkpoint is written, before its output "
                          "is committed (resume with --resume)")
    chk.add_argument("--stop-at", type=int, metavar="BATCH",
                     help="stop cleanly once BATCH is committed (continue later with --resume)")
    chk.add_argument("--verify", action="store_true",
                     help="compare the final state and all output with a pandas computation; exit 1 on a difference")
    out = p.add_argument_group("reporting")
    out.add_argument("--quiet", action="store_true", help="no progress bar")
    out.add_argument("--report-json", metavar="PATH", help="also write the report as JSON")


# ------------------------------------------------------------------ option checks

def _fail(msg: str) -> None:
    raise UsageError(msg)


def _positive(args, name: str) -> None:
    v = getattr(args, name.replace("-", "_"))
    if v is not None and v < 1:
        _fail(f"--{name} must be >= 1, got {v}")


def _is_local(url: str) -> bool:
    return "://" not in url or url.startswith("file://")


def _check_location(url: str, what: str) -> None:
    """A local path's parent directory must exist; a remote URL's bucket/root must exist."""
    from dstl.changelog.fs import filesystem

    try:
        fs, path = filesystem(url)
    except (ValueError, ImportError) as exc:
        _fail(f"{what} {url}: {exc}")
    if _is_local(url):
        parent = os.path.dirname(os.path.abspath(path.rstrip("/"))) or "/"
        if not os.path.isdir(parent):
            _fail(f"{what} {url}: parent directory {parent} does not exist")
        if os.path.exists(path) and not os.path.isdir(path):
            _fail(f"{what} {url} is a file, not a directory")
    else:
        root = path.split("/", 1)[0]
        try:
            ok = fs.exists(root)
        except Exception as exc:  # e.g. no credentials / endpoint
            _fail(f"{what} {url}: cannot reach {root}: {exc}")
        if not ok:
            _fail(f"{what} {url}: {root} does not exist")


def _pairs(flag: str, items: List[str]) -> List[tuple]:
    out = []
    for item in items:
        if "=" not in item:
            _fail(f"{flag} expects KEY=VALUE, got {item!r}")
        k, v = item.split("=", 1)
        out.append((k.strip(), v))
    return out


def _storage_config(args):
    from dstl.config import fs_options_from_flags, parse_options, storage_config

    if args.storage_option:
        name = args.storage_option[0].split("=", 1)[0].strip()
        hint = (f"--fs-option {name[3:]}=..." if name.startswith("fs.") and len(name) > 3
                else "--option KEY=VALUE for a dstl option, --fs-option NAME=VALUE for a file system argument")
        _fail(f"--storage-option is gone: use {hint}")
    try:
        options = parse_options({k: v.strip() for k, v in _pairs("--option", args.option)}, "--option", cli=True)
        config = storage_config(args.base_path, options, fs_options_from_flags(args.fs_option))
    except ValueError as exc:
        text = str(exc)
        _fail("--option: " + text[len("options: "):] if text.startswith("options: ") else text)
    if config.upload_mode == "process" and config.base_path.rstrip("/") != str(args.base_path).rstrip("/"):
        # the host's upload service keeps a dead worker's files that <base>/checkpoints references
        _fail(f"--option base-path={config.base_path} must equal --base-path {args.base_path} "
              "with upload.mode=process (the upload service looks for checkpoints under the base path)")
    return config


@dataclass
class Options:
    """Validated options (what `run_pipeline` takes; the CLI builds it from argparse)."""

    args: argparse.Namespace
    source: Any
    output: str
    storage: Any  # StorageConfig: dstl options and the file system's keyword arguments
    max_parallelism: Optional[int]


def check_options(args: argparse.Namespace) -> Options:
    from dstl.keygroups import UPPER_BOUND_MAX_PARALLELISM
    from dstl.app.source import FileSource, SyntheticSource

    for name in ("events", "batches", "users", "items", "parallelism", "max-parallelism", "retain"):
        _positive(args, name)
    if args.max_parallelism is not None and args.max_parallelism > UPPER_BOUND_MAX_PARALLELISM:
        _fail(f"--max-parallelism must be <= {UPPER_BOUND_MAX_PARALLELISM}, got {args.max_parallelism}")
    if args.max_parallelism is not None and args.parallelism > args.max_parallelism:
        _fail(f"--parallelism ({args.parallelism}) must not exceed --max-parallelism ({args.max_parallelism})")
    if getattr(args, "from_checkpoint", None) is not None and not args.resume:
        _fail("--from-checkpoint needs --resume")
    if args.materialize_every < 0:
        _fail(f"--materialize-every must be >= 0, got {args.materialize_every}")
    for name in ("fail_at", "kill_at", "stop_at"):
        v = getattr(args, name)
        if v is not None and not 0 <= v < args.batches:
            _fail(f"--{name.replace('_', '-')} must be a batch in 0..{args.batches - 1}, got {v}")
    if args.state == "memory" and (args.resume or args.verify or args.fail_at is not None or args.kill_at is not None):
        _fail("--state memory keeps no checkpoints: it cannot --resume, --verify, --fail-at or --kill-at")
    if args.input:
        try:
            source = FileSource(args.input, args.batches)
        except FileNotFoundError as exc:
            _fail(str(exc))
        except (ValueError, OSError) as exc:
            _fail(f"{exc}")
    else:
        try:
            source = SyntheticSource(args.events, args.batches, args.users, args.items, args.seed)
        except ValueError as exc:
            _fail(str(exc))
    storage = _storage_config(args)  # registers the file system's arguments before the checks below
    _check_location(args.base_path, "--base-path")
    output = args.output or args.base_path.rstrip("/") + "/output"
    if args.output:
        _check_location(output, "--output")
    return Options(args, source, output, storage, args.max_parallelism)


# ------------------------------------------------------------------ Spark

DEFAULT_MASTER = "local[2,4]"


def spark_session(master: Optional[str]):
    """A SparkSession for the pipeline (an already running one is reused as is).

    `master` None: spark-submit's master when spark-submit started this driver, else local[2,4].
    """
    os.environ.setdefault("PYSPARK_PYTHON", sys.executable)
    os.environ.setdefault("SPARK_LOCAL_IP", "127.0.0.1")
    from pyspark.sql import SparkSession

    active = SparkSession.getActiveSession()
    if active is not None:
        return active
    if master is None and "PYSPARK_GATEWAY_PORT" not in os.environ:  # not launched by spark-submit
        master = DEFAULT_MASTER
    builder = SparkSession.builder
    if master is not None:
        builder = builder.master(master)
    builder = (builder.appName("dstl-pipeline")
               .config("spark.ui.enabled", "false")
               .config("spark.ui.showConsoleProgress", "false")
               .config("spark.sql.execution.arrow.pyspark.enabled", "true")
               .config("spark.python.worker.reuse", "true")
               .config("spark.speculation", "false")
               .config("spark.sql.shuffle.partitions", "8"))
    if os.environ.get("SPARK_LOCAL_IP") == "127.0.0.1":
        builder = builder.config("spark.driver.host", "127.0.0.1").config("spark.driver.bindAddress", "127.0.0.1")
    if master is not None and master.startswith("local-cluster"):
        # executors are separate JVMs: they need the same Python and the same environment
        builder = builder.config("spark.executorEnv.PYSPARK_PYTHON", sys.executable)
        for k in ("AWS_ENDPOINT_URL", "AWS_ACCESS_KEY_ID", "AWS_SECRET_ACCESS_KEY", "AWS_DEFAULT_REGION",
                  "DSTL_PUREPYTHON"):
            if os.environ.get(k):
                builder = builder.config(f"spark.executorEnv.{k}", os.environ[k])
    session = builder.getOrCreate()
    from dstl.spark.session import quiet

    quiet(session)
    return session


# ------------------------------------------------------------------ progress and report

class Progress:
    def __init__(self, total: int, first: int, stream, enabled: bool):
        self.total, self.first, self.stream, self.enabled = total, first, stream, enabled
        self.tty = enabled and hasattr(stream, "isatty") and stream.isatty()

    def update(self, done: int, line: str) -> None:
        if not self.enabled:
            return
        width = 24
        filled = int(width * done / max(1, self.total))
        bar = "#" * filled + "." * (width - filled)
        text = f"[{bar}] {done}/{self.total} {line}"
        if self.tty:
            self.stream.write("\r" + text.ljust(100))
            if done == self.total:
                self.stream.write("\n")
        else:
            self.stream.write(text + "\n")
        self.stream.flush()


def _pct(values: List[float], q: float) -> float:
    if not values:
        return 0.0
    s = sorted(values)
    k = min(len(s) - 1, max(0, int(round(q * (len(s) - 1)))))
    return s[k]


@dataclass
class Report:
    events: int = 0
    batches: int = 0
    seconds: float = 0.0
    checkpoint_ms: List[float] = field(default_factory=list)
    uploaded_files: int = 0
    uploaded_bytes: int = 0
    deleted_files: int = 0
    restores: List[float] = field(default_factory=list)
    fail_restore_ms: Optional[float] = None
    #: accepted task reports of the --fail-at batch from a retried attempt (attempt > 0)
    fail_retries: int = 0
    verify_restore_ms: Optional[float] = None
    state_size: int = 0
    users: Optional[int] = None
    cache_hits: int = 0
    subtask_batches: int = 0
    retained_files: int = 0
    retained_bytes: int = 0
    garbage_files: int = 0
    recovered_output: bool = False
    #: --from-checkpoint: (checkpoint rolled back to, abandoned checkpoints, batches whose output moved)
    rolled_back: Optional[Dict[str, Any]] = None
    verify: Optional[List[str]] = None
    first_batch: int = 0
    parallelism: int = 0
    max_parallelism: int = 0
    job_id: str = ""
    state: str = "dstl"
    warm_events: int = 0
    #: subtask-batches that ran on another executor than in the batch before
    moved: int = 0
    warm_seconds: float = 0.0
    #: per batch: wall time and where it went (slowest task's restore/process/snapshot, driver steps)
    details: List[Dict[str, float]] = field(default_factory=list)

    @property
    def events_per_s(self) -> float:
        return self.events / self.seconds if self.seconds else 0.0

    def as_dict(self) -> Dict[str, Any]:
        d = dict(self.__dict__)
        d.update(events_per_s=self.events_per_s,
                 warm_events_per_s=self.warm_events / self.warm_seconds if self.warm_seconds else 0.0, checkpoint_p50_ms=_pct(self.checkpoint_ms, 0.5),
                 checkpoint_p99_ms=_pct(self.checkpoint_ms, 0.99))
        return d

    def render(self) -> str:
        mib = 1 << 20
        lines = [f"dstl pipeline report (job {self.job_id}, state {self.state}, parallelism {self.parallelism}, "
                 f"max parallelism {self.max_parallelism})",
                 f"  batches          {self.batches} run (from batch {self.first_batch}), {self.events:,} events",
                 f"  throughput       {self.events_per_s:,.0f} events/s ({self.seconds:.2f} s in batches)"
                 + (f"; {self.warm_events / self.warm_seconds:,.0f} events/s after the first batch"
                    if self.warm_seconds else "")]
        if self.state == "dstl":
            lines += [
                f"  checkpoint       p50 {_pct(self.checkpoint_ms, .5):.0f} ms, p99 {_pct(self.checkpoint_ms, .99):.0f} ms"
                f" (slowest task's output staging + state snapshot, + metadata write)",
                f"  uploaded         {self.uploaded_files} files, {self.uploaded_bytes / mib:.2f} MiB; "
                f"{self.deleted_files} unreferenced files deleted",
                f"  retained         {self.retained_files} changelog files, {self.retained_bytes / mib:.2f} MiB",
                f"  state size       {self.state_size / mib:.2f} MiB (files of the latest checkpoint)"
                + (f", {self.users:,} users" if self.users is not None else ""),
                f"  worker cache     {self.cache_hits}/{self.subtask_batches} subtask-batches continued from memory"
                f", {self.moved} moved to another executor",
                "  restore          " + (f"{len(self.restores)} task restores, max {max(self.restores):.0f} ms"
                                         if self.restores else "none in tasks")
                + (f"; after --fail-at {self.fail_restore_ms:.0f} ms" if self.fail_restore_ms is not None else "")
                + (f"; full state on the driver {self.verify_restore_ms:.0f} ms"
                   if self.verify_restore_ms is not None else "")]
            if self.recovered_output:
                lines.append("  recovery         committed the output of the latest checkpoint left by a crash")
            if self.rolled_back:
                rb = self.rolled_back
                lines.append(f"  rolled back      to checkpoint {rb['checkpoint_id']}: abandoned {rb['abandoned']}, "
                             f"output of batches {rb['moved_batches']} moved to _rolled_back/{rb['stamp']}/")
        if self.verify is not None:
            lines.append("  verify           " + ("OK: state and output match pandas" if not self.verify
                                                  else f"FAILED ({len(self.verify)} problems)"))
            lines += [f"    - {p}" for p in self.verify]
        return "\n".join(lines)


# ------------------------------------------------------------------ the run

def run_pipeline(opts: Options, spark=None, stream=None) -> Report:
    """Run (or resume) the job; returns the report. Raises UsageError for bad options/paths."""
    from dstl.keygroups import compute_default_max_parallelism
    from dstl.changelog.fs import StoreUnreachableError, probe_base_path
    from dstl.spark.coordinator import CheckpointCoordinator, JobConflictError, JobSpec

    args = opts.args
    stream = sys.stderr if stream is None else stream
    source = opts.source
    maxp = opts.max_parallelism or (0 if args.resume else compute_default_max_parallelism(args.parallelism))
    spec = JobSpec.new(OPERATOR_ID, maxp, opts.output, source.params())
    backend_options = {"materialize_every_changes": args.materialize_every} if args.materialize_every else {}
    try:
        probe_base_path(args.base_path)  # no credentials, no bucket: one line before any task
        coord = CheckpointCoordinator.open(args.base_path, spec, opts.storage, resume=args.resume,
                                           retain=args.retain, backend_options=backend_options,
                                           durable=args.state == "dstl",
                                           resume_from=getattr(args, "from_checkpoint", None))
    except (JobConflictError, StoreUnreachableError) as exc:
        raise UsageError(str(exc)) from None
    maxp = coord.spec.max_parallelism
    if args.parallelism > maxp:
        raise UsageError(f"--parallelism ({args.parallelism}) must not exceed the job's max parallelism ({maxp})")
    report = Report(first_batch=coord.next_batch, parallelism=args.parallelism, max_parallelism=maxp,
                    job_id=coord.spec.job_id, state=args.state, recovered_output=coord.recovered_output,
                    rolled_back=None if coord.rolled_back is None else asdict(coord.rolled_back))
    own_session = False
    if spark is None:
        from pyspark import SparkContext  # PySpark: only when the pipeline runs

        # getOrCreate hands back any context this process already runs (a caller's, a test
        # suite's), whether or not its session is active in this thread: stop only one made here
        own_session = SparkContext._active_spark_context is None
    session = spark if spark is not None else spark_session(args.master)
    try:
        with _armed_faults(args, coord, session):
            return _run_batches(args, opts, coord, session, report, stream)
    finally:
        if own_session:
            session.stop()  # a clean shutdown (local-cluster executors otherwise complain at exit)


@contextlib.contextmanager
def _armed_faults(args, coord, session):
    """--fail-at / --kill-at through the one fault hook (dstl.spark.faults).

    --fail-at B: subtask 0's first attempt of batch B crashes half-way (Spark retries it); armed in
    DSTL_FAULTS for the whole run, so the Python workers see it and keep one environment (and so
    one worker pool and warm caches). --kill-at B: the driver SIGKILLs itself once checkpoint B + 1
    is durable, before the output commit."""
    from dstl.spark import faults

    specs = []
    if args.fail_at is not None:
        marker = f"{coord.base_path}/_dstl_failures/batch-{args.fail_at:06d}"
        specs.append(f"task.mid_batch@{args.fail_at}/0=raise:once={marker}")
    if args.kill_at is not None:
        specs.append(f"pipeline.after_metadata@{args.kill_at}=kill")
    if not specs:
        yield
        return
    saved = os.environ.get(faults.ENV)
    os.environ[faults.ENV] = ",".join(([saved] if saved else []) + specs)
    try:
        yield
    finally:
        from dstl.spark.session import set_worker_env

        if saved is None:
            os.environ.pop(faults.ENV, None)
        else:
            os.environ[faults.ENV] = saved
        set_worker_env(session, faults.ENV, saved)


def _run_batches(args, opts, coord, session, report: Report, stream) -> Report:
    from dstl.app.activity import output_ddl, user_activity
    from dstl.spark.job import StatefulJob

    source = opts.source
    user_t = source.spark_type("user_id") if hasattr(source, "spark_type") else "long"
    item_t = source.spark_type("item_id") if hasattr(source, "spark_type") else "long"
    events_schema = EVENTS_DDL.format(user=user_t, item=item_t)
    job = StatefulJob(coord, user_activity, output_ddl(user_t, item_t), key="user_id",
                      parallelism=args.parallelism, order_by=["ts", "event_id"], spark=session,
                      events_schema=events_schema)
    try:
        _each_batch(args, coord, source, session, job, report, stream, events_schema)
    finally:
        job.close()
    return _finish(args, coord, source, report)


def _each_batch(args, coord, source, session, job, report: Report, stream, events_schema) -> None:
    from dstl.spark import faults

    progress = Progress(source.batches, coord.next_batch, stream, not args.quiet)
    restored_from = coord.latest.checkpoint_id if coord.latest is not None else None
    for b in range(coord.next_batch, source.batches):
        pdf = source.batch(b)
        df = pdf if args.routing == "driver" else session.createDataFrame(pdf, schema=events_schema)

        def announce(batch=b):
            stream.write(f"\n--kill-at {batch}: checkpoint {batch + 1} is written; killing the driver "
                         f"(pid {os.getpid()}) before its output is committed\n")
            stream.flush()

        res = job.run_batch(df, properties={"events": len(pdf)}, after_metadata=lambda batch=b: faults.point(
            "pipeline.after_metadata", batch, before=lambda: announce(batch)))
        report.batches += 1
        report.details.append({
            "batch": b, "seconds": round(res.seconds, 3),
            "restore_ms": round(max(r.restore_ms for r in res.reports), 1),
            "process_ms": round(max(r.process_ms for r in res.reports), 1),
            "snapshot_ms": round(max(r.snapshot_ms for r in res.reports), 1),
            "metadata_ms": round(res.stats.metadata_ms, 1), "commit_ms": round(res.stats.commit_ms, 1),
            "gc_ms": round(res.stats.gc_ms, 1)})
        report.events += res.rows_in
        report.seconds += res.seconds
        report.subtask_batches += len(res.reports)
        report.moved += res.stats.placement.get("moved", 0)
        if args.state == "dstl":
            report.checkpoint_ms.append(res.checkpoint_ms)
            report.uploaded_files += res.stats.new_files
            report.uploaded_bytes += res.stats.new_bytes
            report.deleted_files += res.stats.deleted_files
            report.state_size = res.stats.state_size
            report.cache_hits += res.cache_hits
            # a restore is a task that found no usable cache although a checkpoint existed
            if restored_from is not None:
                times = [r.restore_ms for r in res.reports if r.restored]
                report.restores += times
                if args.fail_at == b:
                    report.fail_retries = sum(1 for r in res.reports if r.attempt > 0)
                    retried = [r.restore_ms for r in res.reports if r.restored and r.attempt > 0]
                    report.fail_restore_ms = max(retried) if retried else None
        restored_from = res.checkpoint_id
        if b > report.first_batch:
            report.warm_events += res.rows_in
            report.warm_seconds += res.seconds
        progress.update(b + 1, f"batch {b}: {res.rows_in:,} events, {res.rows_in / res.seconds:,.0f} ev/s, "
                               f"checkpoint {res.checkpoint_ms:.0f} ms"
                               + (f", {res.restored} restored" if res.restored and b != report.first_batch else ""))
        if args.stop_at == b:
            break


def _finish(args, coord, source, report: Report) -> Report:
    if args.state == "dstl":
        report.deleted_files += coord.finish()
        files = coord.changelog_files()
        keep = coord.referenced_files()
        report.retained_files = sum(1 for n in files if n in keep)
        report.retained_bytes = sum(s for n, s in files.items() if n in keep)
        report.garbage_files = sum(1 for n in files if n not in keep)
        if coord.latest is not None:
            # what a restore of the latest checkpoint reads (intersected handles report no size)
            latest = {n.rstrip("/").rsplit("/", 1)[-1] for n in coord.latest.files()}
            report.state_size = sum(s for n, s in files.items() if n in latest)
    if args.verify:
        report.verify = verify(coord, source, report)
    return report


def read_checkpoint_state(coord, meta) -> Dict[Any, Dict[str, Any]]:
    """Restore every subtask of checkpoint `meta` on the driver and read the whole state back."""
    from dstl.app.activity import read_state
    from dstl.changelog.storage import FsStateChangelogStorage
    from dstl.spark.restore import subtask_state_to_snapshot
    from dstl.state.backend import KeyedStateBackend

    state: Dict[Any, Dict[str, Any]] = {}
    with FsStateChangelogStorage(coord.storage_config.replace(upload_mode="direct"),
                                 job_id=coord.spec.job_id) as storage:
        for st in meta.subtasks:
            backend = KeyedStateBackend.restore(storage, coord.spec.operator_id, st.key_group_range,
                                                meta.max_parallelism, [subtask_state_to_snapshot(st)])
            try:
                part = read_state(backend)
            finally:
                backend.close()
            overlap = set(part) & set(state)
            if overlap:
                raise RuntimeError(f"users {sorted(overlap)[:5]} are held by two subtasks")
            state.update(part)
    return state


def read_output(output: str):
    """All committed output rows (batches with a _SUCCESS marker); errors on staged leftovers."""
    import pandas as pd
    import pyarrow.parquet as pq

    from dstl.changelog.fs import filesystem

    fs, root = filesystem(output)
    fs.invalidate_cache()
    frames = []
    if not fs.exists(root):
        return pd.DataFrame(), []
    problems = []
    for entry in sorted(fs.ls(root, detail=False)):
        name = entry.rstrip("/").rsplit("/", 1)[-1]
        if name == "_staging":
            left = [p for p in fs.find(entry)]
            if left:
                problems.append(f"{len(left)} staged output files left uncommitted, e.g. {left[0]}")
            continue
        if not name.startswith("batch-"):
            continue
        files = sorted(fs.ls(entry, detail=False))
        if not any(f.endswith("/_SUCCESS") for f in files):
            problems.append(f"output {name} has no _SUCCESS marker (uncommitted)")
        for f in files:
            if f.endswith(".parquet"):
                with fs.open(f, "rb") as fh:
                    frames.append(pq.read_table(fh).to_pandas())
    out = pd.concat(frames, ignore_index=True) if frames else pd.DataFrame()
    return out, problems


def verify(coord, source, report: Report) -> List[str]:
    """Differences between the job's final state + output and a plain pandas computation."""
    from dstl.app.activity import compare_output, compare_state, reference

    done = coord.next_batch
    problems: List[str] = []
    if done == 0:
        return ["no checkpoint to verify"]
    events = source.all()
    events = events[events["batch"] < done]
    expected_state, expected_out = reference(events)
    t0 = time.perf_counter()
    actual_state = read_checkpoint_state(coord, coord.latest)
    report.verify_restore_ms = (time.perf_counter() - t0) * 1e3
    report.users = len(actual_state)
    problems += compare_state(actual_state, expected_state)
    actual_out, out_problems = read_output(coord.spec.output_path)
    problems += out_problems
    if len(actual_out) == 0 and len(expected_out):
        problems.append("no output was committed")
    else:
        problems += compare_output(actual_out, expected_out)
    if report.garbage_files:
        problems.append(f"{report.garbage_files} changelog files are referenced by no retained checkpoint")
    return problems


def run(args: argparse.Namespace) -> int:
    try:
        opts = check_options(args)
        report = run_pipeline(opts)
    except UsageError as exc:
        print(f"dstl pipeline: error: {exc}", file=sys.stderr)
        return 2
    text = report.render()
    print(text)
    if args.report_json:
        with open(args.report_json, "w") as f:
            json.dump(report.as_dict(), f, indent=1, default=str)
    if report.verify:
        return 1
    return 0


def main(argv: Optional[List[str]] = None) -> int:
    p = argparse.ArgumentParser(prog="dstl pipeline", description=__doc__.splitlines()[0])
    add_arguments(p)
    return run(p.parse_args(argv))


if __name__ == "__main__":
    sys.exit(main())
