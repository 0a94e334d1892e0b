"""A failed batch raises on the driver an error whose first line names the cause (dstl.spark.errors).

The driver's parsing of a worker's traceback and the worker's errors are checked without Spark under
both builds (a real processor on a real backend, a real storage whose store is a dead port); one
fast Spark test fails real batches in local mode and reads the error the driver raises.
"""
from __future__ import annotations

import socket
import sys

import pandas as pd
import pytest

from state_helpers import FULL, MAXP, storage  # noqa: F401 - fixture

pytest.importorskip("pyspark")

from pyspark import cloudpickle  # noqa: E402
from pyspark.sql.streaming import StatefulProcessor  # noqa: E402

from dstl.changelog.fs import StoreUnreachableError  # noqa: E402
from dstl.spark.errors import (OutputSchemaError, ProcessorError, SlotError, raise_from_worker,  # noqa: E402
                               store_failed)
from dstl.spark.memory_limit import SlotMemoryError  # noqa: E402

cloudpickle.register_pickle_by_value(sys.modules[__name__])

_TRACEBACK = ("An exception was thrown from the Python worker. Please see the stack trace below.\n"
              "Traceback (most recent call last):\n  File \"task.py\", line 9, in run\n{inner}\n\n"
              "\tat org.apache.spark.api.python.BasePythonRunner.handlePythonException(PythonRunner.scala:1)\n")


def _worker(inner: str) -> RuntimeError:
    return RuntimeError(_TRACEBACK.format(inner=inner))


@pytest.mark.parametrize("cls, line", [
    (ProcessorError, "dstl.spark.errors.ProcessorError: processor Sessions failed for key ('b',): ValueError: no"),
    (OutputSchemaError, "dstl.spark.errors.OutputSchemaError: processor Sessions returned output without ['n']"),
    (SlotMemoryError, "dstl.spark.memory_limit.SlotMemoryError: subtask 0's slot ran out of its memory limit"),
    (StoreUnreachableError, "dstl.changelog.fs.StoreUnreachableError: the store at s3://b/x is unreachable"),
    (SlotError, "dstl.spark.errors.SlotError: could not start the slot process (its log /tmp/s.log ends: boom"),
])
def test_the_driver_raises_the_workers_cause_first(cls, line):
    worker = _worker("ValueError: no\n\nThe above exception was the direct cause of the following exception:\n\n"
                     + line)
    with pytest.raises(cls) as info:
        raise_from_worker(worker)
    message = line.split(": ", 1)[1]
    assert str(info.value) == message and str(info.value).splitlines() == [message]
    assert info.value.__cause__ is worker  # Spark's exception stays attached


def test_a_processors_error_relayed_by_its_slot_leads_as_the_processors():
    worker = _worker("dstl.spark.errors.SlotError: subtask 1 failed in its slot process: ProcessorError: "
                     "processor Counting failed for key ('x',): KeyError: 'n'")
    with pytest.raises(ProcessorError, match=r"^processor Counting failed for key \('x',\): KeyError: 'n'$"):
        raise_from_worker(worker)
    assert raise_from_worker(_worker("ValueError: something else")) is None


class _FailsForB(StatefulProcessor):
    def init(self, handle):
        from pyspark.sql.types import LongType, StructField, StructType

        self.n = handle.getValueState("n", StructType([StructField("n", LongType())]))

    def handleInputRows(self, key, rows, timerValues):
        if key[0] == "b":
            raise ValueError("b is not allowed")
        total = sum(len(r) for r in rows)
        self.n.update((total,))
        yield pd.DataFrame({"user": [key[0]], "n": [total]})

    def close(self):
        pass


class _WrongColumns(_FailsForB):
    def handleInputRows(self, key, rows, timerValues):
        yield pd.DataFrame({"user": [key[0]], "count": [1]})


def test_a_processor_failing_for_a_key_names_itself_and_the_key(storage):  # noqa: F811
    from dstl.spark.processor import BatchContext
    from dstl.spark.processor_runner import run_processor
    from dstl.state.backend import KeyedStateBackend

    backend = KeyedStateBackend(storage, "op", FULL, MAXP)
    rows = pd.DataFrame({"user": ["a", "b"], "v": [1, 2]})
    with pytest.raises(ProcessorError) as info:
        run_processor(_FailsForB(), rows, backend, BatchContext(1000, 0, "None"), "user")
    first = str(info.value).splitlines()[0]
    assert "processor test_batch_errors._FailsForB failed for key ('b',)" in first
    assert "ValueError: b is not allowed" in first
    assert isinstance(info.value.__cause__, ValueError)
    assert isinstance(info.value, ValueError)  # in the worker, a caller catching the processor's type still does
    backend.close()


def test_an_unreachable_store_is_named_with_its_url_attempts_and_time():
    with socket.socket() as s:  # a port nobody listens on
        s.bind(("127.0.0.1", 0))
        port = s.getsockname()[1]
    try:
        socket.create_connection(("127.0.0.1", port), timeout=1)
    except ConnectionRefusedError as refused:
        try:
            raise OSError("upload failed") from refused  # as the retries wrap the store's error
        except OSError as exc:
            err = store_failed("s3://bucket/job", 3, 4, 12.34, exc)
    assert isinstance(err, StoreUnreachableError)
    assert str(err).startswith("the store at s3://bucket/job is unreachable: subtask 3's state upload failed "
                               "after 4 attempt(s) per upload in 12.3 s (cannot connect")
    plain = ValueError("a bug, not the store")
    assert store_failed("s3://bucket/job", 0, 4, 1.0, plain) is plain


def test_a_failed_batch_leads_with_its_cause(spark, tmp_path):
    from dstl.spark import StatefulStream

    df = spark.createDataFrame(pd.DataFrame({"user": ["a", "b", "a"], "v": [1, 2, 3]}))
    failing = StatefulStream(str(tmp_path / "f"), _FailsForB(), "user string, n long", key="user", parallelism=1)
    with pytest.raises(ProcessorError) as info:
        failing.run(df)
    first = str(info.value).splitlines()[0]
    assert "_FailsForB failed for key ('b',)" in first and "ValueError: b is not allowed" in first
    assert info.value.__cause__ is not None and "Python worker" in str(info.value.__cause__)

    wrong = StatefulStream(str(tmp_path / "w"), _WrongColumns(), "user string, n long", key="user", parallelism=1)
    with pytest.raises(OutputSchemaError) as info:
        wrong.run(df)
    first = str(info.value).splitlines()[0]
    assert "_WrongColumns returned output without the output schema's columns ['n']" in first
    assert "'count'" in first and "fn" not in first.split()

    with pytest.raises(ValueError) as info:
        StatefulStream(str(tmp_path / "d"), _FailsForB(), "user strin, n long", key="user", parallelism=1)
    first = str(info.value).splitlines()[0]
    assert first.startswith("output_schema 'user strin, n long' is not a valid DDL string or StructType: ")
    assert "STRIN" in first and info.value.__cause__ is not None
