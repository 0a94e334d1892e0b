"""Helpers for the upload-service tests: an isolated runtime directory, process bookkeeping by PID, and a
file system whose writes can be held from another process.

`gatefs` (protocol ``gate``, URLs ``gate:///abs/path``) is a local filesystem for cross-process fault
injection: while the file ``<root>/.gate`` exists, every write-open of a changelog file first creates
``<root>/.held-<pid>`` and waits (at most 30 s) until ``.gate`` is removed. ``<root>/.gate-once``
holds only the first write-open, which renames it to ``.gate-claimed`` and waits until that is removed. The service's uploader
processes import it through ``DSTL_SERVICE_IMPORTS=service_util``.
"""
from __future__ import annotations

import os
import signal
import sys
import tempfile
import time
import uuid
from typing import Iterable, List, Optional

from fsspec.implementations.local import LocalFileSystem
import fsspec
import pytest

HERE = os.path.dirname(os.path.abspath(__file__))


class GateFileSystem(LocalFileSystem):
    protocol = "gate"
    root_marker = "/"

    @classmethod
    def _strip_protocol(cls, path):
        if isinstance(path, str) and path.startswith("gate://"):
            path = path[len("gate://"):]
        return LocalFileSystem._strip_protocol(path)

    def unstrip_protocol(self, name: str) -> str:
        return "gate://" + self._strip_protocol(name)

    def _open(self, path, mode="rb", **kw):
        if any(c in mode for c in "wxa") and "/dstl/" in path:
            root = path.split("/dstl/")[0].rsplit("/", 1)[0]
            gate = os.path.join(root, ".gate")
            once = os.path.join(root, ".gate-once")
            try:  # a one-shot gate holds only the first write-open that claims it
                os.rename(once, gate + "-claimed")
                gate = gate + "-claimed"
            except FileNotFoundError:
                pass
            if os.path.exists(gate):
                held = os.path.join(root, f".held-{os.getpid()}")
                open(held, "w").close()
                deadline = time.monotonic() + 30
                try:
                    while os.path.exists(gate) and time.monotonic() < deadline:
                        time.sleep(0.01)
                finally:
                    try:
                        os.unlink(held)
                    except FileNotFoundError:
                        pass
        return super()._open(path, mode, **kw)

    def rm_file(self, path):
        """Fails with EIO while ``<root>/.nodelete`` exists (a store refusing deletes)."""
        p = self._strip_protocol(path)
        if "/dstl/" in p and os.path.exists(os.path.join(p.split("/dstl/")[0].rsplit("/", 1)[0], ".nodelete")):
            import errno

            raise OSError(errno.EIO, f"injected delete failure: {p}")
        return super().rm_file(path)


fsspec.register_implementation("gate", GateFileSystem, clobber=True)


def gate_url(root) -> str:
    return "gate://" + os.path.abspath(str(root))


def held_pids(root) -> List[int]:
    return [int(n.split("-", 1)[1]) for n in os.listdir(root) if n.startswith(".held-")]


def children_of(pid: int) -> List[int]:
    """Every descendant of `pid` (from /proc), deepest last."""
    kids = []
    for entry in os.listdir("/proc"):
        if not entry.isdigit():
            continue
        try:
            with open(f"/proc/{entry}/stat") as f:
                ppid = int(f.read().rsplit(")", 1)[1].split()[1])
        except (OSError, ValueError, IndexError):
            continue
        if ppid == pid:
            kids.append(int(entry))
    out = list(kids)
    for k in kids:
        out += children_of(k)
    return out


def alive(pid: int) -> bool:
    from dstl.changelog.upload.service.runtime import pid_alive

    return pid_alive(pid)


def wait_dead(pids: Iterable[int], timeout: float = 20.0) -> List[int]:
    """Wait for `pids` to exit; return the ones still alive at the deadline."""
    pids = list(pids)
    deadline = time.monotonic() + timeout
    while time.monotonic() < deadline:
        left = [p for p in pids if alive(p)]
        if not left:
            return []
        time.sleep(0.02)
    return [p for p in pids if alive(p)]


def kill_tree(pid: Optional[int]) -> None:
    """SIGKILL `pid` and its descendants (test clean-up, by PID)."""
    if not pid:
        return
    for p in [pid] + children_of(pid):
        try:
            os.kill(p, signal.SIGKILL)
        except ProcessLookupError:
            pass


def service_pids(runtime_root: str) -> List[int]:
    """Pids written by the services under `runtime_root`."""
    out = []
    for d in os.listdir(runtime_root):
        try:
            with open(os.path.join(runtime_root, d, "pid")) as f:
                out.append(int(f.read().split()[0]))
        except (OSError, ValueError, IndexError):
            pass
    return out


class Runtime:
    """An isolated service runtime directory (short path, for the Unix socket) with a short linger."""

    def __init__(self, linger_ms: int = 300):
        self.root = tempfile.mkdtemp(prefix="dq", dir="/tmp")
        self._saved = {k: os.environ.get(k) for k in ("DSTL_RUNTIME_DIR", "DSTL_SERVICE_LINGER_MS",
                                                     "DSTL_SERVICE_IMPORTS", "PYTHONPATH")}
        os.environ["DSTL_RUNTIME_DIR"] = self.root
        os.environ["DSTL_SERVICE_LINGER_MS"] = str(linger_ms)
        os.environ["DSTL_SERVICE_IMPORTS"] = "service_util"
        os.environ["PYTHONPATH"] = HERE + (os.pathsep + self._saved["PYTHONPATH"]
                                           if self._saved["PYTHONPATH"] else "")
        self.seen: List[int] = []

    def remember(self, pid: int) -> int:
        """Track a service pid (and, at clean-up, its descendants) for killing."""
        self.seen.append(pid)
        return pid

    def cleanup(self) -> None:
        import shutil

        pids = set(self.seen) | set(service_pids(self.root))
        tree = []
        for p in pids:
            tree += [p] + children_of(p)
        for p in pids:  # polite first: lets the service unlink its segments
            try:
                os.kill(p, signal.SIGTERM)
            except ProcessLookupError:
                pass
        t0 = time.monotonic()
        left = wait_dead(tree, 15)
        if time.monotonic() - t0 > 3:
            sys.stderr.write(f"SLOWCLEANUP {time.monotonic() - t0:.1f}s left={left} tree={tree}\n")
        for p in left:
            try:
                os.kill(p, signal.SIGKILL)
            except ProcessLookupError:
                pass
        for k, v in self._saved.items():
            if v is None:
                os.environ.pop(k, None)
            else:
                os.environ[k] = v
        shutil.rmtree(self.root, ignore_errors=True)


def python_child(code: str, *args: str, env=None):
    """Start `python -c code args...` with the repo and tests on the path; returns the Popen."""
    import subprocess

    e = dict(os.environ if env is None else env)
    root = os.path.dirname(HERE)
    e["PYTHONPATH"] = os.pathsep.join([root, HERE] + ([e["PYTHONPATH"]] if e.get("PYTHONPATH") else []))
    return subprocess.Popen([sys.executable, "-c", code, *args], env=e, stdout=subprocess.PIPE,
                            stderr=subprocess.PIPE, text=True)


def stop_services(storages) -> None:
    """Stop, by PID, the services that process-mode `storages` used (after they were closed), with
    their children, and remove their runtime directories (test clean-up)."""
    import shutil

    for s in storages:
        conn = getattr(getattr(s, "scheduler", None), "connection", None)
        if conn is None:
            continue
        pid = conn.service_pid
        family = [pid] + children_of(pid)
        try:
            os.kill(pid, signal.SIGTERM)
        except ProcessLookupError:
            pass
        for p in wait_dead(family, 15):
            try:
                os.kill(p, signal.SIGKILL)
            except ProcessLookupError:
                pass
        shutil.rmtree(conn.paths.directory, ignore_errors=True)


def _is_service(pid: int) -> bool:
    try:
        with open(f"/proc/{pid}/cmdline", "rb") as f:
            return b"dstl.changelog.upload.service.server" in f.read()
    except OSError:
        return False


def stop_services_under(root: str, timeout: float = 15.0) -> List[int]:
    """Stop, by PID, every upload service whose pid file is under `root` and still runs the service
    (a recycled pid is left alone), with its children: SIGTERM, then SIGKILL after `timeout`.
    Returns the service pids that were still running."""
    if not os.path.isdir(root):
        return []
    pids = [p for p in service_pids(root) if _is_service(p)]
    family = []
    for p in pids:
        family += [p] + children_of(p)
        try:
            os.kill(p, signal.SIGTERM)
        except ProcessLookupError:
            pass
    for p in wait_dead(family, timeout):
        try:
            os.kill(p, signal.SIGKILL)
        except ProcessLookupError:
            pass
    return pids


class session_runtime:
    """A private DSTL_RUNTIME_DIR for a whole test session (tests/conftest.py): every service that the
    session's storages start without their own runtime lives there, and is stopped by PID at the end."""

    def __enter__(self) -> str:
        self.saved = os.environ.get("DSTL_RUNTIME_DIR")
        self.root = tempfile.mkdtemp(prefix="dqs", dir="/tmp")
        os.environ["DSTL_RUNTIME_DIR"] = self.root
        return self.root

    def __exit__(self, *exc) -> None:
        import shutil

        try:
            stopped = stop_services_under(self.root)
            if stopped:
                sys.stderr.write(f"\nstopped {len(stopped)} upload service(s) left by the session\n")
        finally:
            if self.saved is None:
                os.environ.pop("DSTL_RUNTIME_DIR", None)
            else:
                os.environ["DSTL_RUNTIME_DIR"] = self.saved
            shutil.rmtree(self.root, ignore_errors=True)


@pytest.fixture
def runtime():
    """A private runtime directory for one test's services (stopped by PID afterwards)."""
    rt = Runtime(linger_ms=300)
    try:
        yield rt
    finally:
        rt.cleanup()


def process_storage(base, **opts):
    """A process-mode storage with a fresh job id (options as for `open_storage`)."""
    from dstl.changelog.storage import open_storage

    opts.setdefault("upload_mode", "process")
    opts.setdefault("job_id", uuid.uuid4().hex)
    return open_storage(str(base), **opts)


# ---- journal write faults ---------------------------------------------------------------------
JOURNAL_FAULTS_ENV = "DSTL_TEST_JOURNAL_FAULTS"


def _install_journal_faults(control: str) -> None:
    """In a service process, shim os.write for the registry journal's log file only (found by the
    descriptor's path): while `<control>/short` exists, each write(2) writes at most 7 bytes; while
    `<control>/enospc` exists, a write of a record containing that file's text writes half of the
    record and then fails with ENOSPC (a partial record, as on a full runtime file system)."""
    import errno

    real_write = os.write

    def is_journal(fd) -> bool:
        try:
            return os.readlink(f"/proc/self/fd/{fd}").endswith("/journal.log")
        except OSError:
            return False

    def faulty_write(fd, data):
        if not is_journal(fd):
            return real_write(fd, data)
        raw = bytes(data)
        enospc = os.path.join(control, "enospc")
        if os.path.exists(enospc):
            with open(enospc, "rb") as f:
                needle = f.read()
            if needle in raw:
                real_write(fd, raw[: max(1, len(raw) // 2)])
                raise OSError(errno.ENOSPC, "No space left on device")
        if os.path.exists(os.path.join(control, "short")):
            return real_write(fd, raw[:7])
        return real_write(fd, data)

    os.write = faulty_write


if os.environ.get(JOURNAL_FAULTS_ENV):
    _install_journal_faults(os.environ[JOURNAL_FAULTS_ENV])
