"""Everything dstl asks of Spark itself, in one place (a Spark Connect side can go behind it).

* `ensure_importable_on_workers` / `set_worker_env`: ship the package path and dstl's environment
  to the Python workers.
* `SubtaskStage`: one micro-batch as ONE Spark stage of P concurrent tasks, task i = subtask i,
  with subtask i kept on the same executor batch after batch (docs/spark.md, "Placement").
* `collect`: a batch's one evaluation, its jobs named after the batch (a job description on a
  classic session, a job tag under Spark Connect).
* `executor_id` / `executor_process` (run in a Python worker): the executor running the task.
* `is_connect` / `default_parallelism`: which kind of session this is, and how many tasks a read
  should use by default.
* `struct_from_ddl`: a DDL string as a StructType on Spark 3.5 and 4.x.

Classic and Spark Connect. A Connect session (`SparkSession.builder.remote("sc://host")`) has no
SparkContext, no `_jvm` and no RDDs; `is_connect` recognises it by its class, and then nothing here
touches them: the workers' environment cannot be set from the client (the package must be
installed on the cluster, and object-store settings come from the server's configuration), the
log level stays the server's, a batch's jobs are tagged instead of described, and the executor
count is unknown.
Everything else (the anchor's persist, the repartition, join hints, `mapInPandas`, executor ids
read in the worker) is plain DataFrame API and works the same on both, placement included.

The placement trick. An *anchor* of P rows (row i: subtask i and its salt, dstl.spark.routing) is
hash-partitioned by the salt into P partitions, persisted and materialised once. Its cached blocks
stay on the executors that computed them, and the DAGScheduler gives a later stage that reaches
the anchor's cached RDD through narrow dependencies the blocks' executors as PROCESS_LOCAL preferred
locations; delay scheduling (`spark.locality.wait`) then runs partition i on that executor again.
Per batch the stage is ``anchor LEFT JOIN batch ON salt`` followed by ``mapInPandas``:

* shuffle route: the batch is ``repartition(P, salt)``-ed, the same hash partitioning as the
  anchor's, so the planner sees the two sides co-partitioned and shuffles only the batch (each row
  moves once, executor to executor; the driver never holds it). A sort-merge join, by hint: it
  cannot become a broadcast under AQE, and the sort in front of the shuffle reader leaves the
  zipped partition without the reader's host preference, so the anchor's block decides where the
  task runs. ``repartition`` by number is an exchange AQE neither coalesces nor splits for skew,
  and the anchor's side is a cached scan: the stage keeps exactly P tasks;
* broadcast route (a small pandas batch the driver already holds): ``broadcast(batch)``; the
  cached anchor is the streamed side, no shuffle at all.

Either way every subtask's task runs even without rows (the left join keeps its anchor row), and
partition i receives exactly subtask i's rows. If an executor is lost, its anchor blocks are
recomputed where the retried tasks run: those subtasks move once and then stay on their new executor.

No other dstl.spark module (nor dstl.app.pipeline) touches `sparkContext`, the JVM or an RDD; here
`sparkContext` serves the worker environment, the log level, the job description, the default
parallelism and the executor count; under Spark Connect (`is_connect`) none of them touches it.
"""
from __future__ import annotations

import logging
import os
from typing import Any, Callable, Dict, Optional, Tuple

from dstl.spark.routing import BROADCAST, SALT_COL, route_batch, salt_column

log = logging.getLogger(__name__)

#: the anchor's column: the subtask a partition stands for
ANCHOR_COL = "_dstl_anchor"
#: the anchor's salt, by which it is hash-partitioned (partition i holds subtask i's salt)
ANCHOR_SALT_COL = "_dstl_anchor_salt"

#: environment variables the Python workers get from the driver
FORWARDED_ENV_PREFIXES = ("DSTL_", "AWS_ENDPOINT_URL", "AWS_DEFAULT_REGION", "AWS_REGION", "FSSPEC_")
#: forwarded only with a local master (same machine); on a cluster executors bring their own
#: credentials (instance roles, spark.executorEnv.*), they are not shipped inside tasks
LOCAL_ONLY_ENV = ("AWS_ACCESS_KEY_ID", "AWS_SECRET_ACCESS_KEY", "AWS_SESSION_TOKEN")


# ------------------------------------------------------------------ classic or Connect

def is_connect(spark) -> bool:
    """True for a Spark Connect session (pyspark.sql.connect), False for a classic one."""
    return type(spark).__module__.startswith("pyspark.sql.connect")


def default_parallelism(spark) -> int:
    """Spark's default number of tasks: the context's defaultParallelism (classic); under Connect the
    `spark.default.parallelism` setting, else `spark.sql.shuffle.partitions`."""
    if not is_connect(spark):
        return int(spark.sparkContext.defaultParallelism)
    for key in ("spark.default.parallelism", "spark.sql.shuffle.partitions"):
        try:
            value = spark.conf.get(key, None)
        except Exception:  # noqa: BLE001 - a setting the server does not expose
            value = None
        if value:
            return max(1, int(value))
    return 1


def struct_from_ddl(ddl: str):
    """A DDL string ("a int, b string") as a StructType. Spark 4 has `StructType.fromDDL`; Spark 3.5
    has not, and there the active SparkContext's own parser does it (so only with a session)."""
    from pyspark.sql.types import StructType  # PySpark

    from_ddl = getattr(StructType, "fromDDL", None)
    if from_ddl is not None:
        return from_ddl(ddl)
    from pyspark.sql.types import _parse_datatype_string  # PySpark

    return _parse_datatype_string(ddl)


# ------------------------------------------------------------------ the workers' environment

def _worker_env(spark) -> Optional[Dict[str, str]]:
    """The mutable environment Spark hands to Python workers it starts (None under Spark Connect)."""
    if is_connect(spark):
        return None
    try:
        return spark.sparkContext.environment
    except Exception:  # noqa: BLE001 - Spark Connect has no SparkContext
        return None


def _master(spark) -> str:
    try:
        return spark.conf.get("spark.master", "") or ""
    except Exception:  # noqa: BLE001
        return ""


def ensure_importable_on_workers(spark) -> None:
    """Let Python workers import the same dstl as the driver.

    An installed package (pip install, also editable) is found by the workers anyway. When dstl is
    used from a source tree (tests, a checkout on PYTHONPATH), its parent directory is added to the
    PYTHONPATH Spark hands to the Python workers it starts. On a real cluster install the package on
    every executor (see docs/spark.md, "A real cluster").
    """
    import dstl  # the package's root is the entry layer, above this one: read here, when called

    env = _worker_env(spark)
    if env is None:
        return
    root = os.path.dirname(os.path.dirname(os.path.abspath(dstl.__file__)))
    parts = [p for p in env.get("PYTHONPATH", "").split(os.pathsep) if p]
    if root not in parts:
        env["PYTHONPATH"] = os.pathsep.join(parts + [root])
    # the driver's object-store settings and dstl switches, also when they were set after the JVM started
    local = _master(spark).startswith("local")
    for k, v in os.environ.items():
        if (k.startswith(FORWARDED_ENV_PREFIXES) or (local and k in LOCAL_ONLY_ENV)) and env.get(k) != v:
            env[k] = v


def set_worker_env(spark, name: str, value: Optional[str]) -> None:
    """Set (or with None remove) one variable of the Python workers' environment."""
    env = _worker_env(spark)
    if env is None:
        return
    if value is None:
        env.pop(name, None)
    else:
        env[name] = value


def quiet(spark, level: str = "ERROR") -> None:
    """Spark's own log level for this application (a Connect client leaves the server's)."""
    if is_connect(spark):
        return
    try:
        spark.sparkContext.setLogLevel(level)
    except Exception:  # noqa: BLE001 - Spark Connect
        pass


def executor_count(spark) -> Optional[int]:
    """Executors currently registered (the driver not counted; local mode: 1), None if unknown."""
    if _master(spark).startswith("local["):
        return 1
    if is_connect(spark):
        return None
    try:
        n = spark.sparkContext._jsc.sc().getExecutorMemoryStatus().size()  # includes the driver
        return max(1, int(n) - 1)
    except Exception:  # noqa: BLE001 - Spark Connect, or the JVM API changed
        return None


def application_of(spark) -> Any:
    """What identifies the Spark application behind a session: sessions of one application share
    the cache (and so a placed anchor); under Spark Connect, the session itself."""
    try:
        return ("app", spark.sparkContext.applicationId)
    except Exception:  # noqa: BLE001 - Spark Connect has no SparkContext
        return ("session", id(spark))


def batch_tag(description: str) -> str:
    """`description` as a Spark job tag: Spark keeps a job's tags as one comma-joined list
    (``spark.job.tags``), so a tag may hold no comma (nor be empty)."""
    return description.replace(",", ";") or "dstl"


def _collect(df):
    try:
        return df.collect()
    except Exception as exc:
        from dstl.spark.errors import raise_from_worker

        raise_from_worker(exc)  # the worker's cause (memory limit, store, processor, slot) as the first line
        raise


def collect(spark, df, description: str):
    """`df.collect()` with its jobs named by `description`, so a batch's jobs can be told apart in
    the UI and the event log: a classic session sets it as the job description
    (``spark.job.description``); a Connect client cannot, and tags the jobs with it instead
    (`batch_tag`; the server lists it in ``spark.job.tags`` behind its own session prefix)."""
    if is_connect(spark):
        tag = batch_tag(description)
        spark.addTag(tag)  # thread-local on the client: it names this thread's operations only
        try:
            return _collect(df)
        finally:
            spark.removeTag(tag)
    key = "spark.job.description"
    try:
        sc = spark.sparkContext
        saved = sc.getLocalProperty(key)  # foreachBatch's own ("id = ..., batch = N")
        sc.setLocalProperty(key, description)
    except Exception:  # noqa: BLE001 - no context to set it on: the rows all the same
        sc = None
    try:
        return _collect(df)
    finally:
        if sc is not None:
            sc.setLocalProperty(key, saved)


# ------------------------------------------------------------------ the per-batch stage

class SubtaskStage:
    """Run one micro-batch as one stage of `parallelism` tasks, task i = subtask i, placed by the
    cached anchor (see the module docstring). One per stream or job and parallelism; `close()`
    unpersists the anchor."""

    def __init__(self, spark, parallelism: int):
        if isinstance(parallelism, bool) or not isinstance(parallelism, int) or parallelism < 1:
            raise ValueError(f"parallelism must be a positive int, got {parallelism!r}")
        self.spark = spark
        self.parallelism = parallelism
        self._anchor = None  # the persisted anchor (what close() unpersists)
        self._view = None  # the anchor as a DataFrame of the current session
        self.placements = 0

    #: how often a first placement is redone when it leaves an executor with 2+ subtasks more than another
    PLACEMENT_TRIES = 3

    def anchor(self):
        """The persisted anchor, materialised on first use (or again after `replace()`)."""
        if self._anchor is None:
            n = executor_count(self.spark)
            for attempt in range(self.PLACEMENT_TRIES):
                self._anchor = self._place()
                if n is None or n < 2 or self.parallelism < 2 or attempt == self.PLACEMENT_TRIES - 1:
                    break
                counts = self.where()
                per = [sum(1 for e in counts.values() if e == ex) for ex in set(counts.values())]
                per += [0] * max(0, n - len(per))  # executors that got no subtask
                if max(per) - min(per) <= 1:
                    break
                log.info("anchor placement %s is uneven over %d executors: placing it again", counts, n)
                self.close()
        return self._anchor

    def _plan(self, spark):
        from pyspark.sql import functions as F  # PySpark

        p = self.parallelism
        ids = spark.range(0, p, 1, numPartitions=p)
        # hash-partitioned by the salt exactly as the shuffle route partitions a batch: Spark sees
        # the two sides of the join co-partitioned and shuffles only the batch
        return ids.select(F.col("id").cast("int").alias(ANCHOR_COL),
                          salt_column(F.col("id").cast("int"), p).alias(ANCHOR_SALT_COL)).repartition(
            p, F.col(ANCHOR_SALT_COL))

    def rebind(self, spark) -> None:
        """Go on in another session of the same application (foreachBatch may hand a batch a new
        session object). An application's sessions share Spark's cache, which matches plans, so the
        same plan built in `spark` reads the anchor's cached blocks: the placement carries over."""
        self.spark = spark
        if self._anchor is not None:
            self._view = self._plan(spark)

    def _place(self):
        from pyspark import StorageLevel  # PySpark

        df = self._plan(self.spark).persist(StorageLevel.MEMORY_ONLY)
        # materialise: P tasks with no preference, which the scheduler hands to free cores; with tiny
        # tasks one executor may take several before another asks (hence the check in anchor())
        df.count()
        self.placements += 1
        return df

    def where(self) -> Dict[int, str]:
        """Subtask -> the executor its anchor block is on (a tiny job over the cached anchor, which
        runs where the blocks are)."""
        def probe(batches):  # pragma: no cover - runs in the Python worker, shipped by value
            import pandas as pd  # imported in the worker that runs it
            from pyspark import TaskContext  # PySpark

            from dstl.spark.session import executor_id  # in the worker: this module, imported there

            for _ in batches:
                pass
            yield pd.DataFrame({"subtask": [TaskContext.get().partitionId()], "executor": [executor_id()]})

        rows = self._anchor.mapInPandas(probe, "subtask int, executor string").collect()
        return {r.subtask: r.executor for r in rows}

    def replace(self) -> None:
        """Forget the anchor's placement: the next batch places every subtask anew."""
        self.close()

    def run(self, batch, subtask_col: str, task: Callable, schema: Any, route: str = "shuffle"):
        """The DataFrame of `task`'s output for `batch` (a DataFrame with `subtask_col`): partition i
        of one stage gets subtask i's rows (plus the anchor's columns, and one row with null batch
        columns for a subtask without rows). `route`: "shuffle" (each row moves once, executor to
        executor) or "broadcast" (the whole batch to every executor, through the driver; for small
        driver-held batches). Evaluate it once."""
        from pyspark.sql import functions as F  # PySpark

        routed = route_batch(batch, subtask_col, self.parallelism, route)
        anchor = self.anchor() if self._view is None else self._view
        if route == BROADCAST:
            joined = anchor.join(routed, F.col(ANCHOR_COL) == F.col(subtask_col), "left_outer")
        else:
            # A sort-merge join, by hint: AQE would broadcast a small batch otherwise, and a shuffled
            # hash join feeds the shuffle reader straight into the zipped partition, whose
            # map-output host preference then wins over the anchor's cached block (NODE_LOCAL: any
            # executor of the host). The sort in front of each side leaves the zip no preference
            # of its own, so the scheduler finds the anchor's block (docs/spark.md, "Placement").
            joined = anchor.join(routed.hint("merge"), F.col(ANCHOR_SALT_COL) == F.col(SALT_COL), "left_outer")
        return joined.mapInPandas(task, schema)

    def close(self) -> None:
        if self._anchor is not None:
            try:
                self._anchor.unpersist()
            except Exception:  # noqa: BLE001 - the session may be gone already
                pass
            self._anchor = None
        self._view = None


# ------------------------------------------------------------------ in the Python worker

_EXECUTOR_ID: Optional[str] = None
#: (pid, id) of the executor a slot process serves (dstl.spark.slot_process): it is nobody's Python worker
_SERVED: Optional[Tuple[Optional[int], str]] = None


def serve_executor(pid: Optional[int], eid: str) -> None:
    """In a slot process: the executor of the worker whose task runs now (its JVM is not an ancestor)."""
    global _SERVED
    _SERVED = (pid, eid)


def executor_id() -> str:
    """The id of the executor whose Python worker runs this code: the executor JVM is an ancestor
    of the worker (via pyspark's daemon) and carries ``--executor-id N`` on its command line; a JVM
    without it is the driver (local mode). "unknown" where /proc is not available."""
    global _EXECUTOR_ID
    if _SERVED is not None:
        return _SERVED[1]
    if _EXECUTOR_ID is None:
        _EXECUTOR_ID = executor_process()[1]
    return _EXECUTOR_ID


def executor_process() -> Tuple[Optional[int], str]:
    """(pid of the executor JVM running this Python worker, its executor id); (None, "driver") in
    local mode, (None, "unknown") without /proc."""
    if _SERVED is not None:
        return _SERVED
    pid = os.getppid()
    for _ in range(6):
        try:
            with open(f"/proc/{pid}/cmdline", "rb") as f:
                args = f.read().split(b"\0")
            with open(f"/proc/{pid}/stat", "rb") as f:
                ppid = int(f.read().rsplit(b")", 1)[1].split()[1])
        except (OSError, ValueError, IndexError):
            return None, "unknown"
        if b"--executor-id" in args:
            i = args.index(b"--executor-id")
            return pid, (args[i + 1].decode() if i + 1 < len(args) else "unknown")
        if args and os.path.basename(args[0]) == b"java":
            return None, "driver"
        if ppid <= 1:
            return None, "unknown"
        pid = ppid
    return None, "unknown"
