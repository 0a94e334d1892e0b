"""dstl side by side with Apache Flink 2.3's own DSTL (flink-dstl-dfs), in one run: `make bench-flink`.

Workload on both sides: N (default 1,000,000) random 100-byte changes over key groups 0..127 (change
i in key group i % 128), appended by one writer with default options to a local temporary
directory, persisted from the initial sequence number, then read back. Rounds interleave every path
(one warm-up round first, not counted), and the table gives medians and same-round ratios:

  write  Flink      writer.append(kg, byte[]) per change + persist   (FsStateChangelogWriter)
         dstl       append_many in 10,000-row calls + persist, upload.mode=process (the default)
         dstl       the same in upload.mode=thread
         dstl       writer.append(kg, data) per change in a Python loop + persist (default mode)
  read   Flink      for StateChange c : reader.getChanges(handle)    (StateChangelogHandleReader)
         dstl       reader.get_changes_arrays(handle)  (per change set: key groups, offsets, lengths)
         dstl       for c in reader.get_changes(handle)  (one StateChange object per change)

Needs a JDK (java + javac, from $JAVA_HOME/bin or PATH); without one it says so and exits 2. Flink's
jars are downloaded once into $DSTL_BENCH_CACHE (default ~/.cache/dstl-bench; see fetch.py).
Writes the figures to bench/results/flink.json and a bar chart to bench/results/flink.png.

Usage: .venv/bin/python bench/flink/run.py [--changes N] [--rounds R] [--out-dir DIR] [--no-chart]
       .venv/bin/python bench/flink/run.py --markdown-from bench/results/flink.json
"""
from __future__ import annotations

import argparse
import json
import os
import platform
import shutil
import statistics
import subprocess
import sys
import tempfile
import time
from typing import Dict, List

HERE = os.path.dirname(os.path.abspath(__file__))
REPO = os.path.dirname(os.path.dirname(HERE))
sys.path.insert(0, HERE)

import fetch  # noqa: E402  (standard library only: safe before the JDK check)

NO_JDK_MESSAGE = ("bench-flink: no JDK found: java and javac (JDK 17) are needed in $JAVA_HOME/bin "
                  "or on PATH")

# (key, system, kind, label)
PATHS = [
    ("flink_write", "Flink", "write", "writer.append(kg, byte[]) per change + persist"),
    ("dstl_write_vectorised_process", "dstl", "write", "append_many + persist, upload.mode=process (default)"),
    ("dstl_write_vectorised_thread", "dstl", "write", "append_many + persist, upload.mode=thread"),
    ("dstl_write_per_record", "dstl", "write", "writer.append(kg, data) per change + persist (default mode)"),
    ("plain_write", "floor", "write", "the payload as one buffer, one open().write() to a new file"),
    ("flink_read", "Flink", "read", "for c : reader.getChanges(handle)"),
    ("dstl_read_arrays", "dstl", "read", "reader.get_changes_arrays(handle)"),
    ("dstl_read_objects", "dstl", "read", "for c in reader.get_changes(handle)"),
    ("plain_read", "floor", "read", "that file read back with one readinto() (page cache warm)"),
]
# dstl path -> the floor it is measured against in the same round (throughput ratio path / floor)
FLOORS = {"dstl_write_vectorised_process": "plain_write", "dstl_write_vectorised_thread": "plain_write",
          "dstl_write_per_record": "plain_write", "dstl_read_arrays": "plain_read",
          "dstl_read_objects": "plain_read"}
UNSTABLE = 2.0  # a path whose slowest round took more than this times its fastest is flagged
BASELINE = {"write": "flink_write", "read": "flink_read"}


def log(message: str) -> None:
    print(message, file=sys.stderr, flush=True)


class FlinkHarness:
    """The Java harness as a long-lived child process: one command line in, one JSON line out."""

    def __init__(self, command: List[str], base_dir: str, n: int, value: int, key_groups: int, seed: int):
        self._stderr = tempfile.TemporaryFile()
        self.proc = subprocess.Popen(command + [base_dir, str(n), str(value), str(key_groups), str(seed)],
                                     stdin=subprocess.PIPE, stdout=subprocess.PIPE, stderr=self._stderr,
                                     text=True, bufsize=1)
        self.java_version = self._answer("ready")["java"]

    def _answer(self, op: str) -> dict:
        while True:
            line = self.proc.stdout.readline()
            if not line:
                self._stderr.seek(0)
                tail = self._stderr.read().decode(errors="replace")[-4000:]
                raise RuntimeError(f"the Flink harness exited (code {self.proc.poll()}) while we waited "
                                   f"for {op!r}; its stderr:\n{tail}")
            if line.startswith("{"):
                answer = json.loads(line)
                if answer.get("op") != op:
                    raise RuntimeError(f"the Flink harness answered {answer!r} to {op!r}")
                return answer

    def call(self, op: str) -> dict:
        self.proc.stdin.write(op + "\n")
        self.proc.stdin.flush()
        return self._answer(op)

    def close(self) -> None:
        try:
            if self.proc.poll() is None:
                self.proc.stdin.write("quit\n")
                self.proc.stdin.flush()
                self.proc.wait(timeout=60)
        except (OSError, subprocess.TimeoutExpired):
            pass
        finally:
            if self.proc.poll() is None:
                self.proc.kill()  # our own child, by its handle
                self.proc.wait()
            self._stderr.close()


STEADY = 1.10  # the JIT counts as warm once the median of the last STEADY_RUN calls is within this of
STEADY_RUN = 4  # the median of the STEADY_RUN before (single calls vary by +-20% on this machine)


def warm_flink(harness: FlinkHarness, payload: int, at_least: int, at_most: int = 40) -> dict:
    """Write and read on the Flink side until its throughput settles: a JVM gets faster for its first
    ten or more calls (C2 compiles, heap sizing), and a median over rounds that include them measures
    a cold Flink, not the warm task manager the targets name. Returns every call's MB/s."""
    mbs: Dict[str, List[float]] = {"write": [], "read": []}

    def steady(xs: List[float]) -> bool:
        if len(xs) < 2 * STEADY_RUN:
            return False
        last, before = statistics.median(xs[-STEADY_RUN:]), statistics.median(xs[-2 * STEADY_RUN:-STEADY_RUN])
        return last <= STEADY * before

    calls, settled = 0, False
    while calls < at_most and not settled:
        os.sync()
        for op in ("write", "read"):
            mbs[op].append(payload / 1e6 / harness.call(op)["seconds"])
        calls += 1
        settled = calls >= at_least and steady(mbs["write"]) and steady(mbs["read"])
    log(f"Flink JIT warm-up: {calls} writes and reads, MB/s write "
        + " ".join(f"{x:.0f}" for x in mbs["write"]) + ", read " + " ".join(f"{x:.0f}" for x in mbs["read"])
        + ("" if settled else f" (not steady after {at_most}: the rounds go on anyway)"))
    return {"calls": calls, "write_mb_s": mbs["write"], "read_mb_s": mbs["read"], "steady_within": STEADY,
            "steady": settled}


def _git_commit() -> str:
    try:
        return subprocess.run(["git", "-C", REPO, "rev-parse", "--short", "HEAD"], capture_output=True,
                              text=True, timeout=10).stdout.strip()
    except (OSError, subprocess.SubprocessError):
        return ""


def run_rounds(args, jdk) -> dict:
    import _dstl_side as ds
    import phases as ph
    from dstl import IMPLEMENTATION, open_storage

    n = args.changes
    command = fetch.java_command(jdk, log)
    root = tempfile.mkdtemp(prefix="dstl-bench-flink-")
    harness = None
    storages = []
    meter = None
    try:
        log(f"preparing {n:,} changes on both sides")
        workload = ds.make_workload(n)
        harness = FlinkHarness(command, os.path.join(root, "flink"), n, ds.VALUE, ds.KEY_GROUPS, 1)
        jit = warm_flink(harness, n * ds.VALUE, args.flink_warmup)
        # Opened once, as a task manager keeps its storage: the process-mode service stays warm.
        default = open_storage(os.path.join(root, "dstl-default"))
        thread = open_storage(os.path.join(root, "dstl-thread"), upload_mode="thread")
        storages = [default, thread]
        meter = ph.Phases(root, workload)
        seconds: Dict[str, List[float]] = {key: [] for key, *_ in PATHS}
        shapes: Dict[str, dict] = {}
        extra: List[Dict[str, float]] = []  # per counted round: phases, splits, floors, keyed state
        load = {"start": os.getloadavg(), "rounds": []}
        for rnd in range(args.rounds + 1):
            counted = rnd > 0
            cp = rnd + 1
            log(f"round {rnd}/{args.rounds}" + ("" if counted else " (warm-up, not counted)"))
            times: Dict[str, float] = {}
            more: Dict[str, float] = {}
            os.sync()  # write-back of the previous round must not land in this one
            w = harness.call("write")
            r = harness.call("read")
            if r["changes"] != n or r["bytes"] != n * ds.VALUE:
                raise RuntimeError(f"Flink read back {r['changes']} changes / {r['bytes']} bytes, expected {n}")
            times["flink_write"], times["flink_read"] = w["seconds"], r["seconds"]
            shapes["flink_write"] = {k: w[k] for k in ("change_sets", "files", "file_bytes")}
            handles = {}
            for key, storage, fn in (
                    ("dstl_write_vectorised_process", default, ds.write_vectorised),
                    ("dstl_write_vectorised_thread", thread, ds.write_vectorised),
                    ("dstl_write_per_record", default, ds.write_per_record)):
                os.sync()
                times[key], handles[key] = fn(storage, f"{key}-{rnd}", workload, cp)
                shapes[key] = ds.handle_shape(handles[key])
                more[f"{key}.appends"] = ds.LAST_SPLIT["appends"]
                more[f"{key}.tail"] = ds.LAST_SPLIT["tail"]
                more[f"{key}.cpu"] = ds.LAST_SPLIT.get("cpu", 0.0)
            os.sync()
            floors = meter.plain_write_read(f"plain-{rnd}")
            more["plain_write_cpu"] = floors.pop("plain_write_cpu")
            times.update(floors)
            os.sync()
            more.update({f"phase.{k}": v for k, v in meter.write_phases().items()})
            more.update(meter.append_calls(default))
            more.update({f"state_ns.{k}": v for k, v in meter.keyed_state(default).items()})
            readable = handles["dstl_write_vectorised_process"]
            for key, fn in (("dstl_read_arrays", ds.read_arrays), ("dstl_read_objects", ds.read_objects)):
                times[key], count = fn(default, readable)
                if count != n:
                    raise RuntimeError(f"{key} read back {count} changes, expected {n}")
            if not counted:
                for key, handle in handles.items():
                    got = ds.payload_bytes(default, handle)
                    if got != n * ds.VALUE:
                        raise RuntimeError(f"{key}: read back {got} payload bytes, expected {n * ds.VALUE}")
            ds.discard(list(handles.values()))
            if counted:
                for key, t in times.items():
                    seconds[key].append(t)
                extra.append(more)
                load["rounds"].append(os.getloadavg()[0])
            log("  " + "  ".join(f"{key} {n * ds.VALUE / 1e6 / t:.0f} MB/s" for key, t in times.items())
                + f"  load {os.getloadavg()[0]:.1f}")
        load["end"] = os.getloadavg()
        result = summarise(args, seconds, shapes, IMPLEMENTATION, harness.java_version)
        result["flink"]["jit_warmup"] = jit
        add_hot_paths(result, extra, load)
        return result
    finally:
        if meter is not None:
            meter.close()
        for storage in storages:
            storage.close()
        if harness is not None:
            harness.close()
        shutil.rmtree(root, ignore_errors=True)


def summarise(args, seconds: Dict[str, List[float]], shapes: Dict[str, dict], implementation: str,
              java_version: str) -> dict:
    import _dstl_side as ds

    n = args.changes
    mb = n * ds.VALUE / 1e6
    paths = {}
    for key, system, kind, label in PATHS:
        ts = seconds[key]
        entry = {"system": system, "kind": kind, "label": label, "seconds": ts,
                 "median_seconds": statistics.median(ts), "median_mb_per_s": mb / statistics.median(ts),
                 "median_changes_per_s": n / statistics.median(ts)}
        if key in shapes:
            entry["persisted"] = shapes[key]
        base = BASELINE[kind]
        if key != base:
            # dstl / Flink throughput in each round: both sides of a ratio ran seconds apart.
            per_round = [b / t for t, b in zip(ts, seconds[base])]
            entry["ratio_vs_flink"] = {"median": statistics.median(per_round), "min": min(per_round),
                                       "max": max(per_round), "per_round": per_round}
        paths[key] = entry
    return {
        "benchmark": "dstl vs Apache Flink 2.3 DSTL (flink-dstl-dfs), same run, interleaved rounds",
        "workload": {"changes": n, "value_bytes": ds.VALUE, "key_groups": ds.KEY_GROUPS,
                     "payload_mb": mb, "append_many_rows": ds.sd.CHUNK, "storage": "local temporary directory",
                     "options": "defaults on both sides"},
        "rounds": args.rounds, "warmup_rounds": 1,
        "dstl": {"implementation": implementation, "commit": _git_commit()},
        "flink": {"version": fetch.FLINK_VERSION, "java": java_version},
        "machine": {"cpus": os.cpu_count(), "platform": platform.platform(),
                    "python": platform.python_version(), "loadavg_1m_at_end": os.getloadavg()[0],
                    "note": "shared machine, other jobs running: figures are noisy"},
        "measured_at": time.strftime("%Y-%m-%dT%H:%M:%SZ", time.gmtime()),
        "paths": paths,
    }


def _stats(values: List[float]) -> dict:
    return {"median": statistics.median(values), "min": min(values), "max": max(values), "per_round": values}


# (key, what, target, met(value)): the hot-path targets, checked on same-round medians
GOALS = [
    ("vs_floor.dstl_write_vectorised_process", "vectorised write, process mode / plain write()", ">= 0.8",
     lambda v: v >= 0.8),
    ("vs_floor.dstl_write_vectorised_thread", "vectorised write, thread mode / plain write()", ">= 0.8",
     lambda v: v >= 0.8),
    ("ratio_vs_flink.dstl_write_per_record", "per-record append + persist / warm Flink", ">= 1.0x",
     lambda v: v >= 1.0),
    ("per_record.append_vs_call_floor", "per-record append call / no-op C call (time, same loop)", "<= 1.3",
     lambda v: v <= 1.3),
    ("keyed_state.update_vs_call_floor", "ValueState.update per key / no-op C call (time)", "<= 1.3",
     lambda v: v <= 1.3),
    ("keyed_state.get_vs_call_floor", "ValueState.get per key / no-op C call (time)", "<= 1.3",
     lambda v: v <= 1.3),
    ("ratio_vs_flink.dstl_read_objects", "restore as objects / warm Flink", ">= 1.5x", lambda v: v >= 1.5),
    ("vs_floor.dstl_read_arrays", "restore as arrays / plain read()", ">= 0.8", lambda v: v >= 0.8),
]


def add_hot_paths(result: dict, extra: List[Dict[str, float]], load: dict) -> None:
    """Adds the floors, the phases, the keyed-state calls, the load and the goals to `result`."""
    paths = result["paths"]
    n = result["workload"]["changes"]
    seconds = {key: p["seconds"] for key, p in paths.items()}
    vs_floor = {}
    for key, floor in FLOORS.items():
        vs_floor[key] = _stats([f / t for t, f in zip(seconds[key], seconds[floor])])
        paths[key]["ratio_vs_floor"] = vs_floor[key]
    col = {k: [r[k] for r in extra] for k in (extra[0] if extra else {})}
    ns = lambda xs: [x / n * 1e9 for x in xs]  # noqa: E731
    append_ns = ns(col["append_calls"])
    floor_ns = ns(col["call_floor"])
    per_record = {
        "append_call_ns": _stats(append_ns), "call_floor_ns": _stats(floor_ns),
        "append_loop_ns": _stats(ns(col["dstl_write_per_record.appends"])),
        "append_plus_persist_ns": _stats(ns(seconds["dstl_write_per_record"])),
        "flink_ns": _stats(ns(seconds["flink_write"])),
        "append_vs_call_floor": _stats([a / f for a, f in zip(append_ns, floor_ns)]),
    }
    state = {k.split(".", 1)[1]: _stats(v) for k, v in col.items() if k.startswith("state_ns.")}
    state["update_vs_call_floor"] = _stats([u / f for u, f in zip(col["state_ns.value_update"], floor_ns)])
    state["get_vs_call_floor"] = _stats([g / f for g, f in zip(col["state_ns.value_get"], floor_ns)])
    state["update_vs_dict"] = _stats([u / d for u, d in zip(col["state_ns.value_update"], col["state_ns.dict_set"])])
    state["get_vs_dict"] = _stats([g / d for g, d in zip(col["state_ns.value_get"], col["state_ns.dict_get"])])
    phases = {k.split(".", 1)[1]: _stats([x * 1000 for x in v]) for k, v in col.items() if k.startswith("phase.")}
    phases["bodies"] = col["phase.bodies"][0] if col.get("phase.bodies") else 0
    for key in ("dstl_write_vectorised_process", "dstl_write_vectorised_thread", "dstl_write_per_record"):
        phases[f"{key}.appends"] = _stats([x * 1000 for x in col[f"{key}.appends"]])
        phases[f"{key}.tail"] = _stats([x * 1000 for x in col[f"{key}.tail"]])
    for key in ("dstl_write_vectorised_process", "dstl_write_vectorised_thread"):
        phases[f"{key}.cpu"] = _stats([x * 1000 for x in col[f"{key}.cpu"]])
    phases["plain_write_cpu"] = _stats([x * 1000 for x in col["plain_write_cpu"]])
    result["vs_floor"] = vs_floor
    result["per_record"] = per_record
    result["keyed_state"] = state
    result["phases_ms"] = phases
    spread = {key: max(ts) / min(ts) for key, ts in seconds.items() if min(ts) > 0}
    unstable = {key: s for key, s in spread.items() if s > UNSTABLE}
    result["load"] = {"loadavg_at_start": list(load["start"]), "loadavg_1m_per_round": load["rounds"],
                      "loadavg_at_end": list(load["end"]), "slowest_over_fastest_round": spread,
                      "unstable_paths": unstable, "rounds_disagree": bool(unstable)}
    result["machine"]["loadavg_1m_at_end"] = load["end"][0]
    lookup = {"vs_floor": vs_floor, "per_record": per_record, "keyed_state": state,
              "ratio_vs_flink": {k: p["ratio_vs_flink"] for k, p in paths.items() if "ratio_vs_flink" in p}}
    goals = []
    for ref, what, goal, ok in GOALS:
        group, key = ref.split(".", 1)
        stats = lookup[group][key]
        value = stats["median"]
        # a ratio whose own rounds disagree by more than UNSTABLE says little either way
        conclusive = min(stats["per_round"]) > 0 and max(stats["per_round"]) / min(stats["per_round"]) <= UNSTABLE
        goals.append({"ref": ref, "goal": what, "target": goal, "median": value, "min": stats["min"], "max": stats["max"],
                      "met": bool(ok(value)), "conclusive": conclusive})
    result["goals"] = goals


def print_hot_paths(result: dict) -> None:
    if "phases_ms" not in result:
        return
    ph, pr, ks, ld = result["phases_ms"], result["per_record"], result["keyed_state"], result["load"]
    print("\nphases of one vectorised write, ms (median, min-max):")
    for line in phase_rows(result):
        print("  " + " | ".join(line))
    print(f"\nper record: append call {pr['append_call_ns']['median']:.0f} ns (in the write, with uploads "
          f"beside it: {pr['append_loop_ns']['median']:.0f} ns), no-op C call "
          f"{pr['call_floor_ns']['median']:.0f} ns, ratio {pr['append_vs_call_floor']['median']:.2f} "
          f"({pr['append_vs_call_floor']['min']:.2f}-{pr['append_vs_call_floor']['max']:.2f}); with persist "
          f"{pr['append_plus_persist_ns']['median']:.0f} ns, Flink {pr['flink_ns']['median']:.0f} ns")
    print(f"keyed state per key: ValueState.update {ks['value_update']['median']:.0f} ns, get "
          f"{ks['value_get']['median']:.0f} ns; dict set {ks['dict_set']['median']:.0f} ns, get "
          f"{ks['dict_get']['median']:.0f} ns")
    print(f"load average: start {ld['loadavg_at_start'][0]:.1f}, rounds "
          f"{', '.join(f'{x:.1f}' for x in ld['loadavg_1m_per_round'])}, end {ld['loadavg_at_end'][0]:.1f}")
    if ld["rounds_disagree"]:
        print("WARNING: rounds disagree by more than 2x (slowest/fastest): " +
              ", ".join(f"{k} {v:.1f}x" for k, v in ld["unstable_paths"].items()))
    print("\ngoals (same-round medians):")
    for g in result["goals"]:
        print(f"  {g['goal']:60s} {g['target']:>7s}  {g['median']:6.2f} ({g['min']:.2f}-{g['max']:.2f})  "
              f"{'met' if g['met'] else 'MISSED'}{'' if g['conclusive'] else ' (rounds disagree >2x: inconclusive)'}")


def _ms(s: dict) -> str:
    return f"{s['median']:.1f} ({s['min']:.1f}-{s['max']:.1f})"


def phase_rows(result: dict) -> List[List[str]]:
    """Rows (phase, thread mode, process mode) of the breakdown, in ms."""
    ph = result["phases_ms"]
    proc, thr = "dstl_write_vectorised_process", "dstl_write_vectorised_thread"
    paths = result["paths"]
    total = lambda key: _stats([t * 1000 for t in paths[key]["seconds"]])  # noqa: E731
    return [
        ["end to end: append_many calls + persist", _ms(total(thr)), _ms(total(proc))],
        ["  appending thread: every append_many call, hand-offs included", _ms(ph[f"{thr}.appends"]),
         _ms(ph[f"{proc}.appends"])],
        ["  tail: persist() until the handle (batching delay, last upload, metadata, acknowledgement)",
         _ms(ph[f"{thr}.tail"]), _ms(ph[f"{proc}.tail"])],
        ["  CPU time of the write: every thread, and in process mode the service's processes",
         _ms(ph[f"{thr}.cpu"]), _ms(ph[f"{proc}.cpu"])],
        ["on its own: framing and packing (append_many + seal_body, payload referenced)", _ms(ph["pack"]),
         _ms(ph["pack"])],
        ["on its own: body copy (canonical layout): in 512 KiB pieces / into shared memory",
         _ms(ph["body_copy"]), _ms(ph["body_copy_shm"])],
        ["on its own: file write of the laid-out bodies / shared memory -> file (kept mapping)",
         _ms(ph["file_write"]), _ms(ph["shm_to_file"])],
        ["on its own: a thread-mode upload of all bodies (`write_bodies`: layout piece by piece + write)",
         _ms(ph["thread_upload"]), ""],
        ["floor: plain write() of the payload", _ms(total("plain_write")), _ms(total("plain_write"))],
        ["floor: CPU time of that plain write()", _ms(ph["plain_write_cpu"]), _ms(ph["plain_write_cpu"])],
        ["floor: plain readinto() of that file", _ms(total("plain_read")), _ms(total("plain_read"))],
    ]


def hot_path_markdown(result: dict) -> str:
    """The phases and per-call tables for docs/benchmarks.md."""
    if "phases_ms" not in result:
        return ""
    pr, ks, ld = result["per_record"], result["keyed_state"], result["load"]
    out = ["| phase (ms, median (min-max)) | thread mode | process mode (default) |", "|---|---|---|"]
    out += [f"| {a} | {b} | {c} |" for a, b, c in phase_rows(result)]
    r = lambda s, f="{:.0f}": f"{f.format(s['median'])} ({f.format(s['min'])}-{f.format(s['max'])})"  # noqa: E731
    out += ["", "| per call, same run | ns: median (min-max) | ratio: median (min-max) |", "|---|---|---|",
            f"| no-op C call loop: `operator.is_(kg, v)` | {r(pr['call_floor_ns'])} | 1 |",
            f"| `writer.append(kg, v)`, the same loop, nothing uploading beside it | "
            f"{r(pr['append_call_ns'])} | {r(pr['append_vs_call_floor'], '{:.2f}')} of the call loop |",
            f"| `writer.append(kg, v)` in the per-record write (uploads and pre-emptive persists beside it) | "
            f"{r(pr['append_loop_ns'])} | |",
            f"| the same + final `persist` | {r(pr['append_plus_persist_ns'])} | |",
            f"| Flink: `writer.append` + persist | {r(pr['flink_ns'])} | |",
            f"| `d[k] = v` | {r(ks['dict_set'])} | |",
            f"| `ValueState.update(k, v)` | {r(ks['value_update'])} | {r(ks['update_vs_call_floor'], '{:.2f}')} "
            f"of the call loop, {r(ks['update_vs_dict'], '{:.2f}')} of the dict |",
            f"| `d.get(k)` | {r(ks['dict_get'])} | |",
            f"| `ValueState.get(k)` | {r(ks['value_get'])} | {r(ks['get_vs_call_floor'], '{:.2f}')} of the call "
            f"loop, {r(ks['get_vs_dict'], '{:.2f}')} of the dict |"]
    flag = ("rounds disagree by more than 2x: " + ", ".join(f"`{k}` {v:.1f}x" for k, v in ld["unstable_paths"].items())
            if ld["rounds_disagree"] else "no path's slowest round took more than 2x its fastest")
    out += ["", f"Load average (1 min): {ld['loadavg_at_start'][0]:.1f} at the start, "
            f"{', '.join(f'{x:.1f}' for x in ld['loadavg_1m_per_round'])} after each round, "
            f"{ld['loadavg_at_end'][0]:.1f} at the end; {flag}."]
    return "\n".join(out)


README_ROWS = [  # (path, label) of the README's table
    ("dstl_write_vectorised_thread", "`append_many` + `persist`, `thread` mode"),
    ("dstl_write_vectorised_process", "`append_many` + `persist`, default (`process`) mode"),
    ("dstl_write_per_record", "per-record `writer.append` + `persist`, default mode"),
    ("plain_write", "floor: the payload as one buffer, one `write()` to a new file"),
    ("dstl_read_arrays", "read back as arrays (`get_changes_arrays`)"),
    ("dstl_read_objects", "`for c in get_changes(...)` (one `StateChange` per change)"),
    ("plain_read", "floor: one `readinto()` of the same bytes"),
]


def readme_table(result: dict) -> str:
    """The README's table: MB/s and the same-round ratios to Flink and to the floor."""
    paths = result["paths"]
    rows = ["| path | MB/s | / Flink, same round | / floor, same round |", "|---|---|---|---|"]
    for key, label in README_ROWS:
        p = paths[key]
        r = lambda x: f"{x['median']:.2f} ({x['min']:.2f}-{x['max']:.2f})" if x else ""  # noqa: E731
        rows.append(f"| {label} | {p['median_mb_per_s']:,.0f} | {r(p.get('ratio_vs_flink'))} | "
                    f"{r(p.get('ratio_vs_floor'))} |")
    return "\n".join(rows)


def print_table(result: dict) -> None:
    w = result["workload"]
    print(f"dstl ({result['dstl']['implementation']}) vs Flink {result['flink']['version']} DSTL, "
          f"{w['changes']:,} x {w['value_bytes']} B changes over {w['key_groups']} key groups, "
          f"medians of {result['rounds']} interleaved rounds")
    print(f"  {'path':72s} {'median':>9s} {'MB/s':>7s}  {'dstl/Flink (min-max)':>22s}")
    for key, system, kind, label in PATHS:
        p = result["paths"][key]
        ratio = p.get("ratio_vs_flink")
        r = f"{ratio['median']:5.2f}x ({ratio['min']:.2f}-{ratio['max']:.2f})" if ratio else "baseline"
        name = f"{kind:5s} {system:5s} {label}"
        print(f"  {name:72s} {p['median_seconds'] * 1000:7.0f} ms {p['median_mb_per_s']:7.0f}  {r:>22s}")
    print("  (shared, loaded 2-core machine: quote medians and same-run ratios only)")
    print_hot_paths(result)


def markdown_table(result: dict) -> str:
    """The results as the Markdown table docs/benchmarks.md quotes: per path the median, MB/s, and the
    same-round ratios to Flink and to the floor (median, lowest and highest round)."""
    rows = ["| path | median | MB/s | dstl / Flink, same round | / floor, same round |", "|---|---|---|---|---|"]
    r = lambda x: f"{x['median']:.2f} ({x['min']:.2f}-{x['max']:.2f})" if x else ""  # noqa: E731
    for key, system, kind, label in PATHS:
        p = result["paths"][key]
        ratio = p.get("ratio_vs_flink")
        to_flink = f"**{r(ratio).replace(' ', 'x ', 1)}**" if ratio else "baseline"
        rows.append(f"| {kind}, {system}: `{label}` | {p['median_seconds'] * 1000:.0f} ms | "
                    f"{p['median_mb_per_s']:.0f} | {to_flink} | {r(p.get('ratio_vs_floor'))} |")
    return "\n".join(rows)


def write_chart(result: dict, path: str) -> None:
    import matplotlib

    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    fig, axes = plt.subplots(2, 1, figsize=(9, 5.6), gridspec_kw={"height_ratios": [4, 3]})
    for ax, kind in zip(axes, ("write", "read")):
        rows = [(key, system, label) for key, system, k, label in PATHS if k == kind][::-1]
        values = [result["paths"][key]["median_mb_per_s"] for key, _, _ in rows]
        colors = [{"Flink": "#9e9e9e", "floor": "#d9d9d9"}.get(system, "#1f77b4") for _, system, _ in rows]
        # whiskers: the slowest and the fastest round
        mb = result["workload"]["payload_mb"]
        lows = [v - mb / max(result["paths"][key]["seconds"]) for (key, _, _), v in zip(rows, values)]
        highs = [mb / min(result["paths"][key]["seconds"]) - v for (key, _, _), v in zip(rows, values)]
        ax.barh([f"{system}: {label}" for _, system, label in rows], values, color=colors,
                xerr=[lows, highs], error_kw={"elinewidth": 0.8, "ecolor": "#555555", "capsize": 2})
        for i, (key, system, _) in enumerate(rows):
            ratio = result["paths"][key].get("ratio_vs_flink")
            text = f" {values[i]:.0f} MB/s" + (f"  ({ratio['median']:.2f}x Flink)" if ratio else "")
            ax.text(values[i] + highs[i], i, text, va="center", fontsize=8)
        ax.set_xlim(0, max(v + h for v, h in zip(values, highs)) * 1.6)
        ax.set_title(f"{kind}", loc="left", fontsize=10)
        ax.tick_params(axis="y", labelsize=8)
    axes[-1].set_xlabel("MB/s of payload (median)")
    w = result["workload"]
    fig.suptitle(f"dstl vs Apache Flink {result['flink']['version']} DSTL: {w['changes']:,} x {w['value_bytes']} B "
                 f"changes, {w['key_groups']} key groups, local disk, medians of {result['rounds']} rounds",
                 fontsize=9)
    load = result.get("load")
    where = (f"load average {min(load['loadavg_1m_per_round']):.1f}-{max(load['loadavg_1m_per_round']):.1f} "
             f"during the rounds" if load and load.get("loadavg_1m_per_round") else "shared machine")
    fig.text(0.01, 0.005, "bars: median MB/s; whiskers: slowest and fastest round; Nx Flink: median of the "
             f"same-round ratios. 2 cores, {where}.", fontsize=7, color="#555555")
    fig.tight_layout(rect=(0, 0.02, 1, 1))
    fig.savefig(path, dpi=110)
    plt.close(fig)


def main(argv=None) -> int:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--changes", type=int, default=1_000_000)
    ap.add_argument("--rounds", type=int, default=7, help="counted rounds, after one warm-up round")
    ap.add_argument("--flink-warmup", type=int, default=10,
                    help="Flink-only write+read calls before the rounds, at least (more until steady)")
    ap.add_argument("--out-dir", default=os.path.join(REPO, "bench", "results"))
    ap.add_argument("--no-chart", action="store_true", help="skip the PNG (no matplotlib needed)")
    ap.add_argument("--markdown-from", metavar="JSON", help="print the table of a saved run as Markdown and exit")
    args = ap.parse_args(argv)
    if args.markdown_from:
        with open(args.markdown_from) as f:
            saved = json.load(f)
        print(markdown_table(saved))
        print()
        print(hot_path_markdown(saved))
        if "vs_floor" in saved:
            print()
            print(readme_table(saved))
        return 0
    jdk = fetch.find_jdk()
    if jdk is None:
        print(NO_JDK_MESSAGE, file=sys.stderr)
        return 2
    if args.changes < 1 or args.rounds < 1:
        ap.error("--changes and --rounds must be at least 1")
    if not args.no_chart:
        try:
            import matplotlib  # noqa: F401
        except ImportError:
            ap.error("the chart needs matplotlib: pip install 'pyspark-dstl[bench]' (or pass --no-chart)")
    result = run_rounds(args, jdk)
    print_table(result)
    os.makedirs(args.out_dir, exist_ok=True)
    json_path = os.path.join(args.out_dir, "flink.json")
    with open(json_path, "w") as f:
        json.dump(result, f, indent=1)
        f.write("\n")
    print(f"wrote {json_path}")
    if not args.no_chart:
        png_path = os.path.join(args.out_dir, "flink.png")
        write_chart(result, png_path)
        print(f"wrote {png_path}")
    return 0


if __name__ == "__main__":
    sys.exit(main())
