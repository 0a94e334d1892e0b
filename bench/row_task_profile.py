"""One subtask's share of a StatefulStream batch, in-process (no Spark job): where the task's time
goes for the Row API processor (RowUserTotals), the pandas one (UserTotals) and the vectorised fn.

Usage: .venv/bin/python bench/row_task_profile.py [--events 100000] [--keys 25000] [--batches 4]
       [--engines row,fn,pandas] [--profile row]

Per batch and engine: the processor call (for row: building the Rows, the handler loop with its
state calls, the output Arrow batch, timed apart), staging the output parquet and the state
snapshot, as the Spark task does them (dstl.spark.keyed.run_subtask's steps), on a real
KeyedStateBackend over a local changelog. Medians of batches 1.. (batch 0 fills the state).
"""
from __future__ import annotations

import argparse
import cProfile
import os
import pstats
import statistics
import sys
import tempfile
import time

HERE = os.path.dirname(os.path.abspath(__file__))
sys.path.insert(0, os.path.dirname(HERE))
sys.path.insert(0, HERE)
sys.path.insert(0, os.path.join(os.path.dirname(HERE), "tests"))

from _streaming_workload import OUTPUT, RowUserTotals, UserTotals, user_totals_fn  # noqa: E402


def _batches(n, events, keys):
    from streaming_util import make_batches

    import pandas as pd

    # as the Spark task gets the benchmark's stream (tests/streaming_util.read_stream): plus `ts`,
    # a timestamp (naive, in the session time zone, UTC)
    return [b[["user", "kind", "value", "ts_ms"]].assign(ts=pd.to_datetime(b["ts_ms"], unit="ms"))
            for b in make_batches(n, events, keys)]


def run(engine: str, batches, work: str, profile: bool = False):
    from dstl.changelog.storage import open_storage
    from dstl.spark import keyed as K
    from dstl.spark import processor as P
    from dstl.spark import rows as R
    from dstl.state.backend import KeyedStateBackend
    from dstl.state.schema import parse_ddl
    from dstl.types import KeyGroupRange

    st = open_storage(os.path.join(work, engine), upload_mode="direct")
    backend = KeyedStateBackend(st, "op", KeyGroupRange(0, 127), 128)
    arrow = K._arrow_output_schema(parse_ddl(OUTPUT))
    timings = []
    # time the Row pieces apart by wrapping them (same calls, same order as run_processor)
    split = {}
    orig_in, orig_to = R.InputRows.__init__, R.OutputRows.to_batch

    def timed_in(self, *a, **k):
        t = time.perf_counter()
        orig_in(self, *a, **k)
        split["rows_in"] = split.get("rows_in", 0.0) + time.perf_counter() - t

    def timed_to(self):
        t = time.perf_counter()
        out = orig_to(self)
        split["arrow_out"] = split.get("arrow_out", 0.0) + time.perf_counter() - t
        return out

    R.InputRows.__init__, R.OutputRows.to_batch = timed_in, timed_to
    proc = {"row": RowUserTotals(), "pandas": UserTotals(), "fn": user_totals_fn}[engine]
    schema = parse_ddl("user string, kind string, value long, ts_ms long, ts timestamp")
    try:
        for b, rows in enumerate(batches):
            split.clear()
            ctx = P.BatchContext(1000 + b, 0, "None", api="row" if engine == "row" else "pandas",
                                 input_schema=schema, time_zone="UTC", output_arrow_schema=arrow)
            fn = P.make_task_fn(proc, "user", ctx)
            prof = cProfile.Profile() if profile and b == len(batches) - 1 else None
            t0 = time.perf_counter()
            if prof:
                prof.enable()
            K._TASK["subtask"], K._TASK["metrics"] = 0, {}
            out = fn(rows, backend)
            if prof:
                prof.disable()
            t1 = time.perf_counter()
            staged = os.path.join(work, engine, f"out-{b}")
            os.makedirs(staged, exist_ok=True)
            _stage(out, arrow, os.path.join(staged, "part.parquet"))
            t2 = time.perf_counter()
            backend.snapshot(b + 1).result()
            t3 = time.perf_counter()
            d = {"process": (t1 - t0) * 1e3, "stage": (t2 - t1) * 1e3, "snapshot": (t3 - t2) * 1e3}
            d.update({k: v * 1e3 for k, v in split.items()})
            timings.append(d)
            if prof:
                pstats.Stats(prof).sort_stats("tottime").print_stats(18)
    finally:
        R.InputRows.__init__, R.OutputRows.to_batch = orig_in, orig_to
        backend.close()
        st.close()
    return timings


def _stage(out, arrow_schema, path):
    """What dstl.spark.keyed._write_staged does with the output (table, cast, parquet)."""
    import pyarrow as pa
    import pyarrow.parquet as pq

    if out is None:
        return
    if isinstance(out, pa.RecordBatch):
        table = pa.Table.from_batches([out]).select(arrow_schema.names).cast(arrow_schema)
    else:
        table = pa.Table.from_pandas(out[arrow_schema.names], schema=arrow_schema, preserve_index=False)
    pq.write_table(table, path)


def main(argv=None) -> int:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--events", type=int, default=100_000, help="events per subtask and batch")
    ap.add_argument("--keys", type=int, default=25_000)
    ap.add_argument("--batches", type=int, default=4)
    ap.add_argument("--engines", default="row,fn")
    ap.add_argument("--profile", default="", help="engine whose last batch is cProfiled")
    a = ap.parse_args(argv)
    batches = _batches(a.batches, a.events, a.keys)
    print(f"load {open('/proc/loadavg').read().split()[:3]}")
    with tempfile.TemporaryDirectory() as work:
        for engine in a.engines.split(","):
            t = run(engine, batches, work, profile=a.profile == engine)
            keys = list(t[0])
            cells = []
            for k in keys:
                xs = [d.get(k, 0.0) for d in t[1:]] or [t[0].get(k, 0.0)]
                cells.append(f"{k} {statistics.median(xs):.0f} ({min(xs):.0f}-{max(xs):.0f})")
            print(f"{engine:7s} ms: " + ", ".join(cells))
    print(f"load {open('/proc/loadavg').read().split()[:3]}")
    return 0


if __name__ == "__main__":
    sys.exit(main())
