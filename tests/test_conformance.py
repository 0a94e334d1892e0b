"""Same rows as Spark's own operator: each processor of tests/conform_processors.py runs natively
(transformWithStateInPandas / transformWithState) and on dstl (foreachBatch(StatefulStream)) over
the same JSON file stream, in both flavours, and every micro-batch's output must be the same
multiset of rows (tests/conformance_util.py). Heavy: two streaming queries per case and flavour.
The dstl side uploads in thread mode and runs its tasks in the Python workers (no service and no
slot processes to start for each short query; DSTL_CONFORMANCE_LEAN=0 runs the defaults).
"""
from __future__ import annotations

import pytest

from conform_cases import CASES
from conformance_util import compare
from conftest import heavy

pytestmark = [pytest.mark.spark, heavy]


@pytest.mark.parametrize("case,flavour", [pytest.param(c, f, id=f"{c.name}-{f}") for c in CASES for f in c.flavours])
def test_same_rows_as_spark(spark, tmp_path, case, flavour):
    native, ours, _ = compare(spark, case, flavour, str(tmp_path))
    assert native, f"{case.name}: the native run produced no output at all"
    assert sorted(ours) == sorted(native), f"{case.name}/{flavour}: batches differ"
    for b in sorted(native):
        assert ours[b] == native[b], (f"{case.name}/{flavour} batch {b}: native {sorted(native[b].items())} "
                                      f"!= dstl {sorted(ours[b].items())}")
