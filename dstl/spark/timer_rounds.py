"""Timer rounds: what Spark's no-data batches do for a `StatefulStream` on an idle stream.

`foreachBatch` is called only for micro-batches with data, so a quiet stream would never fire its
processing-time timers, expire its TTL state or fire the event-time timers its last watermark
passed. Spark's own operator asks for a batch without data then
(`TransformWithStateExec.shouldRunAnotherBatch`): always in ProcessingTime mode, and in EventTime
mode when the watermark moved past the one the last batch evicted with.

With ``timer_interval`` set, a `StatefulStream` in a streaming query runs a driver thread that,
every interval after the last batch or round, runs one *timer round* when Spark would run a
no-data batch: an empty input through the one batch loop (dstl.spark.batch.run_batch), a dstl
checkpoint of its own whose output is committed and handed to the sink exactly like a batch's.

Numbering. dstl's batch number (the ``batch_id=N`` output folder, the sink's ``batch_id``, the sink
marker) is one sequence over Spark's batches and the rounds: it equals Spark's batch id until the
first round, then runs ahead by the number of rounds. Every checkpoint records the last Spark batch
id it has seen (``last_spark_batch_id``) and that batch's dstl number (``last_spark_batch``), so
the replay and gap checks stay on Spark's ids, and a replayed batch (a restarted query) finishes
the output and sink calls of its own batch and of every round after it.

A round and a Spark batch of the same stream never run at once (one lock); the thread stops when
the stream is closed or the queries it ran under have stopped.
"""
from __future__ import annotations

import logging
import threading
import time
from typing import Any, Callable, Dict, Iterable, List, Optional, Set

log = logging.getLogger(__name__)

__all__ = ["TimerRounds", "spark_position", "round_due"]

#: a checkpoint's ``source`` when a timer round made it
ROUND_SOURCE = "timers"


def spark_position(props: Optional[Dict[str, Any]]) -> "tuple[int, int]":
    """(last Spark batch id, its dstl batch number) after the checkpoint with `props`; (-1, -1)
    before the first. Checkpoints written before timer rounds existed number both alike."""
    if not props:
        return -1, -1
    batch = int(props["batch"])
    spark_id = props.get("last_spark_batch_id")
    if spark_id is None:
        return batch, batch
    return int(spark_id), int(props.get("last_spark_batch", batch))


def round_due(time_mode: str, props: Optional[Dict[str, Any]]) -> bool:
    """Would Spark's operator run a no-data batch after the checkpoint with `props`?

    ProcessingTime: always (timers and TTL are checked against the clock). EventTime: when the
    watermark the next batch evicts with is past the one this checkpoint's batch evicted with.
    None: never (no timers)."""
    if not props:
        return False
    if time_mode == "ProcessingTime":
        return True
    if time_mode == "EventTime":
        return int(props.get("watermark_ms", 0) or 0) > int(props.get("batch_watermark_ms", 0) or 0)
    return False


class TimerRounds:
    """The driver thread that runs a stream's timer rounds (see the module docstring).

    `run_round()`: run one round now (the caller holds `lock`); `due()`: whether one is due;
    `queries()`: the ids of the streaming queries now active."""

    def __init__(self, interval_s: float, run_round: Callable[[], Any], due: Callable[[], bool],
                 queries: Callable[[], Set[str]], name: str = "dstl-timer-rounds"):
        if interval_s <= 0:
            raise ValueError(f"timer interval must be > 0 seconds, got {interval_s}")
        self.interval_s = float(interval_s)
        self.lock = threading.RLock()
        self._run_round = run_round
        self._due = due
        self._queries = queries
        self._watched: Set[str] = set()
        self._stop = threading.Event()
        self._last = time.monotonic()
        self._thread: Optional[threading.Thread] = None
        self._name = name
        #: rounds run and the error that stopped the thread, if one did
        self.rounds = 0
        self.error: Optional[BaseException] = None

    def batch_done(self) -> None:
        """A Spark batch just finished: the next round is one interval from now."""
        self._last = time.monotonic()

    def watch(self, query_ids: Iterable[str]) -> None:
        """Start the thread (once) and keep it running while one of these queries is active."""
        self._watched.update(query_ids)
        if self._thread is None and not self._stop.is_set():
            self._thread = threading.Thread(target=self._loop, name=self._name, daemon=True)
            self._thread.start()

    def stop(self, timeout: Optional[float] = None) -> None:
        """Stop the thread and wait for a round under way to finish."""
        self._stop.set()
        t = self._thread
        if t is not None and t is not threading.current_thread():
            t.join(timeout)

    @property
    def running(self) -> bool:
        return self._thread is not None and self._thread.is_alive()

    def _loop(self) -> None:
        while not self._stop.wait(max(0.0, self._last + self.interval_s - time.monotonic())):
            if time.monotonic() < self._last + self.interval_s:
                continue  # a batch finished while we waited
            if self._watched and not (self._watched & self._queries()):
                log.info("timer rounds stop: the streaming query has stopped")
                return
            with self.lock:
                if self._stop.is_set():
                    return
                try:
                    if self._due():
                        self._run_round()
                        self.rounds += 1
                except BaseException as exc:  # noqa: BLE001 - kept for the next batch to raise
                    log.error("timer round failed; rounds stop until the next batch: %s", exc)
                    self.error = exc
                    self._thread = None
                    return
                self._last = time.monotonic()


def active_query_ids(spark) -> Set[str]:
    """The ids of the streaming queries active in `spark` (empty if it cannot tell)."""
    try:
        return {str(q.id) for q in spark.streams.active}
    except Exception:  # noqa: BLE001 - a stopped session: no query runs
        return set()


def pending_batches(first: int, last: int, done: Callable[[int], bool]) -> List[int]:
    """The dstl batches first..last whose sink has not returned yet."""
    return [b for b in range(first, last + 1) if not done(b)]
