"""A batch's progress record, shaped like Spark's `StreamingQueryProgress` with one entry in
`stateOperators` shaped like Spark's `StateOperatorProgress`, and where users read it.

A `foreachBatch` query has no stateful operator of Spark's, so Spark's own `query.lastProgress`
lists none; nothing a library does inside `foreachBatch` can add one there (Spark builds the
progress with private constructors). dstl keeps its own record per batch instead:

* `stream.lastProgress` / `stream.recentProgress` (the last 100, as Spark keeps);
* `stream.add_listener(fn)`: `fn(record)` after every committed batch, in the process that ran it;
* `progress_of(query, stream)`: Spark's `query.lastProgress` with dstl's entry appended to its
  `stateOperators`, matched by batch id (from the checkpoint metadata when the batch ran elsewhere,
  e.g. in Spark Connect's server);
* the checkpoint's properties (``progress``), which `dstl state ls` shows batch by batch;
* one JSON line per batch at DEBUG on the logger ``dstl.spark.progress``.

Field meanings follow Spark's transformWithState operator where dstl has the figure; figures dstl
does not measure are -1 (as Spark's `numRowsTotal` when row tracking is off).
"""
from __future__ import annotations

import collections
import datetime as dt
import json
import logging
import threading
from typing import Any, Callable, Deque, Dict, List, Optional, Sequence

from dstl.spark import task_figures as F

log = logging.getLogger(__name__)

#: the entry's operatorName: distinct from Spark's own ("transformWithStateInPandasExec", ...)
OPERATOR_NAME = "dstlStatefulStream"
#: records kept in memory (Spark's spark.sql.streaming.numRecentProgressUpdates default)
RECENT = 100

Listener = Callable[[Dict[str, Any]], None]

__all__ = ["OPERATOR_NAME", "ProgressLog", "ProgressHooks", "checkpoint_figures", "state_operator", "batch_progress",
           "progress_of"]


def _sum(reports: Sequence[Any], name: str) -> int:
    return int(sum(r.metric(name) for r in reports))


def _max(reports: Sequence[Any], name: str) -> int:
    return int(max((r.metric(name) for r in reports), default=0))


def checkpoint_figures(reports: Sequence[Any]) -> Dict[str, int]:
    """The figures the task reports give, summed over subtasks (kept in the checkpoint's
    properties under ``progress``; longs only, as Spark's customMetrics)."""
    rows = [r.metric(F.ROWS_TOTAL, None) for r in reports]
    return {
        "numRowsTotal": -1 if any(v is None for v in rows) else int(sum(rows)),
        "allUpdatesTimeMs": int(round(sum(r.process_ms for r in reports))),
        "commitTimeMs": int(round(sum(r.snapshot_ms for r in reports))),
        "numRowsDroppedByWatermark": _sum(reports, "late_rows"),
        "numStateStoreInstances": len(reports),
        "numExpiredTimers": _sum(reports, "timers_fired"),
        "dstlRowsIn": int(sum(r.rows_in for r in reports)),
        "dstlRowsOut": int(sum(r.rows_out for r in reports)),
        "dstlStateSizeBytes": int(sum(r.state_size for r in reports)),
        "dstlSubtasksWarm": sum(1 for r in reports if r.continued),
        "dstlSubtasksRestored": sum(1 for r in reports if r.restored),
        "dstlRestoreLatencyMsMax": int(round(max((r.restore_ms for r in reports if r.restored), default=0.0))),
        F.UPLOAD_REQUESTS: _sum(reports, F.UPLOAD_REQUESTS),
        F.UPLOAD_FAILURES: _sum(reports, F.UPLOAD_FAILURES),
        F.UPLOAD_BYTES: _sum(reports, F.UPLOAD_BYTES),
        F.UPLOAD_LATENCY_MAX: _max(reports, F.UPLOAD_LATENCY_MAX),
        F.ATTEMPTS_MAX: _max(reports, F.ATTEMPTS_MAX),
    }


#: checkpoint_figures' keys that are fields of Spark's StateOperatorProgress; the rest are custom
_FIELDS = ("numRowsTotal", "allUpdatesTimeMs", "commitTimeMs", "numRowsDroppedByWatermark",
           "numStateStoreInstances")


def state_operator(figures: Dict[str, int], parallelism: int, stats: Any = None) -> Dict[str, Any]:
    """A `StateOperatorProgress`-shaped dict from `checkpoint_figures` and the checkpoint's stats
    (`CheckpointStats`: the driver's commit, the new files, the placement; None: not known)."""
    custom = {k: int(v) for k, v in figures.items() if k not in _FIELDS}
    commit_ms = figures.get("commitTimeMs", 0)
    if stats is not None:
        placement = getattr(stats, "placement", None) or {}
        custom.update(dstlSubtasksMoved=int(placement.get("moved", 0)),
                      dstlMetadataTimeMs=int(round(stats.metadata_ms)), dstlCommitTimeMs=int(round(stats.commit_ms)),
                      dstlNewFiles=int(stats.new_files), dstlNewBytes=int(stats.new_bytes),
                      dstlDeletedFiles=int(stats.deleted_files))
        commit_ms += int(round(stats.metadata_ms + stats.commit_ms))
    return {
        "operatorName": OPERATOR_NAME,
        "numRowsTotal": int(figures.get("numRowsTotal", -1)),
        # not counted by dstl's state yet: -1, as Spark's figures it does not track
        "numRowsUpdated": -1,
        "numRowsRemoved": -1,
        "allUpdatesTimeMs": int(figures.get("allUpdatesTimeMs", 0)),
        # TTL expiry runs inside the updates and the materialization: 0, as PySpark's operator
        "allRemovalsTimeMs": 0,
        "commitTimeMs": int(commit_ms),
        # the state lives in Python dicts dstl does not size per batch
        "memoryUsedBytes": -1,
        "numRowsDroppedByWatermark": int(figures.get("numRowsDroppedByWatermark", 0)),
        "numShufflePartitions": int(parallelism),
        "numStateStoreInstances": int(figures.get("numStateStoreInstances", 0)),
        "customMetrics": custom,
    }


def batch_progress(res: Any, parallelism: int, *, query_id: Optional[str] = None,
                   run_id: Optional[str] = None, name: Optional[str] = None) -> Dict[str, Any]:
    """The record of one batch (a `StreamBatchResult` or a job's `BatchResult`): Spark's
    `StreamingQueryProgress` keys that dstl knows, and dstl's entry in `stateOperators`."""
    batch_id = getattr(res, "batch_id", res.batch)
    ts = getattr(res, "batch_timestamp_ms", 0) or None
    stamp = dt.datetime.fromtimestamp(ts / 1000 if ts else dt.datetime.now().timestamp(), dt.timezone.utc)
    figures = checkpoint_figures(res.reports)
    phases = getattr(res, "phases_ms", {}) or {}
    return {
        "id": query_id, "runId": run_id, "name": name,
        "timestamp": stamp.strftime("%Y-%m-%dT%H:%M:%S.") + f"{stamp.microsecond // 1000:03d}Z",
        "batchId": int(batch_id), "checkpointId": int(res.checkpoint_id),
        "numInputRows": int(res.rows_in),
        "durationMs": {"dstlBatch": int(round(res.seconds * 1e3)),
                       **{f"dstl{k.capitalize()}": int(round(v)) for k, v in phases.items()}},
        "eventTime": {"watermark": _iso(getattr(res, "watermark_ms", 0))} if getattr(res, "watermark_ms", 0) else {},
        "stateOperators": [state_operator(figures, parallelism, res.stats)],
        "replayed": bool(getattr(res, "replayed", False)),
    }


def _iso(ms: int) -> str:
    stamp = dt.datetime.fromtimestamp(ms / 1000, dt.timezone.utc)
    return stamp.strftime("%Y-%m-%dT%H:%M:%S.") + f"{stamp.microsecond // 1000:03d}Z"


class ProgressLog:
    """The latest records and the listeners told of each (thread-safe: Spark's listener bus and
    the query's thread may read while a batch publishes)."""

    def __init__(self, maxlen: int = RECENT):
        self._records: Deque[Dict[str, Any]] = collections.deque(maxlen=maxlen)
        self._listeners: List[Listener] = []
        self._lock = threading.Lock()

    def __getstate__(self) -> Dict[str, Any]:
        # shipped with its stream (Spark Connect's foreachBatch): records and listeners stay here
        return {"maxlen": self._records.maxlen}

    def __setstate__(self, state: Dict[str, Any]) -> None:
        self.__init__(state.get("maxlen") or RECENT)

    def add_listener(self, fn: Listener) -> None:
        if not callable(fn):
            raise TypeError(f"a progress listener must be a function fn(record), got {type(fn).__name__}")
        with self._lock:
            self._listeners.append(fn)

    def remove_listener(self, fn: Listener) -> None:
        with self._lock:
            self._listeners = [f for f in self._listeners if f is not fn]

    def publish(self, record: Dict[str, Any]) -> None:
        """Keep `record` and tell the listeners. The batch is committed by now: a listener that
        raises is logged, never failing the batch."""
        with self._lock:
            self._records.append(record)
            listeners = list(self._listeners)
        if log.isEnabledFor(logging.DEBUG):
            log.debug("%s", json.dumps(record, sort_keys=True))
        for fn in listeners:
            try:
                fn(record)
            except Exception:  # noqa: BLE001 - the batch is committed; its output must not be redone
                log.exception("progress listener %r failed for batch %s", fn, record.get("batchId"))

    @property
    def last(self) -> Optional[Dict[str, Any]]:
        with self._lock:
            return self._records[-1] if self._records else None

    @property
    def recent(self) -> List[Dict[str, Any]]:
        with self._lock:
            return list(self._records)

    def find(self, batch_id: int) -> Optional[Dict[str, Any]]:
        with self._lock:
            for record in reversed(self._records):
                if record["batchId"] == batch_id and not record.get("replayed"):
                    return record
        return None


class ProgressHooks:
    """What a front door with a `progress` log offers: Spark's names for its records, and listeners."""

    progress: ProgressLog

    @property
    def lastProgress(self) -> Optional[Dict[str, Any]]:  # noqa: N802 - Spark's name
        """The latest batch's progress record, shaped like Spark's (None before the first batch)."""
        return self.progress.last

    @property
    def recentProgress(self) -> List[Dict[str, Any]]:  # noqa: N802 - Spark's name
        """The latest batches' progress records, oldest first (at most 100)."""
        return self.progress.recent

    def add_listener(self, fn: Listener) -> None:
        """Call `fn(record)` after every committed batch, in the process that ran it."""
        self.progress.add_listener(fn)

    def remove_listener(self, fn: Listener) -> None:
        """Stop calling `fn`."""
        self.progress.remove_listener(fn)


def _from_checkpoints(stream: Any, batch_id: int) -> Optional[Dict[str, Any]]:
    """dstl's entry for `batch_id` from the checkpoint metadata (the batch ran in another process)."""
    from dstl.state.metadata import list_checkpoints, read_checkpoint

    for cid in sorted(list_checkpoints(stream.base_path), reverse=True)[:RECENT]:
        props = read_checkpoint(stream.base_path, cid).properties
        if props.get("spark_batch_id") == batch_id and "progress" in props:
            placement = props.get("placement") or {}
            op = state_operator(props["progress"], stream.parallelism)
            op["customMetrics"]["dstlSubtasksMoved"] = int(placement.get("moved", 0))
            return op
        if isinstance(props.get("spark_batch_id"), int) and props["spark_batch_id"] < batch_id:
            break
    return None


def merged(spark_progress: Any, stream: Any) -> Optional[Dict[str, Any]]:
    """One of Spark's progress dicts with dstl's entry for its batch appended to `stateOperators`."""
    if spark_progress is None:
        return None
    merged_ = dict(spark_progress)
    batch_id = int(merged_.get("batchId", -1))
    record = stream.progress.find(batch_id)
    entry = record["stateOperators"][0] if record is not None else _from_checkpoints(stream, batch_id)
    operators = [dict(op) for op in merged_.get("stateOperators") or []]
    if entry is not None:
        operators.append(entry)
    merged_["stateOperators"] = operators
    return merged_


def progress_of(query: Any, stream: Any) -> Optional[Dict[str, Any]]:
    """Spark's `query.lastProgress` with dstl's `StateOperatorProgress`-shaped entry for that batch
    appended to its `stateOperators` (None before the query's first progress). A dashboard that
    reads ``progress["stateOperators"][0]["numRowsTotal"]`` keeps working after migrating."""
    return merged(query.lastProgress, stream)


def query_ids(spark: Any) -> Dict[str, Optional[str]]:
    """Spark's query id and run id of the running micro-batch (classic mode: the local properties
    Spark sets on the foreachBatch thread; None outside a streaming query or under Connect)."""
    try:
        sc = spark.sparkContext
        return {"query_id": sc.getLocalProperty("sql.streaming.queryId"),
                "run_id": sc.getLocalProperty("spark.jobGroup.id")}
    except Exception:  # noqa: BLE001 - Spark Connect has no SparkContext on the client
        return {"query_id": None, "run_id": None}
