"""Slots: the process on a host that holds one subtask's live state, whichever worker runs its task.

An executor with c cores runs up to c Python workers, and Spark gives a task to any idle one. State
kept in a worker would be warm only when the subtask lands in that same worker again. So it lives
in a *slot* instead (Flink's task slot): one long-lived process per (job, operator, subtask) on the
host, started by the first worker that runs a task of that subtask. The task's worker sends the
slot its rows over a Unix socket and gets the task report back; the slot runs the task body
(`dstl.spark.task.run_subtask`) with its own state cache (dstl.spark.cache), so a subtask continues
from memory in whichever worker, of whichever executor on the host, Spark runs it.

This module is the worker's side (find or start the slot, send, receive) and the wire format both
sides use; `dstl.spark.slot_process` is the slot process. `DSTL_SPARK_SLOTS=off` runs the task body in
the worker itself (state then stays warm only per worker).

* **Name.** A slot serves one (job, operator, subtask) for one installation (interpreter, dstl,
  implementation) and one forwarded environment (`DSTL_*`, object-store variables): a task whose
  environment differs gets a slot of its own, so nothing a slot decided at start-up (the
  implementation, local recovery, the runtime directory) is ever wrong for the task it runs.
* **One task at a time.** If the worker whose task the slot runs goes away before the reply (a
  killed task, a lost executor), the slot exits at once: its half-updated state is never used
  again, and the retry restores, as it would have after losing the worker itself.
* **Exit.** Idle for `DSTL_SPARK_CACHE_IDLE_S` (600 s), when the pyspark daemon (or executor JVM)
  of the worker it last served is gone, when its socket file is removed, or when a starting slot
  finds more than `DSTL_SPARK_SLOTS_MAX` slots of the user on the host and asks the longest idle
  ones to go.
"""
from __future__ import annotations

import hashlib
import json
import os
import pickle
import socket
import struct
import subprocess
import sys
import time
from typing import Any, Callable, Dict, List, Optional, Tuple

from dstl.runtime_dir import file_lock, pid_alive, runtime_root, socket_root
from dstl.spark.errors import SlotError
from dstl.spark.memory_limit import address_space_limit, bounded_env
from dstl.spark.session import FORWARDED_ENV_PREFIXES, LOCAL_ONLY_ENV

ENV_SWITCH = "DSTL_SPARK_SLOTS"
#: a slot that has not served a task for this long may be asked to exit when too many are alive
EVICTABLE_IDLE_S = 30.0
#: how long a worker waits for a slot it started to listen
START_TIMEOUT_S = float(os.environ.get("DSTL_SPARK_SLOT_START_S", "120"))
#: the directory below the runtime root (the upload service's sweep skips names starting with "_")
DIR_NAME = "_slots"
_LEN = struct.Struct("<Q")
_HEAD = struct.Struct("<QI")


class RemoteTraceback(Exception):
    """The slot's traceback of an exception raised there (chained as the cause of the re-raised one)."""

    def __init__(self, tb: str):
        super().__init__(tb)
        self.tb = tb

    def __str__(self) -> str:
        return f"\n(in the subtask's slot process)\n{self.tb}"


def enabled() -> bool:
    """Slots are on unless `DSTL_SPARK_SLOTS` is off/0/false, on POSIX hosts with Unix sockets."""
    if os.environ.get(ENV_SWITCH, "").strip().lower() in ("off", "0", "false", "no"):
        return False
    return hasattr(socket, "AF_UNIX") and hasattr(os, "fork")


def max_slots() -> int:
    """How many slots of this user a host keeps before it asks idle ones to exit."""
    raw = os.environ.get("DSTL_SPARK_SLOTS_MAX", "").strip()
    if raw:
        return max(1, int(raw))
    return max(16, 4 * (os.cpu_count() or 1))


# ------------------------------------------------------------------ the wire

def _recv_exact(sock: socket.socket, n: int) -> bytearray:
    buf = bytearray(n)
    view = memoryview(buf)
    got = 0
    while got < n:
        k = sock.recv_into(view[got:], min(n - got, 1 << 24))
        if k == 0:
            raise EOFError(f"connection closed after {got} of {n} bytes")
        got += k
    return buf


def dumps(obj: Any, by_value: bool = False) -> Tuple[bytes, List[memoryview]]:
    """`obj` as a pickle (protocol 5) and its large contiguous buffers, sent out of band (a pandas
    DataFrame's numeric blocks travel without a copy into the pickle). `by_value`: cloudpickle,
    for functions and classes defined in a notebook or a test (what Spark itself ships)."""
    bufs: List[memoryview] = []

    def out_of_band(pb: pickle.PickleBuffer) -> bool:
        try:
            m = pb.raw()
        except BufferError:  # not contiguous: into the pickle
            return True
        if m.nbytes < 1 << 16:
            return True
        bufs.append(m)
        return False

    if by_value:
        from pyspark import cloudpickle  # PySpark

        data = cloudpickle.dumps(obj, protocol=5, buffer_callback=out_of_band)
    else:
        data = pickle.dumps(obj, protocol=5, buffer_callback=out_of_band)
    return data, bufs


def send(sock: socket.socket, data: bytes, bufs: List[memoryview]) -> None:
    sock.sendall(_HEAD.pack(len(data), len(bufs)) + b"".join(_LEN.pack(b.nbytes) for b in bufs))
    sock.sendall(data)
    for b in bufs:
        sock.sendall(b)


def send_obj(sock: socket.socket, obj: Any, by_value: bool = False) -> None:
    send(sock, *dumps(obj, by_value))


def recv_obj(sock: socket.socket) -> Any:
    size, n = _HEAD.unpack(_recv_exact(sock, _HEAD.size))
    lens = [_LEN.unpack_from(_recv_exact(sock, _LEN.size))[0] for _ in range(n)]
    data = _recv_exact(sock, size)
    bufs = [_recv_exact(sock, k) for k in lens]
    return pickle.loads(data, buffers=bufs)


# ------------------------------------------------------------------ names and paths

def forwarded_env() -> Dict[str, str]:
    """The part of the environment the driver forwards to workers (dstl.spark.session)."""
    return {k: v for k, v in os.environ.items() if k.startswith(FORWARDED_ENV_PREFIXES) or k in LOCAL_ONLY_ENV}


def slot_name(job_id: str, operator_id: str, subtask: int) -> str:
    """16 hex: the slot of this subtask for this installation and forwarded environment."""
    import dstl  # the package's root is the entry layer, above this one: read here, when called

    env = json.dumps(sorted(forwarded_env().items()))
    ident = json.dumps([os.getuid(), sys.executable, os.path.dirname(os.path.abspath(dstl.__file__)),
                        dstl.IMPLEMENTATION, env, job_id, operator_id, subtask])
    return hashlib.sha256(ident.encode()).hexdigest()[:16]


def slots_dir() -> str:
    """`<runtime root>/_slots`, spelled short enough for its sockets (made 0700)."""
    d = os.path.join(socket_root(runtime_root()), DIR_NAME)
    os.makedirs(d, mode=0o700, exist_ok=True)
    return d


def paths(name: str) -> Dict[str, str]:
    d = slots_dir()
    return {k: os.path.join(d, f"{name}.{k}") for k in ("sock", "lock", "log", "pid")}


# ------------------------------------------------------------------ the worker's side

def _connect(path: str) -> Optional[socket.socket]:
    s = socket.socket(socket.AF_UNIX, socket.SOCK_STREAM)
    try:
        s.connect(path)
        return s
    except (FileNotFoundError, ConnectionRefusedError):
        s.close()
        return None
    except OSError:
        s.close()
        raise


def _spawn(name: str, p: Dict[str, str]) -> int:
    """Start the slot `name` detached from this worker (double fork: the slot is nobody's child, so it
    never lingers as a zombie); returns its pid."""
    boot = ("import json, os, sys; sys.path[:0] = [p for p in json.loads(os.environ.pop('DSTL_SLOT_SYSPATH'))"
            " if p not in sys.path]; from dstl.spark.slot_process import main; main(sys.argv[1:])")
    # under spark.executor.pyspark.memory the slot inherits the worker's address-space limit: it
    # starts with its allocators bounded (dstl.spark.memory_limit), and so does what it starts
    env = bounded_env(dict(os.environ, DSTL_SLOT_SYSPATH=json.dumps([p for p in sys.path if p])),
                      address_space_limit())
    log = open(p["log"], "ab")
    try:
        # a tiny intermediate process starts the slot and exits: the slot is re-parented
        launcher = subprocess.Popen(
            [sys.executable, "-c",
             "import subprocess, sys; p = subprocess.Popen(sys.argv[1:], stdin=subprocess.DEVNULL, "
             "stdout=sys.stderr, stderr=sys.stderr, start_new_session=True); print(p.pid)",
             sys.executable, "-c", boot, name, p["sock"]],
            stdin=subprocess.DEVNULL, stdout=subprocess.PIPE, stderr=log, env=env, close_fds=True)
        out, _ = launcher.communicate(timeout=START_TIMEOUT_S)
    finally:
        log.close()
    try:
        return int(out.decode().strip())
    except ValueError:
        raise SlotError(f"could not start the slot process ({_log_tail(p['log'])})") from None


def _log_tail(path: str, n: int = 2000) -> str:
    try:
        with open(path, "rb") as f:
            f.seek(0, os.SEEK_END)
            f.seek(max(0, f.tell() - n))
            text = f.read().decode(errors="replace").strip()
    except OSError:
        return f"no log at {path}"
    return f"its log {path} ends: {text[-n:]}" if text else f"its log {path} is empty"


#: the lock and log of a slot that died without cleaning up are removed after this long
LEFTOVER_S = 3600.0


def evict_idle(keep: str) -> int:
    """Ask the longest-idle slots to exit while more than `max_slots()` are alive, and remove what
    slots that died long ago left (their lock and log); returns how many slots were asked."""
    d = slots_dir()
    socks = []
    now = time.time()
    names: Dict[str, Dict[str, Any]] = {}
    for entry in os.scandir(d):
        name, _, kind = entry.name.rpartition(".")
        try:
            names.setdefault(name, {})[kind] = entry.stat().st_mtime
        except FileNotFoundError:
            continue
        if kind == "sock" and name != keep:
            socks.append((names[name][kind], entry.path))
    for name, kinds in names.items():
        if name != keep and "sock" not in kinds and now - max(kinds.values()) > LEFTOVER_S:
            for kind in kinds:
                try:
                    os.unlink(os.path.join(d, f"{name}.{kind}"))
                except OSError:
                    pass
    excess = len(socks) + 1 - max_slots()
    asked = 0
    for mtime, path in sorted(socks):
        if asked >= excess or now - mtime < EVICTABLE_IDLE_S:
            break
        s = _connect(path)
        if s is None:  # a dead slot's socket
            try:
                os.unlink(path)
            except OSError:
                pass
            continue
        try:
            s.settimeout(1.0)
            send_obj(s, {"op": "exit", "idle_s": EVICTABLE_IDLE_S})
            asked += 1
        except OSError:
            pass
        finally:
            s.close()
    return asked


def connect(name: str) -> socket.socket:
    """A connection to slot `name`, started first if it does not run (one starter per name)."""
    p = paths(name)
    s = _connect(p["sock"])
    if s is not None:
        return s
    with file_lock(p["lock"], timeout_s=START_TIMEOUT_S):
        s = _connect(p["sock"])  # another worker may have started it meanwhile
        if s is not None:
            return s
        try:
            evict_idle(name)
        except OSError:
            pass
        pid = _spawn(name, p)
        deadline = time.monotonic() + START_TIMEOUT_S
        while time.monotonic() < deadline:
            s = _connect(p["sock"])
            if s is not None:
                return s
            if not pid_alive(pid):
                raise SlotError(f"the slot process {pid} exited before it listened ({_log_tail(p['log'])})")
            time.sleep(0.01)
        raise SlotError(f"the slot process {pid} did not listen on {p['sock']} within {START_TIMEOUT_S:.0f} s "
                        f"({_log_tail(p['log'])}); DSTL_SPARK_SLOT_START_S sets the wait")


def call(name: str, payload: Tuple[bytes, List[memoryview]], executor: Tuple[Optional[int], str],
         subtask: int, sent: Optional[Callable[[], None]] = None, watch: Optional[int] = None) -> Dict[str, Any]:
    """Run one task in slot `name`: the pickled request `payload` in, the task report out (`sent()`
    is called in between). The slot exits once the process `watch` (default: this worker's parent,
    pyspark's daemon or the executor JVM) is gone. The slot's exception is re-raised here, with
    its traceback."""
    prelude = {"op": "run", "sys_path": [p for p in sys.path if p], "cwd": os.getcwd(), "executor": executor,
               "watch": os.getppid() if watch is None else watch}
    for tries in range(1, 4):
        # a slot that exits (idle, or its previous task's worker died) may still accept for a
        # moment: without its acknowledgement the task never reached it, and another slot takes it
        s = connect(name)
        try:
            prelude["sent"] = time.time()  # the hop: from here to the request unpickled in the slot
            send_obj(s, prelude)
            recv_obj(s)
            break
        except (EOFError, ConnectionError) as exc:
            s.close()
            if tries == 3:
                raise SlotError(f"the slot of subtask {subtask} closed three connections before taking "
                                f"the task ({exc}; {_log_tail(paths(name)['log'], 600)})") from None
            time.sleep(0.05 * tries)
    try:
        send(s, *payload)
        if sent is not None:
            sent()
        try:
            reply = recv_obj(s)
        except (EOFError, ConnectionError) as exc:
            raise SlotError(f"the slot process of subtask {subtask} exited during the task ({exc}; "
                            f"{_log_tail(paths(name)['log'], 600)}); the retry restores the subtask") from None
    finally:
        s.close()
    if reply.get("ok"):
        return reply["report"]
    err = reply.get("exc")
    remote = RemoteTraceback(reply.get("tb", ""))
    if err is not None:
        try:
            exc = pickle.loads(err)
        except Exception:  # noqa: BLE001 - a class the worker cannot import: the text is enough
            exc = None
        if isinstance(exc, BaseException):
            raise exc from remote
    raise SlotError(f"subtask {subtask} failed in its slot process: {reply.get('error', '?')}") from remote


__all__ = ["enabled", "slot_name", "call", "dumps", "SlotError", "RemoteTraceback", "ENV_SWITCH"]
