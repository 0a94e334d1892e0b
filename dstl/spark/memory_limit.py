"""A slot inside the address-space limit Spark gives its Python workers (`spark.executor.pyspark.memory`).

Spark applies `spark.executor.pyspark.memory` to each Python worker as RLIMIT_AS, and every process
the worker starts inherits it: the slot (double-forked from a worker) and the upload service the slot
starts. RLIMIT_AS counts address space reserved, not memory used, and a Python process with pandas
and pyarrow reserves far more than it touches:

* glibc gives each thread that allocates an arena of its own, 64 MiB reserved each (up to 8 per
  core); the slot runs about a dozen threads (the upload client's senders and writers, the watch);
* pyarrow's default pool (mimalloc) reserves 1 GiB at its first allocation;
* each thread's stack reserves 8 MiB (the default of glibc, from RLIMIT_STACK).

Measured under a 1 GiB limit (docs/spark.md, "Memory"), the slot reached the limit in its first
batch and failed with `can't start new thread`, `ArrowMemoryError` or a plain `MemoryError`. With
the limit set, a slot therefore starts with two arenas, the system allocator behind pyarrow, one
BLAS thread and 2 MiB thread stacks (`bounded_env`, `bound_process`), and after each task checks
its address space against the limit (`check_after_task`): once a batch took it within `headroom`
of the limit, the task fails with `SlotMemoryError`, which names the state's size, the limit and
the setting to raise, before the next batch gets the process killed. Nothing is lost: the batch's
checkpoint is never completed, and a restart with a larger limit resumes from the last one.
"""
from __future__ import annotations

import os
import resource
import threading
from typing import Any, Dict, Iterable, Optional

#: what a slot under an address-space limit starts with (a value the user set wins)
BOUNDED_ENV: Dict[str, str] = {
    "MALLOC_ARENA_MAX": "2",
    "ARROW_DEFAULT_MEMORY_POOL": "system",
    "OPENBLAS_NUM_THREADS": "1",
    "OMP_NUM_THREADS": "1",
    "MKL_NUM_THREADS": "1",
}
#: the stack of each thread the slot starts (its main thread keeps RLIMIT_STACK's); the slot's
#: threads move bytes between sockets, files and queues, and run no user code
THREAD_STACK = 2 << 20
#: the switch of the after-task check (`off` skips it; the limit itself stays)
ENV_CHECK = "DSTL_SPARK_MEMORY_CHECK"
#: the setting that sets the limit, named in the error
SETTING = "spark.executor.pyspark.memory"

_MiB = 1 << 20


class SlotMemoryError(RuntimeError):
    """A subtask's state is about to outgrow the memory limit of its slot process. The batch
    failed and its checkpoint was not taken: raise the setting the message names and restart, and
    the job resumes from its last checkpoint."""


def address_space_limit() -> Optional[int]:
    """This process's RLIMIT_AS in bytes (the soft limit), None when unlimited."""
    soft, _ = resource.getrlimit(resource.RLIMIT_AS)
    return None if soft == resource.RLIM_INFINITY else int(soft)


def bounded_env(env: Dict[str, str], limit: Optional[int]) -> Dict[str, str]:
    """`env` for a process started under the address-space limit `limit` (unchanged when None)."""
    if limit is None:
        return env
    out = dict(env)
    for k, v in BOUNDED_ENV.items():
        out.setdefault(k, v)
    return out


def bound_process() -> Optional[int]:
    """In a process that starts under a limit: smaller stacks for the threads it starts from now
    on, and glibc's arena cap in case the process started without `bounded_env` (the variable is
    read only at start-up). Returns the limit."""
    limit = address_space_limit()
    if limit is None:
        return None
    threading.stack_size(THREAD_STACK)
    try:
        import ctypes

        libc = ctypes.CDLL(None)
        m_arena_max = -8  # glibc's malloc.h
        libc.mallopt(m_arena_max, int(os.environ.get("MALLOC_ARENA_MAX", BOUNDED_ENV["MALLOC_ARENA_MAX"])))
    except (OSError, AttributeError, ValueError):
        pass  # not glibc: its allocator has no per-thread arenas to cap
    return limit


def address_space() -> Dict[str, int]:
    """This process's VmSize, VmPeak and VmRSS in bytes (Linux /proc; empty elsewhere)."""
    out: Dict[str, int] = {}
    try:
        with open("/proc/self/status") as f:
            for line in f:
                k, _, v = line.partition(":")
                if k in ("VmSize", "VmPeak", "VmRSS"):
                    out[k] = int(v.split()[0]) * 1024
    except OSError:
        pass
    return out


def headroom(limit: int) -> int:
    """How close to `limit` a task may take the address space: an eighth, at least 64 MiB (a
    batch like the last one, a little larger, must still fit)."""
    return max(64 * _MiB, limit // 8)


def state_entries(backends: Iterable[Any]) -> Dict[str, int]:
    """Entries per state name over the keyed backends `backends` (their heap tables)."""
    out: Dict[str, int] = {}
    for backend in backends:
        for states in getattr(backend, "_table", {}).values():
            for name, entries in states.items():
                out[name] = out.get(name, 0) + len(entries)
    return out


def describe_state(entries: Dict[str, int], state_bytes: Optional[int]) -> str:
    if not entries:
        text = "no keyed state yet"
    else:
        top = sorted(entries.items(), key=lambda kv: -kv[1])
        text = f"{max(entries.values()):,} keys (" + ", ".join(f"{n!r}: {c:,}" for n, c in top[:4]) + \
            (", ..." if len(top) > 4 else "") + ")"
    if state_bytes:
        text += f", {state_bytes / _MiB:,.1f} MiB in its checkpoint's changelog"
    return text


def fix_hint(limit: int) -> str:
    return (f"raise {SETTING} (now {limit / _MiB:,.0f} MiB) and spark.executor.memoryOverhead by as much, "
            f"or spread the keys over more subtasks (parallelism), and restart: the job resumes from its "
            f"last checkpoint")


def check_after_task(subtask: int, limit: Optional[int], entries: Dict[str, int],
                     state_bytes: Optional[int] = None) -> None:
    """Raise `SlotMemoryError` once the slot's address space came within `headroom` of `limit`
    (`entries`: the state's entries per state name, from `state_entries`)."""
    if limit is None or os.environ.get(ENV_CHECK, "").strip().lower() in ("off", "0", "false", "no"):
        return
    vm = address_space()
    peak = max(vm.get("VmPeak", 0), vm.get("VmSize", 0))
    if peak <= limit - headroom(limit):
        return
    raise SlotMemoryError(
        f"subtask {subtask}'s state outgrows its slot's memory limit: it holds "
        f"{describe_state(entries, state_bytes)}, and the slot process reached "
        f"{peak / _MiB:,.0f} MiB of address space (resident {vm.get('VmRSS', 0) / _MiB:,.0f} MiB), within "
        f"{headroom(limit) / _MiB:,.0f} MiB of its {limit / _MiB:,.0f} MiB limit ({SETTING}); the batch "
        f"failed before a larger one would get the process killed; {fix_hint(limit)}")


def out_of_memory(subtask: int, limit: Optional[int], exc: BaseException,
                  entries: Dict[str, int]) -> Optional[SlotMemoryError]:
    """The `SlotMemoryError` for `exc` when it is the limit's doing (a failed allocation or thread
    start under an address-space limit), else None (`entries`: the state before the task)."""
    if limit is None:
        return None
    starved = isinstance(exc, MemoryError) or (
        isinstance(exc, RuntimeError) and "can't start new thread" in str(exc))
    if not starved:
        return None
    vm = address_space()
    return SlotMemoryError(
        f"subtask {subtask}'s slot ran out of its memory limit during the task ({type(exc).__name__}: "
        f"{str(exc)[:200] or 'no message'}): its state holds {describe_state(entries, None)} "
        f"before the batch, the slot process reached {vm.get('VmPeak', 0) / _MiB:,.0f} MiB of address space "
        f"of its {limit / _MiB:,.0f} MiB limit ({SETTING}); {fix_hint(limit)}")
