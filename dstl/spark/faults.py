"""The one fault-injection hook for tests and demos (crash a driver or a task at a named moment).

Code calls ``faults.point(name, batch)`` at the moments a test may want to break; nothing happens
unless a fault is armed for that point and batch. Arm faults either

* in the environment, ``DSTL_FAULTS="<point>@<batch>[/<subtask>]=<action>[,...]"`` (Spark forwards
  ``DSTL_*`` variables to its Python workers, so task-side points work too), or
* in-process, ``with faults.armed("stream.after_checkpoint@2=raise"): ...`` (same syntax).

Actions: ``kill`` (SIGKILL this process: a real crash, no cleanup), ``kill-executor`` (in a
Python worker: SIGKILL the executor JVM that runs it, i.e. a lost executor; in local mode, where the
JVM is the driver, only this process), ``raise`` (raise `InjectedFault`), ``stall`` (sleep
``$DSTL_FAULTS_STALL_S`` seconds, default 20, then go on: a task that is surely running while a
test kills its host). An action may end with ``:once=<path>``: it fires only if that marker file does
not exist yet and creates it (a retried Spark task then succeeds).

Points, in the order a batch passes them (what a kill there leaves, and what the restart does:
docs/semantics.md §15):

==================================  ==========================================================
``stream.before_tasks``             StatefulStream: batch planned, no task started, nothing written
``task.worker_wait``                the Python worker of a task, after it handed the rows to the slot
                                    process, while the slot runs the task
``task.mid_batch``                  a stateful task, after applying half of its rows (``--fail-at``); in the
                                    subtask's slot process (dstl.spark.slot_process) when slots are on, else
                                    in the Python worker: ``kill`` there kills the warm state's holder
``stream.after_tasks``              StatefulStream: task reports collected (output staged, changelog
                                    uploaded), no checkpoint
``stream.after_checkpoint``         StatefulStream: checkpoint durable, output not committed, sink not called
``pipeline.after_metadata``         the demo pipeline's ``--kill-at``: checkpoint durable, output not committed
``coordinator.mid_commit``          after each staged output file is put in place, before the
                                    next one and ``_SUCCESS`` (also in the commit a restart finishes)
``coordinator.mid_gc_checkpoints``  after an old checkpoint is deleted, before the changelog files
``coordinator.mid_gc_files``        after an unreferenced changelog file is deleted, before the next
                                    (also in the final pass of ``finish()``/``close()``)
``stream.mid_sink``                 the user's sink returned (or there is none), its marker not
                                    written: for the restart, the same as a kill inside the sink
``stream.after_sink``               StatefulStream: sink called, foreachBatch not yet returned to Spark
``timers.before_tasks``             a timer round (dstl.spark.timer_rounds) passes the stream's steps
``timers.after_tasks``              under these names: ``timers.before_tasks``, ``timers.after_tasks``,
``timers.after_checkpoint``         ``timers.after_checkpoint``, ``timers.mid_sink``,
``timers.mid_sink``                 ``timers.after_sink`` (its batch: the round's dstl batch number)
``timers.after_sink``
``rescale.mid_write``               ``dstl state rescale``: new subtask N's state uploaded (``@*/N``),
                                    no new checkpoint; no batch (match with ``@*``)
``rescale.after_checkpoint``        ``dstl state rescale``: new checkpoint durable, job file not updated
==================================  ==========================================================

The coordinator's points get the batch of the checkpoint being completed; the rescale's get none.
"""
from __future__ import annotations

import contextlib
import os
import signal
import time
from dataclasses import dataclass
from typing import Callable, Dict, Iterator, List, Optional

from dstl.changelog.fs import filesystem
from dstl.spark.session import executor_process

ENV = "DSTL_FAULTS"
ACTIONS = ("kill", "kill-executor", "raise", "stall")

__all__ = ["InjectedFault", "point", "armed", "parse", "ENV"]


class InjectedFault(RuntimeError):
    """The failure a test asked for through DSTL_FAULTS / faults.armed."""


@dataclass(frozen=True)
class Fault:
    point: str
    batch: Optional[int]  # None: every batch
    action: str
    once: Optional[str] = None
    subtask: Optional[int] = None  # None: any subtask (task-side points)


def parse(spec: str) -> List[Fault]:
    """Faults from ``"<point>@<batch>=<action>[:once=<path>],..."`` (``@*`` or no ``@``: any batch)."""
    faults: List[Fault] = []
    for item in filter(None, (p.strip() for p in (spec or "").split(","))):
        where, sep, action = item.partition("=")
        if not sep:
            raise ValueError(f"{ENV}: {item!r} has no '=<action>' ({', '.join(ACTIONS)})")
        once = None
        if ":once=" in action:
            action, once = action.split(":once=", 1)
        if action not in ACTIONS:
            raise ValueError(f"{ENV}: unknown action {action!r} in {item!r} ({', '.join(ACTIONS)})")
        name, _, batch = where.partition("@")
        batch, _, subtask = batch.partition("/")
        try:
            b = None if batch in ("", "*") else int(batch)
            s = None if subtask in ("", "*") else int(subtask)
        except ValueError:
            raise ValueError(f"{ENV}: batch/subtask in {item!r} must be ints") from None
        faults.append(Fault(name.strip(), b, action, once, s))
    return faults


_ARMED: List[Fault] = []


@contextlib.contextmanager
def armed(spec: str) -> Iterator[None]:
    """Arm faults in this process for the duration of the block."""
    faults = parse(spec)
    _ARMED.extend(faults)
    try:
        yield
    finally:
        for f in faults:
            _ARMED.remove(f)


def _env_faults() -> List[Fault]:
    spec = os.environ.get(ENV, "")
    return parse(spec) if spec else []


def point(name: str, batch: Optional[int] = None, *, subtask: Optional[int] = None,
          before: Optional[Callable[[], None]] = None, detail: str = "") -> None:
    """A named moment: fire the fault armed for it, if any (calling `before()` first: e.g. apply
    half a batch, or print what is about to happen)."""
    if not _ARMED and ENV not in os.environ:
        return
    for f in _ARMED + _env_faults():
        if f.point != name or (f.batch is not None and f.batch != batch) \
                or (f.subtask is not None and f.subtask != subtask):
            continue
        if f.once is not None and not _claim(f.once):
            continue
        if f.action == "stall":  # nothing changes: `before` is for the moment of a crash
            time.sleep(float(os.environ.get("DSTL_FAULTS_STALL_S", "20")))
            continue
        if before is not None:
            before()
        where = f"batch {batch}" + (f", subtask {subtask}" if subtask is not None else "")
        msg = f"injected fault at {name} ({where}){': ' + detail if detail else ''}"
        if f.action == "kill-executor":
            _kill_executor()
        if f.action in ("kill", "kill-executor"):
            os.kill(os.getpid(), signal.SIGKILL)
        raise InjectedFault(msg)


def _kill_executor() -> None:
    """SIGKILL the executor JVM among this process's ancestors (none in local mode)."""
    pid = executor_process()[0]
    if pid is not None:
        os.kill(pid, signal.SIGKILL)


def _claim(marker: str) -> bool:
    """Create `marker` (any fsspec URL); False if it already existed."""
    fs, path = filesystem(marker)
    if fs.exists(path):
        return False
    parent = path.rsplit("/", 1)[0]
    if parent:
        fs.makedirs(parent, exist_ok=True)
    with fs.open(path, "wb") as f:
        f.write(b"fired\n")
    return True


def active() -> Dict[str, List[Fault]]:
    """What is armed now, by point (diagnostics)."""
    out: Dict[str, List[Fault]] = {}
    for f in _ARMED + _env_faults():
        out.setdefault(f.point, []).append(f)
    return out
