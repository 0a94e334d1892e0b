"""The fast tier stays fast: a test that starts Spark (through the `spark` fixture) is marked heavy,
unless it is one of the end-to-end runs the fast tier keeps on purpose (`FAST_SPARK` in conftest.py)."""
from __future__ import annotations

import pytest

import conftest


def test_every_spark_test_is_heavy_or_a_chosen_fast_one():
    collected = {nodeid.split("[")[0] for nodeid in conftest.COLLECTED_SPARK}
    if not collected:
        pytest.skip("no test using Spark was collected with this one: run it with the suite (make test)")
    assert not conftest.UNMARKED_SPARK, (
        "these tests start Spark but are in the fast tier: mark them `heavy` (tests/conftest.py) or, "
        f"if the fast tier must keep them, list them in FAST_SPARK: {conftest.UNMARKED_SPARK}")
    # the chosen fast runs exist (a renamed test would otherwise leave the fast tier without them)
    stale = [t for t in conftest.FAST_SPARK if t.split("::")[0] in {c.split("::")[0] for c in collected}
             and t not in collected]
    assert not stale, f"FAST_SPARK names tests that do not exist: {stale}"
