"""Chaos: 4 client processes persist and confirm in a loop while random processes of the upload
service (the service itself, its registry, uploaders, the forkserver) are killed with SIGKILL.

Afterwards every confirmed handle reads back exactly, and once the orphan grace period has passed no
changelog file is left that no confirmed handle references (nothing leaked, nothing missing).
The run lasts DSTL_CHAOS_SECONDS (default 15; the issue's full run is 60).
"""
from __future__ import annotations

import json
import os
import random
import signal
import time
import uuid

import pytest

from conftest import heavy
from service_util import children_of, python_child, service_pids, wait_dead
from service_util import runtime  # noqa: F401  (fixture)

pytestmark = heavy  # real service processes and signals; the service's code is the same under both builds

SECONDS = float(os.environ.get("DSTL_CHAOS_SECONDS", "15"))
CLIENTS = 4
GRACE_MS = 1500
# what is killed, in turn (each victim picked at random among its kind)
ROUND = ["uploader", "registry", "uploader", "forkserver", "uploader", "registry", "service"]

_CLIENT = r"""
import json, os, sys, time
from dstl.changelog.storage import open_storage
from dstl.types import KeyGroupRange
base, job, who, until, out_path = sys.argv[1], sys.argv[2], int(sys.argv[3]), float(sys.argv[4]), sys.argv[5]
OPTS = dict(upload_mode="process", job_id=job, batch_persist_delay="5 ms", upload_timeout="1 s",
            upload_next_attempt_delay="20 ms")
out = open(out_path, "a")
gen = 0
stats = {"ok": 0, "failed": 0, "reopened": 0}
def fresh():
    global gen
    gen += 1
    s = open_storage(base, **OPTS)
    return s, s.create_writer("op", KeyGroupRange(0, 127))
s, w = fresh()
sqn = 0
while time.time() < until:
    changes = [((who * 31 + sqn * 7 + j) % 128, b"c%d-%d-%d-%d" % (who, gen, sqn, j) * (1 + j % 5)) for j in range(20)]
    for kg, data in changes:
        w.append(kg, data)
    try:
        h = w.persist(sqn, 1).result(30).job_manager_owned_snapshot
    except Exception as exc:
        stats["failed"] += 1
        h = None
    if h is not None:
        try:
            w.confirm(sqn, sqn + 1, 1 + sqn)
            status = "confirmed"
        except Exception:
            status = "maybe"  # the confirm's answer was lost: it may or may not be durable
        out.write(json.dumps({"status": status, "handle": h.to_bytes().hex(),
                              "changes": [[kg, d.hex()] for kg, d in changes]}) + "\n")
        out.flush()
        stats["ok"] += 1
    sqn += 1
    try:
        w.truncate(sqn)
    except Exception:
        pass
    conn = s.scheduler.connection
    if conn.broken is not None:  # the service died: a new storage starts (or joins) a new one
        try:
            w.close()
            s.close()
        except Exception:
            pass
        s, w = fresh()
        sqn = 0
        stats["reopened"] += 1
w.close()
s.close()
print(json.dumps(stats), flush=True)
"""


def _holds_journal(pid: int) -> bool:
    """The registry process is the one with the journal open."""
    try:
        return any(os.readlink(f"/proc/{pid}/fd/{fd}").endswith("journal.log") for fd in os.listdir(f"/proc/{pid}/fd"))
    except OSError:
        return False


def _role(pid: int, service: int) -> str:
    try:
        with open(f"/proc/{pid}/cmdline", "rb") as f:
            cmd = f.read()
        with open(f"/proc/{pid}/stat") as f:
            ppid = int(f.read().rsplit(")", 1)[1].split()[1])
    except (OSError, ValueError, IndexError):
        return "gone"
    if b"resource_tracker" in cmd:
        return "tracker"
    if ppid == service and b"forkserver" in cmd:
        return "forkserver"
    return "child"


@pytest.mark.parametrize("client_writes", ["1", "0"], ids=["clients-write", "through-shared-memory"])
def test_chaos_every_confirmed_handle_reads_back_and_nothing_leaks(runtime, tmp_path, monkeypatch, client_writes):
    from dstl.changelog.handles import ChangelogStateHandleStreamImpl
    from dstl.changelog.storage import open_storage
    from dstl.changelog.upload.service.client import CLIENT_WRITES_ENV

    monkeypatch.setenv("DSTL_ORPHAN_GRACE_MS", str(GRACE_MS))
    monkeypatch.setenv(CLIENT_WRITES_ENV, client_writes)  # raw local files: the clients write them, or uploaders
    base = tmp_path / "base"
    base.mkdir()
    job = uuid.uuid4().hex
    until = time.time() + SECONDS
    outs = [tmp_path / f"client-{i}.jsonl" for i in range(CLIENTS)]
    procs = [python_child(_CLIENT, str(base), job, str(i), str(until), str(outs[i])) for i in range(CLIENTS)]
    rng = random.Random(9)
    kills = {"service": 0, "registry": 0, "uploader": 0, "forkserver": 0}
    order = []
    try:
        while time.time() < until - 3:  # a calm end: the clients' last round trips finish
            time.sleep(rng.uniform(0.3, 1.0))
            services = [p for p in service_pids(runtime.root) if os.path.exists(f"/proc/{p}")]
            if not services:
                continue
            service = services[0]
            runtime.remember(service)
            try:
                status_children = children_of(service)
            except OSError:
                continue
            roles = {p: _role(p, service) for p in status_children}
            forkserver = [p for p, r in roles.items() if r == "forkserver"]
            others = [p for p, r in roles.items() if r == "child"]
            want = ROUND[len(order) % len(ROUND)]
            order.append(want)
            registry = [p for p in others if _holds_journal(p)]
            uploaders = [p for p in others if p not in registry]
            if want == "service":
                victim = service
            elif want == "forkserver" and forkserver:
                victim = forkserver[0]
            elif want == "registry" and registry:
                victim = registry[0]
            elif uploaders:
                victim, want = rng.choice(uploaders), "uploader"
            else:
                continue
            what = want
            try:
                os.kill(victim, signal.SIGKILL)
                kills[what] += 1
            except ProcessLookupError:
                pass
        stats = []
        for p in procs:
            out, err = p.communicate(timeout=120)
            assert p.returncode == 0, err[-3000:]
            stats.append(json.loads(out.strip().splitlines()[-1]))
    finally:
        for p in procs:
            if p.poll() is None:
                p.kill()
                p.wait(10)
    assert sum(s["ok"] for s in stats) > 0, stats
    assert sum(kills.values()) >= 3, kills
    print(f"chaos: kills {kills}, clients {stats}")

    records = [json.loads(line) for o in outs for line in open(o)]
    confirmed = [r for r in records if r["status"] == "confirmed"]
    maybe = {f for r in records if r["status"] == "maybe"
             for f in ChangelogStateHandleStreamImpl.from_bytes(bytes.fromhex(r["handle"])).files()}
    assert confirmed, stats
    # a live service settles what the dead services and clients left: orphans after the grace period
    keeper = open_storage(str(base), upload_mode="process", job_id=job, batch_persist_delay="5 ms",
                          upload_timeout="1 s", upload_next_attempt_delay="20 ms")
    try:
        runtime.remember(keeper.scheduler.service_pid)
        reader = keeper.create_reader()
        wanted = set()
        for r in confirmed:
            handle = ChangelogStateHandleStreamImpl.from_bytes(bytes.fromhex(r["handle"]))
            got = [(c.key_group, bytes(c.data)) for c in reader.get_changes(handle)]
            expected = [(kg, bytes.fromhex(d)) for kg, d in r["changes"]]
            assert sorted(got) == sorted(expected), f"confirmed handle {handle} reads back wrong"
            wanted |= {os.path.basename(f) for f in handle.files()}
        job_dir = base / job / "dstl"
        allowed = wanted | {os.path.basename(f) for f in maybe}
        deadline = time.monotonic() + GRACE_MS / 1000 + 30
        while True:
            present = set(os.listdir(job_dir))
            leaked = present - allowed
            if not leaked or time.monotonic() > deadline:
                break
            time.sleep(0.2)
        assert wanted <= present, f"confirmed files missing: {sorted(wanted - present)[:5]}"
        assert not leaked, (f"{len(leaked)} changelog files leaked (kills {kills}, clients {stats}): "
                            f"{sorted(leaked)[:5]}")
    finally:
        keeper.close()
    for p in service_pids(runtime.root):
        wait_dead([p], 1)
