"""dstl.spark.rows' input side against plain references: the key order (pandas.factorize codes
instead of an object argsort) and the timestamps built once per distinct instant must give exactly
what the straightforward computation gives (no Spark: both implementations)."""
from __future__ import annotations

import datetime as dt
from zoneinfo import ZoneInfo

import numpy as np
import pandas as pd
import pytest

from dstl.spark.rows import InputRows, _key_order, _timestamps


def _reference_groups(keys):
    """(key, row indices in arrival order) per distinct key, keys in Python's sorted order."""
    out = {}
    for i, k in enumerate(keys):
        out.setdefault(k, []).append(i)
    return [(k, out[k]) for k in sorted(out)]


@pytest.mark.parametrize("keys", [
    ["u3", "u1", "u2", "u1", "u10", "u3", "u1"],          # strings: factorize path
    [5, -2, 5, 7, 0, -2, 5],                              # ints: factorize path
    [2.5, 1.0, 2.5, -3.0],                                # floats: numpy's sort
    ["b", "a", "é", "B", "a", "", "ß"],                   # non-ASCII: code point order as sorted()
    ["a", "b", "c"],                                      # already sorted: no reorder
    ["x"],
])
def test_key_order_groups_as_sorted_does(keys):
    arr = np.array(keys, dtype=object if isinstance(keys[0], str) else None)
    order, bounds = _key_order(arr)
    idx = list(range(len(keys))) if order is None else list(order)
    got = [(keys[idx[bounds[i]]], idx[bounds[i]:bounds[i + 1]]) for i in range(len(bounds) - 1)]
    assert got == _reference_groups(keys)


def test_input_rows_groups_in_key_then_arrival_order():
    rng = np.random.default_rng(3)
    n = 5000
    pdf = pd.DataFrame({"user": np.char.add("u", rng.integers(0, 700, n).astype(str)).astype(object),
                        "value": rng.integers(0, 100, n), "seq": np.arange(n)})
    groups = list(InputRows(pdf, "user").groups())
    ref = _reference_groups(pdf["user"].tolist())
    assert [k for k, _ in groups] == [k for k, _ in ref]
    for (k, rows), (_, idx) in zip(groups, ref):
        assert [r.seq for r in rows] == idx and all(r.user == k for r in rows)
        assert [r.value for r in rows] == pdf["value"].to_numpy()[idx].tolist()


@pytest.mark.parametrize("tz", ["UTC", "America/New_York", "Asia/Kolkata", None])
@pytest.mark.parametrize("repeat", [True, False])
def test_timestamps_equal_one_by_one_conversion(tz, repeat):
    rng = np.random.default_rng(5)
    span = 60_000 if repeat else 5_000_000_000  # a minute of second-precision times, or months of ms
    ms = 1_715_000_000_000 + rng.integers(0, span, 3000) // (1000 if repeat else 1) * (1000 if repeat else 1)
    s = pd.Series(pd.to_datetime(ms, unit="ms"))
    s[::37] = pd.NaT
    # a New York local time that occurs twice (fold): Spark takes the earlier instant
    s = pd.concat([s, pd.Series(pd.to_datetime(["2024-11-03 01:30:00", None]))], ignore_index=True)
    got = _timestamps(s, tz)
    zone = ZoneInfo(tz) if tz else None
    for v, g in zip(s, got):
        if pd.isna(v):
            assert g is None
            continue
        naive = v.to_pydatetime()
        want = naive.replace(tzinfo=zone, fold=0) if zone else naive
        assert g == want and g.tzinfo is (zone if zone else None) and g.utcoffset() == want.utcoffset()
    if repeat:  # shared objects: fewer datetimes than rows
        assert len({id(g) for g in got if g is not None}) < len(got) // 2
