"""The cyclic garbage collector in a process that holds keyed state across tasks (a slot, or a
Python worker with slots off).

A subtask's state is millions of GC-tracked objects (a list or dict per key) that live for the
whole stream. CPython's full collections walk all of them, and a batch that allocates as many
objects as it updates keys sets one off about every batch: the state's cost per event grows with
the keys the process holds. So after every task the surviving objects are frozen (`gc.freeze`,
moved to the permanent generation no collection walks); refcounting still frees a replaced or
cleared value at once, and the young collections still find the cycles a task makes.

What freezing gives up, and how it is bounded:

* a frozen object that later becomes cyclic garbage is not collected while frozen. Once the
  process holds `REGROW` more small objects than after the last full collection
  (`sys.getallocatedblocks`, which costs next to nothing, where counting the frozen objects walks
  them all), everything is unfrozen and collected once, as CPython itself collects in full once
  the long-lived objects grew by a quarter: such garbage stays below that fraction of the heap.
  A stream that only updates its keys does not grow, and never pays for a full collection again;
* CPython counts a task's survivors against the *unfrozen* old objects only, which freezing leaves
  few, so during the next task it would collect the oldest generation every few tens of
  thousands of objects, each time walking all the task's survivors so far (about a second a batch
  of 750k updated keys). The third threshold is raised with the frozen count instead, so that
  happens once a task allocated about `GEN2_EVERY` times the frozen objects: cyclic garbage that
  outlives the young collections may grow that much within one task, and its end (the young
  collections, then the `REGROW` check) brings it back under the bound above.

Freezing is about the whole process, so it is done only in a process that runs tasks and nothing
else: a slot (which says so at start) or a PySpark Python worker while it runs a task (slots off).
`run_subtask` called in any other process (a test, a user's own program) leaves its heap alone.
`DSTL_SPARK_GC_FREEZE=off` leaves the collector as CPython configures it everywhere.
"""
from __future__ import annotations

import gc
import math
import os
import sys
import threading
from typing import Dict, Optional

ENV_SWITCH = "DSTL_SPARK_GC_FREEZE"
#: the growth of the heap (pymalloc's blocks, a fraction of the count after the last full collection)
#: that brings a full collection of everything, frozen objects included
REGROW = 0.25
#: during a task, the oldest (unfrozen) generation is collected about every time the task allocated
#: this many times the frozen objects (measured: 0.25 still collected it 3 times a batch of 750k
#: keys at 2M held, about a second of CPU; 1.0 not at all)
GEN2_EVERY = 1.0

_lock = threading.Lock()
#: after the last full collection: pymalloc's blocks (lowered as the heap shrinks) and the frozen
#: objects; the third threshold as it was before the first task raised it (None: not yet)
_state: Dict[str, Optional[int]] = {"blocks": None, "frozen": None, "threshold2": None, "owner": None}
#: what after_task did, for tests and the benchmark: tasks, full collections, objects freed
stats: Dict[str, int] = {"tasks": 0, "full": 0, "collected": 0}


def enabled() -> bool:
    return os.environ.get(ENV_SWITCH, "").strip().lower() not in ("off", "0", "false", "no")


def own_process() -> None:
    """This process only runs tasks (a slot): after_task may freeze its heap."""
    _state["owner"] = os.getpid()


def _owns_process() -> bool:
    if _state["owner"] == os.getpid():
        return True
    tc = sys.modules.get("pyspark.taskcontext")
    return tc is not None and tc.TaskContext.get() is not None


def after_task() -> None:
    """Collect the young generations and freeze the rest; once the heap grew by `REGROW`, collect
    everything instead. A no-op when switched off or while the collector is disabled (whoever
    disabled it decides about collections then)."""
    if not enabled() or not gc.isenabled() or not _owns_process():
        return
    with _lock:
        blocks = sys.getallocatedblocks()
        floor = _state["blocks"]
        if floor is None or blocks > floor * (1 + REGROW):
            gc.unfreeze()
            stats["collected"] += gc.collect()
            gc.freeze()
            stats["full"] += 1
            _state["frozen"] = gc.get_freeze_count()
            _state["blocks"] = sys.getallocatedblocks()
        else:
            # the task's young cyclic garbage, which freezing would keep until the next full
            # collection; not generation 2: walking the task's survivors once more costs about a
            # microsecond each (they lie all over the heap), as much as freezing saves
            stats["collected"] += gc.collect(1)
            gc.freeze()
            _state["blocks"] = min(floor, blocks)  # a shrinking heap lowers the bar
        stats["tasks"] += 1
        t0, t1, t2 = gc.get_threshold()
        if _state["threshold2"] is None:
            _state["threshold2"] = t2
        if t0 > 0 and t1 > 0:
            # a generation-2 candidate every t0 * t1 * t2 net allocations: GEN2_EVERY of the frozen
            want = max(_state["threshold2"], math.ceil((_state["frozen"] or 0) * GEN2_EVERY / (t0 * t1)))
            gc.set_threshold(t0, t1, want)


def reset() -> None:
    """Unfreeze and give the collector back its threshold (tests; a process done holding state)."""
    with _lock:
        gc.unfreeze()
        if _state["threshold2"] is not None:
            t0, t1, _ = gc.get_threshold()
            gc.set_threshold(t0, t1, _state["threshold2"])
        _state["blocks"] = _state["frozen"] = _state["threshold2"] = _state["owner"] = None
