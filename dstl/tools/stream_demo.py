"""`dstl demo --streaming`: a JSON file stream through StatefulStream, with a kill and a rescale.

1. Synthetic events are written as one JSON file per micro-batch.
2. A Structured Streaming driver (a child process, its own Spark) runs them through `StatefulStream`
   at parallelism 2 and is SIGKILLed right after a checkpoint became durable, before that batch's
   output commit (the fault hook, DSTL_FAULTS=stream.after_checkpoint@K=kill).
3. A second driver resumes with the same Spark checkpoint at parallelism 3: Spark replays the
   interrupted batch (dstl only finishes its output), the state is rescaled from 2 to 3 subtasks.
4. The committed output (`output/batch_id=N/`) is checked against pandas over all input: every row
   present once, every count exact.

The driver is this module: ``python -m dstl.tools.stream_demo driver BASE INPUT CKPT PARALLELISM``.
"""
from __future__ import annotations

import argparse
import json
import os
import signal
import subprocess
import sys
import time
from typing import List, Optional

OUTPUT_DDL = "user string, events long, total long, distinct_items long"
INPUT_DDL = "user string, item long, amount long"


def _processor():
    import pandas as pd
    from pyspark.sql.streaming.stateful_processor import StatefulProcessor

    class UserTotals(StatefulProcessor):
        """Per user: events and amount so far (value state) and the distinct items (map state)."""

        def init(self, handle):
            self.totals = handle.getValueState("totals", "events long, total long")
            self.items = handle.getMapState("items", "item long", "seen long")

        def handleInputRows(self, key, rows, timerValues):
            events, total = self.totals.get() if self.totals.exists() else (0, 0)
            for pdf in rows:
                events += len(pdf)
                total += int(pdf["amount"].sum())
                for item in pdf["item"].unique().tolist():
                    old = self.items.getValue((item,))
                    self.items.updateValue((item,), ((old[0] if old else 0) + 1,))
            self.totals.update((events, total))
            yield pd.DataFrame({"user": [key[0]], "events": [events], "total": [total],
                                "distinct_items": [len(list(self.items.keys()))]})

        def close(self):
            pass

    return UserTotals()


def write_inputs(input_dir: str, events: int, batches: int, users: int = 500, seed: int = 7) -> List:
    import numpy as np
    import pandas as pd

    os.makedirs(input_dir, exist_ok=True)
    rng = np.random.default_rng(seed)
    per = max(1, events // batches)
    frames = []
    for b in range(batches):
        pdf = pd.DataFrame({"user": [f"user-{u}" for u in rng.integers(0, users, per)],
                            "item": rng.integers(0, 50, per), "amount": rng.integers(1, 100, per)})
        path = os.path.join(input_dir, f"events-{b:04d}.json")
        with open(path, "w") as f:
            for rec in pdf.to_dict("records"):
                f.write(json.dumps({k: (int(v) if k != "user" else v) for k, v in rec.items()}) + "\n")
        os.utime(path, (1_700_000_000 + b, 1_700_000_000 + b))  # file order = batch order
        frames.append(pdf)
    return frames


def expected_output(frames):
    """Every output row, computed with pandas over all input."""
    import pandas as pd

    rows = []
    seen = pd.DataFrame(columns=["user", "item", "amount"])
    for b, pdf in enumerate(frames):
        seen = pd.concat([seen, pdf], ignore_index=True)
        mine = seen[seen["user"].isin(set(pdf["user"]))]
        agg = mine.groupby("user").agg(events=("item", "size"), total=("amount", "sum"),
                                       distinct_items=("item", "nunique")).reset_index()
        agg.insert(0, "batch_id", b)
        rows.append(agg)
    out = pd.concat(rows, ignore_index=True)
    return out.astype({"batch_id": "int64", "events": "int64", "total": "int64", "distinct_items": "int64"})


def read_output(output_dir: str):
    import pyarrow.dataset as ds

    got = ds.dataset(output_dir, format="parquet", partitioning="hive").to_table().to_pandas()
    cols = ["batch_id", "user", "events", "total", "distinct_items"]
    return got[cols].astype({"batch_id": "int64"}).sort_values(["batch_id", "user"]).reset_index(drop=True)


def driver(base: str, input_dir: str, ckpt: str, parallelism: int, master: str) -> int:
    """One Structured Streaming driver: every available file, one per micro-batch, then exit."""
    os.environ.setdefault("PYSPARK_PYTHON", sys.executable)
    from pyspark.sql import SparkSession

    from dstl.spark import StatefulStream

    spark = (SparkSession.builder.master(master).appName("dstl-demo-streaming")
             .config("spark.ui.enabled", "false").config("spark.ui.showConsoleProgress", "false")
             .config("spark.driver.host", "127.0.0.1").config("spark.driver.bindAddress", "127.0.0.1")
             .config("spark.sql.shuffle.partitions", "4").getOrCreate())
    spark.sparkContext.setLogLevel("ERROR")
    stream = StatefulStream(base, _processor(), OUTPUT_DDL, key="user", parallelism=parallelism)

    def each_batch(df, batch_id):
        res = stream(df, batch_id)
        what = "replayed: no state change, output commit finished" if res.replayed else (
            f"{res.rows_in:,} events, {res.restored} subtasks restored" if res.restored else
            f"{res.rows_in:,} events, {sum(r.continued for r in res.reports)}/{len(res.reports)} "
            f"subtasks continued from memory")
        print(f"  batch {batch_id} at parallelism {parallelism}: {what} ({res.seconds:.1f} s)", flush=True)

    run_file_stream(spark, each_batch, INPUT_DDL, input_dir, ckpt)
    stream.close()
    spark.stop()
    return 0


def run_file_stream(spark, foreach_batch, input_ddl: str, input_dir: str, checkpoint: str) -> None:
    """Feed every JSON file of `input_dir`, one per trigger, to `foreach_batch` until none is left."""
    events = spark.readStream.schema(input_ddl).option("maxFilesPerTrigger", 1).json(input_dir)
    query = (events.writeStream.foreachBatch(foreach_batch).option("checkpointLocation", checkpoint)
             .trigger(availableNow=True).start())
    query.awaitTermination()


def _run_child(args: List[str], faults_spec: Optional[str], log_path: str) -> int:
    """Run one driver; its progress lines go to our stdout, Spark's console noise to `log_path`
    (a SIGKILLed driver leaves its JVM to report the lost Python callback at length)."""
    import dstl

    env = dict(os.environ)
    root = os.path.dirname(os.path.dirname(os.path.abspath(dstl.__file__)))
    env["PYTHONPATH"] = os.pathsep.join([root] + [p for p in env.get("PYTHONPATH", "").split(os.pathsep) if p])
    env.pop("DSTL_FAULTS", None)
    if faults_spec:
        env["DSTL_FAULTS"] = faults_spec
    with open(log_path, "ab") as log:
        proc = subprocess.Popen([sys.executable, "-m", "dstl.tools.stream_demo", "driver", *args], env=env,
                                stderr=log, start_new_session=True)
        try:
            return proc.wait()
        finally:
            reap_group(proc.pid)


def reap_group(pgid: int) -> None:
    """A killed driver's JVM exits once its Python parent is gone; wait for it, then make sure."""
    deadline = time.monotonic() + 30
    while time.monotonic() < deadline:
        try:
            os.killpg(pgid, 0)
        except ProcessLookupError:
            return
        time.sleep(0.2)
    try:
        os.killpg(pgid, signal.SIGKILL)
    except ProcessLookupError:
        pass


def run(target: str, events: int, batches: int, master: str, kill_at: Optional[int] = None) -> int:
    """The whole demo into `target`; 0 when the verification is exact."""
    import pandas as pd

    if batches < 3:
        print("dstl demo --streaming: error: --batches must be >= 3 (a kill and a rescale)", file=sys.stderr)
        return 2
    kill_at = batches // 2 if kill_at is None else kill_at
    base, inputs, ckpt = (os.path.join(target, n) for n in ("state", "input", "spark-checkpoint"))
    frames = write_inputs(inputs, events, batches)
    print(f"dstl demo --streaming: {events:,} events in {batches} JSON files -> StatefulStream, state in {base}",
          file=sys.stderr)
    print(f"1. driver at parallelism 2, SIGKILLed once checkpoint {kill_at + 1} (batch {kill_at}) is durable",
          flush=True)
    rc = _run_child([base, inputs, ckpt, "2", master], f"stream.after_checkpoint@{kill_at}=kill",
                    os.path.join(target, "driver-1.log"))
    if rc != -signal.SIGKILL:
        print(f"dstl demo --streaming: error: the first driver should have been killed, it exited {rc} "
              f"(see {target}/driver-1.log)", file=sys.stderr)
        return 1
    print("   driver killed (SIGKILL): batch output not committed, Spark has not committed the batch", flush=True)
    print("2. a new driver, same Spark checkpoint, parallelism 3 (rescale 2 -> 3)", flush=True)
    rc = _run_child([base, inputs, ckpt, "3", master], None, os.path.join(target, "driver-2.log"))
    if rc != 0:
        print(f"dstl demo --streaming: error: the second driver exited {rc} (see {target}/driver-2.log)",
              file=sys.stderr)
        return 1
    got = read_output(os.path.join(base, "output"))
    want = expected_output(frames).sort_values(["batch_id", "user"]).reset_index(drop=True)
    try:
        pd.testing.assert_frame_equal(got, want, check_dtype=False)
    except AssertionError as exc:
        print(f"3. verify: FAILED: the output differs from pandas over all input:\n{exc}", file=sys.stderr)
        return 1
    print(f"3. verify: exact. {len(got):,} output rows in {got['batch_id'].nunique()} batches equal pandas "
          f"over all {sum(len(f) for f in frames):,} events: none missing, none duplicated", flush=True)
    print(f"   read it back: spark.read.parquet({os.path.join(base, 'output')!r})  (has a batch_id column)")
    return 0


def main(argv: Optional[List[str]] = None) -> int:
    p = argparse.ArgumentParser(prog="python -m dstl.tools.stream_demo")
    sub = p.add_subparsers(dest="cmd", required=True)
    d = sub.add_parser("driver")
    d.add_argument("base")
    d.add_argument("input")
    d.add_argument("ckpt")
    d.add_argument("parallelism", type=int)
    d.add_argument("master", nargs="?", default="local[2]")
    args = p.parse_args(argv)
    return driver(args.base, args.input, args.ckpt, args.parallelism, args.master)


if __name__ == "__main__":
    sys.exit(main())
