"""SIGKILL a real Structured Streaming driver at the two worst moments, restart at another parallelism.

Heavy (three driver processes, each with its own JVM): runs under the Cython build only; the
in-process version of the same protocol (tests/test_stream.py) runs under both implementations.
"""
from __future__ import annotations

import json
import os
import signal

import pandas as pd

from conftest import heavy
from driver_util import run_driver

pytestmark = heavy



def _write_inputs(input_dir, n_files=4, rows=30, users=7):
    os.makedirs(input_dir)
    files = []
    for f in range(n_files):
        pdf = pd.DataFrame({"user": [f"u{(f * 3 + i) % users}" for i in range(rows)],
                            "v": [f * 1000 + i for i in range(rows)]})
        path = os.path.join(input_dir, f"part-{f}.json")
        with open(path, "w") as fh:
            for rec in pdf.to_dict("records"):
                fh.write(json.dumps(rec) + "\n")
        os.utime(path, (1_700_000_000 + f, 1_700_000_000 + f))  # file order = batch order
        files.append(pdf)
    return files


def test_sigkill_driver_after_checkpoint_and_after_sink_then_rescale(tmp_path):
    from test_stream import _expected_counting

    base, inputs, ckpt, sink_log = (str(tmp_path / n) for n in ("job", "in", "spark-ckpt", "sink.log"))
    files = _write_inputs(inputs)

    # 1: killed after batch 1's checkpoint is durable, before its output commit and sink
    rc, out = run_driver("stream_driver.py", [base, inputs, ckpt, "2", sink_log], "stream.after_checkpoint@1=kill")
    assert rc == -signal.SIGKILL, out[-3000:]
    # 2: restart at parallelism 3; Spark replays batch 1; killed after batch 2's sink returned
    rc, out = run_driver("stream_driver.py", [base, inputs, ckpt, "3", sink_log], "stream.after_sink@2=kill")
    assert rc == -signal.SIGKILL, out[-3000:]
    # 3: restart at parallelism 1; Spark replays batch 2 (no state change, no second sink call)
    rc, out = run_driver("stream_driver.py", [base, inputs, ckpt, "1", sink_log], None)
    assert rc == 0, out[-3000:]

    with open(sink_log) as fh:
        calls = [tuple(map(int, line.split())) for line in fh if line.strip()]
    assert [b for b, _ in calls] == [0, 1, 2, 3]  # the sink saw every batch exactly once

    from pyspark.sql import SparkSession  # noqa: F401 - the output is plain parquet: read it with pyarrow
    import pyarrow.dataset as ds

    got = ds.dataset(os.path.join(base, "output"), format="parquet", partitioning="hive").to_table().to_pandas()
    cols = ["batch_id", "user", "n", "items", "buckets", "evens"]
    got = got[cols].astype({"batch_id": "int64"}).sort_values(["batch_id", "user"]).reset_index(drop=True)
    expected = _expected_counting(list(enumerate(files)))
    pd.testing.assert_frame_equal(got, expected, check_dtype=False)
    assert [n for _, n in calls] == [int((expected.batch_id == b).sum()) for b in range(4)]
