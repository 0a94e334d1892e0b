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
]
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


def _git_commit() -> str:
    try:
        return subprocess.run(["git", "-C", REPO, "rev-parse", "--short", "HEAD"], capture_output=True,
                              text=True, timeout=10).stdout.strip()
    except (OSError, subprocess.SubprocessError):
        return ""


def run_rounds(args, jdk) -> dict:
    import _dstl_side as ds
    from dstl import IMPLEMENTATION, open_storage

    n = args.changes
    command = fetch.java_command(jdk, log)
    root = tempfile.mkdtemp(prefix="dstl-bench-flink-")
    harness = None
    storages = []
    try:
        log(f"preparing {n:,} changes on both sides")
        workload = ds.make_workload(n)
        harness = FlinkHarness(command, os.path.join(root, "flink"), n, ds.VALUE, ds.KEY_GROUPS, 1)
        # Opened once, as a task manager keeps its storage: the process-mode service stays warm.
        default = open_storage(os.path.join(root, "dstl-default"))
        thread = open_storage(os.path.join(root, "dstl-thread"), upload_mode="thread")
        storages = [default, thread]
        seconds: Dict[str, List[float]] = {key: [] for key, *_ in PATHS}
        shapes: Dict[str, dict] = {}
        for rnd in range(args.rounds + 1):
            counted = rnd > 0
            cp = rnd + 1
            log(f"round {rnd}/{args.rounds}" + ("" if counted else " (warm-up, not counted)"))
            times: Dict[str, float] = {}
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
            os.sync()
            times["plain_write"] = ds.write_plain(root, f"plain-{rnd}", workload)
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
            log("  " + "  ".join(f"{key} {n * ds.VALUE / 1e6 / t:.0f} MB/s" for key, t in times.items()))
        return summarise(args, seconds, shapes, IMPLEMENTATION, harness.java_version)
    finally:
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


def markdown_table(result: dict) -> str:
    """The results as the Markdown table docs/benchmarks.md quotes."""
    rows = ["| path | median | MB/s | dstl / Flink, same round: median (min-max) |", "|---|---|---|---|"]
    for key, system, kind, label in PATHS:
        p = result["paths"][key]
        ratio = p.get("ratio_vs_flink")
        r = f"**{ratio['median']:.2f}x** ({ratio['min']:.2f}-{ratio['max']:.2f})" if ratio else "baseline"
        rows.append(f"| {kind}, {system}: `{label}` | {p['median_seconds'] * 1000:.0f} ms | "
                    f"{p['median_mb_per_s']:.0f} | {r} |")
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
    fig.text(0.01, 0.005, "bars: median MB/s; whiskers: slowest and fastest round; Nx Flink: median of the "
             "same-round ratios. Shared, loaded 2-core machine.", fontsize=7, color="#555555")
    fig.tight_layout(rect=(0, 0.02, 1, 1))
    fig.savefig(path, dpi=110)
    plt.close(fig)


def main(argv=None) -> int:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--changes", type=int, default=1_000_000)
    ap.add_argument("--rounds", type=int, default=7, help="counted rounds, after one warm-up round")
    ap.add_argument("--out-dir", default=os.path.join(REPO, "bench", "results"))
    ap.add_argument("--no-chart", action="store_true", help="skip the PNG (no matplotlib needed)")
    ap.add_argument("--markdown-from", metavar="JSON", help="print the table of a saved run as Markdown and exit")
    args = ap.parse_args(argv)
    if args.markdown_from:
        with open(args.markdown_from) as f:
            print(markdown_table(json.load(f)))
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
            ap.error("the chart needs matplotlib: pip install 'dstl[bench]' (or pass --no-chart)")
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
