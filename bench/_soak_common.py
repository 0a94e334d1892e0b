"""What bench/soak.py and bench/soak_scale.py share: a driver's process tree read from /proc (children,
command lines, RSS, descriptors), stopping a driver's process group, and its progress file."""
from __future__ import annotations

import json
import os
import signal
import subprocess
from typing import List


def children(pid: int) -> List[int]:
    """Every descendant of `pid` (breadth first)."""
    out, todo = [], [pid]
    while todo:
        p = todo.pop()
        kids = []
        try:  # every thread's children: the JVM starts processes from other threads than its main one
            for t in os.listdir(f"/proc/{p}/task"):
                try:
                    with open(f"/proc/{p}/task/{t}/children") as f:
                        kids += [int(x) for x in f.read().split()]
                except OSError:
                    pass
        except OSError:
            pass
        kids = [k for k in dict.fromkeys(kids) if k not in out]  # a pid listed twice is counted once
        out += kids
        todo += kids
    return out


def cmdline(pid: int) -> str:
    try:
        with open(f"/proc/{pid}/cmdline", "rb") as f:
            return f.read().replace(b"\0", b" ").decode(errors="replace")
    except OSError:
        return ""


def rss_mb(pids: List[int]) -> float:
    """The summed VmRSS of `pids` in MB (shared pages counted per process; gone pids count 0)."""
    total = 0
    for p in pids:
        try:
            with open(f"/proc/{p}/status") as f:
                for line in f:
                    if line.startswith("VmRSS:"):
                        total += int(line.split()[1])
        except OSError:
            pass
    return total / 1024


def fds(pids: List[int]) -> int:
    n = 0
    for p in pids:
        try:
            n += len(os.listdir(f"/proc/{p}/fd"))
        except OSError:
            pass
    return n


def kill_group(proc: subprocess.Popen) -> None:
    """SIGKILL a driver started with start_new_session=True, and wait for its group (its JVM) to go."""
    try:
        os.killpg(proc.pid, signal.SIGKILL)
    except ProcessLookupError:
        pass
    proc.wait()
    from dstl.tools.stream_demo import reap_group

    reap_group(proc.pid)


def read_progress(path: str) -> List[dict]:
    """The complete JSON lines of a driver's progress file so far."""
    try:
        with open(path) as f:
            return [json.loads(x) for x in f if x.endswith("\n") and x.strip()]
    except FileNotFoundError:
        return []


def loadavg() -> List[str]:
    with open("/proc/loadavg") as f:
        return f.read().split()[:3]
