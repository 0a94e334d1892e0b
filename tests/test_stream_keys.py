"""Several key columns end to end: `StatefulStream(key=["id1", "id2"])` through Spark, rescaled
2 -> 3 -> 1, the state read back with `read_state` and `dstl state show`. The comparison with
Spark's own operator grouped by two columns is in tests/test_conformance.py (heavy)."""
from __future__ import annotations

import json
import os
import subprocess
import sys

import pandas as pd
import pytest

from conform_processors import TwoKeyTotals
from conftest import heavy

pytestmark = [pytest.mark.spark, heavy]

INPUT = "id1 string, id2 bigint, temperature int"


def _df(spark, rows):
    return spark.createDataFrame(pd.DataFrame(rows, columns=["id1", "id2", "temperature"]), INPUT)


def test_two_key_columns_rescale_and_read_back(spark, tmp_path):
    from dstl.spark import StatefulStream, read_state

    base = str(tmp_path / "job")
    batches = [[("a", 1, 10), ("a", 2, 20), ("b", 1, 30), ("a", 1, 5)],
               [("a", 1, 1), ("c", 7, 2), ("b", 1, 4)],
               [("a", 2, 100), ("c", 7, 3)]]
    for p, rows in zip((2, 3, 1), batches):
        s = StatefulStream(base, TwoKeyTotals(False), TwoKeyTotals.OUTPUT, key=["id1", "id2"], parallelism=p,
                           api="row")
        s.run(_df(spark, rows))
        s.close()
    out = spark.read.parquet(base + "/output").toPandas()
    got = sorted(zip(out["batch_id"].astype(int), out["id1"], out["id2"], out["value"]))
    assert got == [(0, "a", 1, "15"), (0, "a", 2, "20"), (0, "b", 1, "30"),
                   (1, "a", 1, "16"), (1, "b", 1, "34"), (1, "c", 7, "2"),
                   (2, "a", 2, "120"), (2, "c", 7, "5")]
    state = read_state(spark, base, "value_state").toPandas()
    assert sorted(zip(state["key"], state["value"])) == [('["a", 1]', 16), ('["a", 2]', 120),
                                                         ('["b", 1]', 34), ('["c", 7]', 5)]
    # the same keys with the other flavour continue the same state
    s = StatefulStream(base, TwoKeyTotals(True), TwoKeyTotals.OUTPUT, key=["id1", "id2"], parallelism=2)
    s.run(_df(spark, [("a", 1, 1000)]))
    s.close()
    out = spark.read.parquet(base + "/output/batch_id=3").toPandas()
    assert out[["id1", "id2", "value"]].values.tolist() == [["a", 1, "1016"]]

    cli = [sys.executable, "-m", "dstl", "state", "show", base, "--state", "value_state", "--json"]
    env = dict(os.environ, PYTHONPATH=os.getcwd())
    shown = json.loads(subprocess.run(cli + ["--key", '["a", 1]'], capture_output=True, text=True, check=True,
                                      env=env).stdout)
    assert [(r["key"], r["value"]) for r in shown] == [('["a", 1]', 1016)]
    bad = subprocess.run(cli + ["--key", "a"], capture_output=True, text=True, env=env)
    assert bad.returncode != 0 and "JSON list" in bad.stderr


def test_key_column_mistakes(spark, tmp_path):
    from dstl.spark import StatefulStream

    with pytest.raises(ValueError, match="list of distinct names"):
        StatefulStream(str(tmp_path), TwoKeyTotals(True), TwoKeyTotals.OUTPUT, key=["id1", "id1"], parallelism=1)
    s = StatefulStream(str(tmp_path / "j"), TwoKeyTotals(True), TwoKeyTotals.OUTPUT, key=["id1", "t"],
                       parallelism=1)
    df = spark.createDataFrame([("a", 1.5)], "id1 string, t double")
    with pytest.raises(TypeError, match="key column 't' is double; several key columns must be integers"):
        s.run(df)
    with pytest.raises(ValueError, match="key column 'id2' is not in batch"):
        StatefulStream(str(tmp_path / "k"), TwoKeyTotals(True), TwoKeyTotals.OUTPUT, key=["id1", "id2"],
                       parallelism=1).run(df)
