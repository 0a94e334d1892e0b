"""Issue 34, item 5: a SIGKILL at every step of a batch and of a rescale; after each, the restart of the
same query is exact (docs/semantics.md, "Kills at every step").

One harness, parametrised by the tables below. Every Spark driver start is the expensive part (a JVM,
Python workers, the first batch's imports: 30-70 s each on a loaded 2-core machine), so the kills do
not each get a fresh job: they form ONE chain on one base path and one Spark checkpoint location.
Run i of tests/kill_driver.py (a real Structured Streaming driver, its own process group) is
SIGKILLed at kill i (`DSTL_FAULTS="<point>@<batch>=kill"`), and run i + 1 is both the restart that
must recover kill i and the run that is killed at kill i + 1, one batch later. Nine driver processes
and two `dstl state rescale` processes cover:

* each step of a batch, at parallelism 2 (BATCH_KILLS): before the tasks, after the tasks (reports
  collected, no checkpoint), after the checkpoint metadata, in the output commit (one staged file
  renamed, not the other), in the sink (it returned, its marker is not written), in garbage
  collection (an old checkpoint deleted; an unreferenced changelog file deleted);
* each step of a rescale (RESCALE_KILLS): the offline `dstl state rescale` to 256 key groups with
  one new subtask's state uploaded, then again once its checkpoint is durable but the job file not
  updated; then the query restarted at parallelism 3, killed in its first batch there;
* the processes a task runs in, killed mid-task (TASK_TARGETS: the subtask's slot process, which
  holds its warm state, and the Python worker that forwards its rows), each in a batch of the last run.

Each kill gets one test (`test_kill_then_restart[<point>@<batch>]`) that checks what the base path
holds right after the kill (what is guaranteed at that step) and after the restart (every batch up
to the killed one committed exactly once, as pandas computes it, nothing committed past the latest
checkpoint, and every sink call given exactly its batch's data). `test_the_whole_stream_is_exact` checks the end: all output exact, the sink called once
per batch (twice for the batch killed in its sink), nothing left in the staging area, and nothing for
`dstl gc` to delete. The chain runs once per module (a module-scoped fixture); a test whose step
the chain did not reach fails with the reason.

Cost: nine driver starts, two CLI runs, 11 batches. Measured for the whole module on the shared
2-core machine while other developers' Spark suites ran: 6 min 23 s at load average 6-12 (drivers
18-70 s each, the rescale CLI 1-2 s), 8 min 52 s at 12-15 (drivers 31-72 s). The whole chain is needed by every test of the module: select
none of them to skip it (`-m "not heavy"`).
"""
from __future__ import annotations

import json
import os
import signal
import subprocess
import sys
import time
from dataclasses import dataclass, field
from typing import Callable, Dict, List, Optional, Tuple

import pytest

from conftest import heavy

pytestmark = heavy

pytest.importorskip("pyspark")

HERE = os.path.dirname(os.path.abspath(__file__))
ROOT = os.path.dirname(HERE)
EVENTS, KEYS, SEED = 200, 40, 34
NEW_MAX_PARALLELISM = 256
RUN_TIMEOUT_S = 400
# thread mode: no upload service to start in each driver's first batch (it costs 10-15 s per driver
# on a loaded machine); the kills under test are the driver's, whatever the workers upload with
OPTIONS = ["upload.mode=thread"]
# Start-up costs of a short-lived driver on a loaded machine, none of which matters to what is tested:
# whole-stage codegen and adaptive planning compile and re-plan every tiny query, and the JVM's C2
# compiler and parallel GC threads compete for the two cores (a 4-batch driver: 70-115 s -> 40-70 s)
CONF = ["spark.sql.codegen.wholeStage=false", "spark.sql.adaptive.enabled=false"]
JVM_OPTIONS = "-XX:TieredStopAtLevel=1 -XX:+UseSerialGC"


@dataclass(frozen=True)
class Kill:
    """One SIGKILL: `point` (dstl.spark.faults) in `batch` of a driver at `parallelism`, or, with
    `batch` None, in the offline `dstl state rescale` (`spec` is then the DSTL_FAULTS target)."""

    point: str
    batch: Optional[int]
    parallelism: int = 2
    spec: Optional[str] = None
    #: what holds right after the kill (the guarantee documented for the step)
    guarantee: str = ""

    @property
    def id(self) -> str:
        return f"{self.point}@{self.batch}" if self.batch is not None else self.point

    @property
    def faults(self) -> str:
        if self.spec:
            return f"{self.spec}=kill"
        return f"{self.point}=kill" if self.batch is None else f"{self.point}@{self.batch}=kill"


# The steps of a batch, in the order a batch passes them; each one batch after the previous (the
# restart of kill i finishes kill i's batch, then is killed in the next). Garbage collection deletes
# files in a run's second fresh batch (a file must be unreferenced two passes in a row), hence 7.
BATCH_KILLS = [
    Kill("stream.before_tasks", 0, guarantee="nothing of the batch written"),
    Kill("stream.after_tasks", 1, guarantee="staged output and changelog uploads, no checkpoint"),
    Kill("stream.after_checkpoint", 2, guarantee="checkpoint durable, output not committed"),
    Kill("coordinator.mid_commit", 3, guarantee="checkpoint durable, one staged file renamed, no _SUCCESS"),
    Kill("stream.mid_sink", 4, guarantee="output committed, sink returned, its marker not written"),
    Kill("coordinator.mid_gc_checkpoints", 5, guarantee="output committed, an old checkpoint deleted"),
    Kill("coordinator.mid_gc_files", 7, guarantee="output committed, an unreferenced changelog file deleted"),
]
LAST_P2_BATCH = 7
# The steps of a rescale: the offline tool twice (the second run is the first one's restart), then
# the query's first batch at the new parallelism (and the new max parallelism).
RESCALE_KILLS = [
    Kill("rescale.mid_write", None, spec="rescale.mid_write@*/0",
         guarantee="one new subtask's state uploaded, no new checkpoint"),
    Kill("rescale.after_checkpoint", None, guarantee="new checkpoint durable, job file not updated"),
    Kill("stream.after_tasks", 8, parallelism=3,
         guarantee="first batch at parallelism 3: tasks restored and staged, no checkpoint"),
]
NEW_PARALLELISM = 3


@dataclass(frozen=True)
class TaskTarget:
    """A task-side kill target: the process that holds a subtask's warm state, SIGKILLed mid-task
    (half the rows applied) in a batch whose subtasks continue warm from the previous one. `spec`
    gives the DSTL_FAULTS entry for (batch, once-marker path)."""

    name: str
    spec: Callable[[int, str], str]


#: The parametrisation hook for the task side: each target is killed mid-task in its own batch of the
#: last run, and Spark retries the task (local[2,4]), whose retry restores the subtask from the last
#: checkpoint. Since dstl.spark.slot_client, a subtask's warm state lives in its slot process (one per
#: subtask and host), which `task.mid_batch` runs in; the Python worker that forwards the task's rows
#: waits at `task.worker_wait` (killing it makes the slot exit without its state). With slots off
#: (DSTL_SPARK_SLOTS=0) the state is the worker's and `task.mid_batch` runs there. A new holder of warm
#: state (or a new way to lose it, e.g. a `kill-executor` on a cluster) is one more entry here.
TASK_TARGETS: List[TaskTarget] = [
    TaskTarget("slot-process", lambda b, marker: f"task.mid_batch@{b}/0=kill:once={marker}"),
    TaskTarget("python-worker", lambda b, marker: f"task.worker_wait@{b}/0=kill:once={marker}"),
]
FIRST_TASK_KILL_BATCH = 9  # from the last run's second batch: batch 8 (redone at P=3) makes its subtasks warm
N_BATCHES = FIRST_TASK_KILL_BATCH + len(TASK_TARGETS)


# --------------------------------------------------------------------------- what the base path holds
@dataclass
class Snapshot:
    """What a base path holds at one moment (the test's view, read without dstl's coordinator)."""

    checkpoints: List[Tuple[int, int, int, int]]   # (id, batch, max parallelism, parallelism)
    job_max_parallelism: int
    committed: Dict[int, object]                    # batch -> its committed rows (a DataFrame)
    partial: Dict[int, int]                         # batch -> part files, for a batch folder without _SUCCESS
    staged: List[str]                               # files under <output>/_staging
    markers: List[int]                              # batches whose sink marker exists
    sink_calls: Dict[int, List[Tuple[int, int]]]    # batch -> [(rows, sum of events)] per call

    @property
    def latest_batch(self) -> int:
        return self.checkpoints[-1][1] if self.checkpoints else -1


def observe(base: str, sink_log: str) -> Snapshot:
    import pandas as pd

    from dstl.state.metadata import list_checkpoints, read_checkpoint

    cps = []
    for cid in list_checkpoints(base):
        m = read_checkpoint(base, cid)
        cps.append((cid, int(m.properties["batch"]), m.max_parallelism, m.parallelism))
    with open(os.path.join(base, "_dstl_job.json")) as f:
        job_maxp = json.load(f)["max_parallelism"]
    out = os.path.join(base, "output")
    committed, partial = {}, {}
    for name in sorted(os.listdir(out)) if os.path.isdir(out) else []:
        if not name.startswith("batch_id="):
            continue
        d = os.path.join(out, name)
        parts = sorted(p for p in os.listdir(d) if p.endswith(".parquet"))
        b = int(name.split("=", 1)[1])
        if os.path.exists(os.path.join(d, "_SUCCESS")):
            frames = [pd.read_parquet(os.path.join(d, p)) for p in parts]
            committed[b] = pd.concat(frames, ignore_index=True) if frames else pd.DataFrame()
        else:
            partial[b] = len(parts)
    staged = []
    for dirpath, _, files in os.walk(os.path.join(out, "_staging")):
        staged += [os.path.join(dirpath, f) for f in files]
    mdir = os.path.join(base, "_dstl_sink")
    markers = sorted(int(n[6:]) for n in os.listdir(mdir) if n.startswith("batch-")) if os.path.isdir(mdir) else []
    calls: Dict[int, List[Tuple[int, int]]] = {}
    if os.path.exists(sink_log):
        with open(sink_log) as f:
            for line in filter(str.strip, f):
                b, rows, events = map(int, line.split())
                calls.setdefault(b, []).append((rows, events))
    return Snapshot(cps, job_maxp, committed, partial, staged, markers, calls)


# --------------------------------------------------------------------------- the chain
@dataclass
class Record:
    kill: Kill
    rc: Optional[int] = None
    at_kill: Optional[Snapshot] = None
    after_restart: Optional[Snapshot] = None
    restart_rc: Optional[int] = None


@dataclass
class Chain:
    base: str
    sink_log: str
    batches: list = field(repr=False)
    records: Dict[str, Record] = field(default_factory=dict, repr=False)
    broken: Optional[str] = None          # why the chain stopped early (with the log's tail)
    final: Optional[Snapshot] = field(default=None, repr=False)
    task_markers: Dict[str, str] = field(default_factory=dict)
    last_progress: List[dict] = field(default_factory=list, repr=False)
    seconds: List[Tuple[str, float]] = field(default_factory=list)


def _run(argv: List[str], faults_spec: Optional[str], log_path: str, jvm_options: str = "") -> Tuple[int, str]:
    """Run one process (its own process group) to its end or its SIGKILL; then SIGKILL whatever is
    left of its group (a killed driver's JVM and Python workers), as a crashed host would lose them."""
    from dstl.tools.stream_demo import reap_group

    env = dict(os.environ, PYTHONPATH=os.pathsep.join([ROOT, HERE]), PYSPARK_PYTHON=sys.executable,
               SPARK_LOCAL_IP="127.0.0.1")
    if jvm_options:
        env["JAVA_TOOL_OPTIONS"] = f"{env.get('JAVA_TOOL_OPTIONS', '')} {jvm_options}".strip()
    env.pop("DSTL_FAULTS", None)
    if faults_spec:
        env["DSTL_FAULTS"] = faults_spec
    with open(log_path, "ab") as log:
        log.write(f"\n=== {' '.join(argv[1:])}  DSTL_FAULTS={faults_spec}\n".encode())
        log.flush()
        proc = subprocess.Popen(argv, env=env, stdout=log, stderr=subprocess.STDOUT, start_new_session=True)
    try:
        rc = proc.wait(RUN_TIMEOUT_S)
    except subprocess.TimeoutExpired:
        rc = None
    finally:
        if proc.poll() is None:
            proc.kill()
            proc.wait(30)
        try:
            os.killpg(proc.pid, signal.SIGKILL)
        except ProcessLookupError:
            pass
        reap_group(proc.pid)
    with open(log_path, errors="replace") as f:
        tail = f.read()[-4000:]
    return (rc if rc is not None else -999), tail


def _read_progress(path: str) -> List[dict]:
    if not os.path.exists(path):
        return []
    with open(path) as f:
        return [json.loads(line) for line in f if line.strip()]


def run_chain(tmp: str) -> Chain:
    from streaming_util import make_batches, write_json_stream

    base, inputs, ckpt = (os.path.join(tmp, n) for n in ("job", "input", "spark-checkpoint"))
    progress, sink_log, log_path = (os.path.join(tmp, n) for n in ("progress.jsonl", "sink.log", "runs.log"))
    chain = Chain(base, sink_log, make_batches(N_BATCHES, EVENTS, KEYS, seed=SEED))
    write_json_stream(inputs, chain.batches)

    def driver(parallelism: int, faults_spec: Optional[str]) -> Tuple[int, str]:
        argv = [sys.executable, os.path.join(HERE, "kill_driver.py"), "--base", base, "--input", inputs,
                "--checkpoint", ckpt, "--parallelism", str(parallelism), "--progress", progress,
                "--sink-log", sink_log]
        for opt in OPTIONS:
            argv += ["--option", opt]
        for kv in CONF:
            argv += ["--conf", kv]
        return _run(argv, faults_spec, log_path, jvm_options=JVM_OPTIONS)

    def rescale_cli(faults_spec: Optional[str]) -> Tuple[int, str]:
        argv = [sys.executable, "-m", "dstl", "state", "rescale", base,
                "--max-parallelism", str(NEW_MAX_PARALLELISM), "--json"]
        return _run(argv, faults_spec, log_path)

    # the runs: (kill or None for the clean last run, how to run it)
    runs: List[Tuple[Optional[Kill], Callable[[Optional[str]], Tuple[int, str]]]] = []
    for k in BATCH_KILLS + RESCALE_KILLS:
        p = k.parallelism
        runs.append((k, rescale_cli if k.batch is None else (lambda spec, p=p: driver(p, spec))))
    runs.append((None, lambda spec: driver(NEW_PARALLELISM, spec)))

    pending: List[Record] = []  # killed steps whose restart (the next driver run) has not run yet
    for kill, run in runs:
        if kill is None:
            specs = []
            for i, t in enumerate(TASK_TARGETS):
                marker = os.path.join(tmp, f"fired-{t.name}")
                chain.task_markers[t.name] = marker
                specs.append(t.spec(FIRST_TASK_KILL_BATCH + i, marker))
            spec = ",".join(specs) or None
        else:
            spec = kill.faults
        t0 = time.monotonic()
        rc, tail = run(spec)
        chain.seconds.append((kill.id if kill else "last run", time.monotonic() - t0))
        snap = observe(base, sink_log)
        is_driver = kill is None or kill.batch is not None
        if is_driver:  # this run restarted the query: it is the restart of every kill since the last
            for rec in pending:
                rec.after_restart, rec.restart_rc = snap, rc
            pending = []
        if kill is None:
            chain.final = snap
            chain.last_progress = _read_progress(progress)
            if rc != 0:
                chain.broken = f"the last run exited {rc}:\n{tail}"
            break
        rec = chain.records[kill.id] = Record(kill, rc, snap)
        pending.append(rec)
        if rc != -signal.SIGKILL:
            chain.broken = f"the run meant to be killed at {kill.id} exited {rc} instead:\n{tail}"
            break
    return chain


@pytest.fixture(scope="module")
def chain(tmp_path_factory) -> Chain:
    t0 = time.monotonic()
    c = run_chain(str(tmp_path_factory.mktemp("kills")))
    times = ", ".join(f"{n} {s:.0f}s" for n, s in c.seconds)
    sys.stderr.write(f"\nkill chain: {time.monotonic() - t0:.0f} s ({times})\n")
    return c


# --------------------------------------------------------------------------- checks
def _expected(chain: Chain):
    from streaming_util import normalize, reference_counts

    ref = reference_counts(chain.batches)
    return {b: normalize(g, COLS) for b, g in ref.groupby("batch_id")}


COLS = ["user", "events", "value_sum", "batches", "kinds", "top_kind_events"]


def _assert_exact_up_to(chain: Chain, snap: Snapshot, upto: int) -> None:
    """Batches 0..upto: committed once, row for row as pandas computes them; each sink call given
    exactly that batch's data; nothing committed beyond the latest checkpoint."""
    from streaming_util import normalize

    want = _expected(chain)
    assert upto <= snap.latest_batch, (upto, snap.checkpoints)
    for b in range(upto + 1):
        assert b in snap.committed, f"batch {b} not committed (partial: {snap.partial})"
        got = normalize(snap.committed[b], COLS)
        assert len(got) == len(want[b]) and got.equals(want[b]), f"batch {b}: output differs from pandas"
        rows, events = len(want[b]), int(want[b]["events"].sum())
        assert all(c == (rows, events) for c in snap.sink_calls.get(b, [])), (b, snap.sink_calls.get(b))
        if b in snap.markers:
            assert snap.sink_calls.get(b), f"batch {b}: a sink marker without a sink call"
    assert not [b for b in snap.committed if b > snap.latest_batch], "output committed past the checkpoint"


def _cp_batches(snap: Snapshot) -> List[int]:
    return [b for _, b, _, _ in snap.checkpoints]


def _check_at_kill(k: Kill, s: Snapshot, prev: Optional[Snapshot]) -> None:
    """What each step guarantees at the moment of the kill (docs/semantics.md, "Kills at every step")."""
    b = k.batch
    if k.point == "stream.before_tasks":
        assert b not in _cp_batches(s) and b not in s.committed and b not in s.partial
        assert not [f for f in s.staged if f"batch-{b:06d}" in f]
    elif k.point == "stream.after_tasks":
        assert b not in _cp_batches(s) and b not in s.committed
        assert [f for f in s.staged if f"batch-{b:06d}" in f], "the tasks staged no output"
        if k.parallelism != 2:  # the rescaled job: the restart's open already updated the job file
            assert s.job_max_parallelism == NEW_MAX_PARALLELISM
    elif k.point == "stream.after_checkpoint":
        assert s.latest_batch == b and b not in s.committed and b not in s.sink_calls
    elif k.point == "coordinator.mid_commit":
        assert s.latest_batch == b and b not in s.committed and s.partial.get(b) == 1, s.partial
    elif k.point == "stream.mid_sink":
        assert s.latest_batch == b and b in s.committed
        assert len(s.sink_calls.get(b, [])) == 1 and b not in s.markers
    elif k.point in ("coordinator.mid_gc_checkpoints", "coordinator.mid_gc_files"):
        assert s.latest_batch == b and b in s.committed and b not in s.sink_calls
        if k.point == "coordinator.mid_gc_checkpoints":
            assert len(s.checkpoints) == 2, s.checkpoints  # the oldest of three deleted
    elif k.point == "rescale.mid_write":
        assert prev is not None and s.checkpoints == prev.checkpoints, "a checkpoint appeared"
        assert s.job_max_parallelism == 128
    elif k.point == "rescale.after_checkpoint":
        cid, batch, maxp, p = s.checkpoints[-1]
        assert batch == LAST_P2_BATCH and maxp == NEW_MAX_PARALLELISM and p == 2, s.checkpoints
        assert s.job_max_parallelism == 128  # the job file is the last write; the query's open fixes it
    else:  # pragma: no cover - a new Kill needs its guarantee here
        raise AssertionError(f"no at-kill check for {k.point}")


ALL_KILLS = BATCH_KILLS + RESCALE_KILLS


@pytest.mark.timeout(1800)
@pytest.mark.parametrize("kill", ALL_KILLS, ids=[k.id for k in ALL_KILLS])
def test_kill_then_restart(chain, kill):
    rec = chain.records.get(kill.id)
    if rec is None:
        pytest.fail(f"the chain stopped before {kill.id}: {chain.broken}")
    assert rec.rc == -signal.SIGKILL
    i = ALL_KILLS.index(kill)
    prev = chain.records[ALL_KILLS[i - 1].id].at_kill if i else None
    _check_at_kill(kill, rec.at_kill, prev)
    if rec.after_restart is None:
        pytest.fail(f"no restart ran after {kill.id}: {chain.broken}")
    after = rec.after_restart
    # the restart got past the killed batch (or the rescale) and left every batch up to its latest
    # checkpoint exact; a rescale kill's restart runs at the new max parallelism
    done = kill.batch if kill.batch is not None else LAST_P2_BATCH
    assert after.latest_batch >= done
    _assert_exact_up_to(chain, after, done)
    if kill.batch is None or kill.parallelism != 2:
        assert after.checkpoints[-1][2] == NEW_MAX_PARALLELISM and after.job_max_parallelism == NEW_MAX_PARALLELISM


@pytest.mark.timeout(1800)
def test_the_whole_stream_is_exact(chain, capsys):
    """The end of the chain: all batches exact, the sink once per batch (twice for the batch killed in
    its sink, with the same data), the task-side kills fired and recovered, and nothing left over."""
    from dstl import cli

    if chain.broken is not None:
        pytest.fail(chain.broken)
    snap = chain.final
    assert snap.latest_batch == N_BATCHES - 1
    _assert_exact_up_to(chain, snap, N_BATCHES - 1)
    twice = {k.batch for k in ALL_KILLS if k.point == "stream.mid_sink"}
    assert {b: len(c) for b, c in snap.sink_calls.items()} == {
        b: 2 if b in twice else 1 for b in range(N_BATCHES)}
    cid, batch, maxp, p = snap.checkpoints[-1]
    assert (maxp, p) == (NEW_MAX_PARALLELISM, NEW_PARALLELISM)
    # the task-side kills: each fired once, and its batch restored the killed subtask's state
    done = {e["batch"]: e for e in chain.last_progress if e["phase"] == "done"}
    for i, t in enumerate(TASK_TARGETS):
        assert os.path.exists(chain.task_markers[t.name]), f"{t.name}: the kill did not fire"
        assert done[FIRST_TASK_KILL_BATCH + i]["restored"] >= 1, done[FIRST_TASK_KILL_BATCH + i]
    assert not snap.staged and not snap.partial, (snap.staged, snap.partial)
    capsys.readouterr()
    assert cli.main(["gc", chain.base, "--keep-latest", "2", "--grace", "0s"]) == 0
    out = capsys.readouterr().out
    assert "0 files (0 bytes) would delete" in out, out


def test_every_fault_point_is_documented():
    """Each `faults.point("<name>"...)` of the code (and each point this harness kills at) is in the
    table of dstl/spark/faults.py; each kill point of this harness in docs/semantics.md §15."""
    import re

    from dstl.spark import faults

    names = set()
    for dirpath, _, files in os.walk(os.path.join(ROOT, "dstl")):
        for f in files:
            if f.endswith(".py"):
                with open(os.path.join(dirpath, f)) as fh:
                    names |= set(re.findall(r'faults\.point\(\s*f?"([a-z_.{}]+)"', fh.read()))
    names = {n.replace("{step}", s) for n in names for s in ("mid_write", "after_checkpoint")}
    names = {n.replace("{at}", s) for n in names for s in ("stream", "timers")}
    names |= {k.point for k in ALL_KILLS}
    assert {"stream.before_tasks", "coordinator.mid_gc_files", "rescale.mid_write"} <= names
    undocumented = sorted(n for n in names if f"``{n}``" not in faults.__doc__)
    assert not undocumented, undocumented
    with open(os.path.join(ROOT, "docs", "semantics.md")) as fh:
        section = fh.read().split("## 15. Kills at every step", 1)[1]
    assert not sorted(k.point for k in ALL_KILLS if f"`{k.point}`" not in section)
