"""The slot process: holds one subtask's live state on a host and runs its tasks (dstl.spark.slot_client).

Started by a Python worker as ``<python> -c <boot> <name> <socket>``; serves one task at a time on
its Unix socket: a prelude (the worker's sys.path, executor and pyspark daemon), then the pickled
request (plan, function, rows, subtask, attempt, output schema), answered by the task report or the
exception. Everything the task body keeps between batches (the state cache, the storages, local
recovery's copies) lives here, so it survives whichever worker sent the task.
"""
from __future__ import annotations

import logging
import os
import pickle
import select
import socket
import sys
import threading
import time
import traceback
from typing import Any, Dict, List, Optional

from dstl.runtime_dir import pid_alive
from dstl.spark import cache, heap, memory_limit, slot_client
from dstl.spark.cache import IDLE_TIMEOUT_S
from dstl.spark.session import serve_executor
from dstl.spark.task import run_subtask

log = logging.getLogger(__name__)

#: seconds between the checks of the accept loop (idle, watched process, socket file)
TICK_S = 1.0


class _ClientWatch:
    """While a task runs: exit the process the moment its worker goes away (a killed task or a lost
    executor). The task's state is half-updated and nobody will ever ask for its result."""

    def __init__(self, conn: socket.socket, listener: socket.socket):
        self._conn = conn
        self._listener = listener
        self._done = threading.Event()
        # stop() wakes the watcher through this pipe: the task's reply waits for the watcher to
        # end, and a select with a timeout would hold it up to that timeout (every task)
        self._wake_r, self._wake_w = os.pipe()
        self._thread = threading.Thread(target=self._run, name="dstl-slot-watch", daemon=True)
        self._thread.start()

    def _run(self) -> None:
        while not self._done.is_set():
            try:
                readable, _, _ = select.select([self._conn, self._wake_r], [], [])
                if self._wake_r in readable or self._done.is_set():
                    return
                if not self._conn.recv(1, socket.MSG_PEEK | socket.MSG_DONTWAIT):
                    log.warning("the worker of the running task went away: exiting without its state")
                    self._die()
                time.sleep(0.05)  # bytes the protocol does not send while a task runs: not a closed peer
            except BlockingIOError:
                continue
            except OSError:
                if not self._done.is_set():
                    self._die()
                return

    def _die(self) -> None:
        # stop accepting first: a process whose other threads are still exiting keeps its socket
        # open for a moment, and the retry of this task must not connect to it
        try:
            self._listener.close()
        except OSError:
            pass
        os._exit(3)

    def stop(self) -> None:
        self._done.set()
        os.write(self._wake_w, b"x")
        self._thread.join()
        os.close(self._wake_r)
        os.close(self._wake_w)


class Slot:
    def __init__(self, name: str, sock_path: str):
        self.name = name
        self.sock_path = sock_path
        self.watch_pid: Optional[int] = None
        self.last_used = time.monotonic()
        self.tasks = 0
        self._sys_path: List[str] = []
        #: the address-space limit the slot inherited (spark.executor.pyspark.memory), None if none
        self.limit: Optional[int] = memory_limit.address_space_limit()
        #: set by a task that found the state outgrowing the limit: exit once its reply is sent
        self._outgrown = False

    # ---------------------------------------------------------------- serving

    def serve(self) -> None:
        srv = socket.socket(socket.AF_UNIX, socket.SOCK_STREAM)
        try:
            os.unlink(self.sock_path)  # a dead slot's socket: the starter holds the name's lock
        except FileNotFoundError:
            pass
        srv.bind(self.sock_path)
        os.chmod(self.sock_path, 0o600)
        srv.listen(16)
        inode = os.stat(self.sock_path).st_ino
        pid_file = self.sock_path[: -len(".sock")] + ".pid"
        with open(pid_file, "w") as f:
            f.write(f"{os.getpid()}\n")
        srv.settimeout(TICK_S)
        self._listener = srv
        log.info("slot %s listening on %s (pid %d)", self.name, self.sock_path, os.getpid())
        reason = "?"
        try:
            while True:
                try:
                    conn, _ = srv.accept()
                except socket.timeout:
                    reason = self._why_exit(inode, IDLE_TIMEOUT_S)
                    if reason:
                        break
                    continue
                with conn:
                    if self._handle(conn) == "exit":
                        reason = "asked to exit while idle"
                        break
                if self._outgrown:
                    # the state leaves with the process, and with it the address space it reserved
                    reason = "its subtask's state outgrew the memory limit"
                    break
            self._drain(srv, inode)
        finally:
            srv.close()
            log.info("slot %s exits after %d tasks: %s", self.name, self.tasks, reason)
            cache.shutdown()
            # a clean exit leaves nothing; a crashed slot's log stays (slot_client.evict_idle sweeps it)
            if not os.path.exists(self.sock_path):  # no successor has started under this name yet
                for path in (pid_file, self.sock_path[: -len(".sock")] + ".log"):
                    try:
                        os.unlink(path)
                    except OSError:
                        pass

    def _drain(self, srv: socket.socket, inode: int) -> None:
        """Unlink the socket (a new task starts a new slot from now on), then serve the tasks that
        connected before: a task never fails only because its slot was about to exit."""
        try:
            if os.stat(self.sock_path).st_ino == inode:
                os.unlink(self.sock_path)
        except OSError:
            pass
        srv.settimeout(0.0)
        while True:
            try:
                conn, _ = srv.accept()
            except (BlockingIOError, socket.timeout, OSError):
                return
            with conn:
                self._handle(conn, exiting=True)

    def _why_exit(self, inode: int, idle_s: float) -> str:
        if time.monotonic() - self.last_used > idle_s:
            return f"idle for {idle_s:.0f} s"
        if self.watch_pid is not None and not pid_alive(self.watch_pid):
            return f"the process {self.watch_pid} of the last worker it served is gone"
        try:
            if os.stat(self.sock_path).st_ino != inode:
                return "its socket was replaced"
        except FileNotFoundError:
            return "its socket was removed"
        return ""

    def _handle(self, conn: socket.socket, exiting: bool = False) -> str:
        conn.settimeout(300.0)
        try:
            prelude = slot_client.recv_obj(conn)
        except (EOFError, OSError, pickle.UnpicklingError):
            return "bad"
        if prelude.get("op") == "exit":
            # only when idle for as long as the asker assumed: a task may have ended meanwhile
            idle = time.monotonic() - self.last_used
            return "exit" if exiting or idle >= float(prelude.get("idle_s", 0.0)) else "ok"
        self._adopt(prelude)
        try:
            slot_client.send_obj(conn, {"ack": os.getpid()})  # the task is this slot's from now on
            request = slot_client.recv_obj(conn)
        except (EOFError, OSError):
            return "bad"
        except BaseException as exc:  # noqa: BLE001 - a function the slot cannot unpickle: tell the task
            reply = self._error(exc)
        else:
            hop_ms = max(0.0, (time.time() - prelude["sent"]) * 1e3)
            conn.settimeout(None)
            watch = _ClientWatch(conn, self._listener)
            try:
                reply = self._run(request, hop_ms)
            finally:
                watch.stop()
        self.tasks += 1
        self.last_used = time.monotonic()
        try:
            os.utime(self.sock_path)  # the idle ranking of evict_idle
        except OSError:
            pass
        try:
            slot_client.send_obj(conn, reply)
        except OSError:
            log.warning("could not send the task's reply: its worker went away")
        return "ok"

    def _adopt(self, prelude: Dict[str, Any]) -> None:
        for p in prelude.get("sys_path", ()):
            if p not in sys.path:
                sys.path.append(p)
        watch = prelude.get("watch")
        self.watch_pid = watch if isinstance(watch, int) and watch > 1 else None
        pid, eid = prelude.get("executor", (None, "unknown"))
        serve_executor(pid, eid)

    def _run(self, request: Dict[str, Any], hop_ms: float) -> Dict[str, Any]:
        subtask = request["subtask"]
        before = memory_limit.state_entries(cache.CACHE.backends()) if self.limit is not None else {}
        try:
            report = run_subtask(request["plan"], request["fn"], request["rows"], subtask,
                                 request["attempt"], request["arrow_schema"])
            memory_limit.check_after_task(subtask, self.limit, memory_limit.state_entries(cache.CACHE.backends()),
                                          report.get("state_size"))
        except memory_limit.SlotMemoryError as exc:
            self._outgrown = True
            return self._error(exc)
        except BaseException as exc:  # noqa: BLE001 - the task's failure travels back to Spark
            starved = memory_limit.out_of_memory(subtask, self.limit, exc, before)
            if starved is None:
                return self._error(exc)
            self._outgrown = True
            starved.__cause__ = exc
            return self._error(starved)
        report["hop_ms"] = hop_ms  # the rows' way from the worker to this process
        return {"ok": True, "report": report}

    @staticmethod
    def _error(exc: BaseException) -> Dict[str, Any]:
        tb = "".join(traceback.format_exception(type(exc), exc, exc.__traceback__))
        try:
            payload: Optional[bytes] = pickle.dumps(exc)
            pickle.loads(payload)
        except Exception:  # noqa: BLE001
            payload = None
        return {"ok": False, "exc": payload, "tb": tb, "error": f"{type(exc).__name__}: {exc}"}


def main(argv: List[str]) -> None:
    name, sock_path = argv[0], argv[1]
    logging.basicConfig(level=os.environ.get("DSTL_SPARK_SLOT_LOG", "INFO"), stream=sys.stderr,
                        format=f"%(asctime)s slot {name} pid {os.getpid()} %(levelname)s %(name)s: %(message)s")
    memory_limit.bound_process()
    heap.own_process()
    Slot(name, sock_path).serve()


if __name__ == "__main__":  # pragma: no cover
    main(sys.argv[1:])
