"""Change payloads (op byte + msgpack), serializers and the vectorised msgpack column encoder."""
from __future__ import annotations

import msgpack
import numpy as np
import pandas as pd
import pyarrow as pa
import pytest

from dstl.errors import CorruptChangelogError
from dstl.state import changes as C
from dstl.state import serializers as S
from dstl.state.columns import as_column, concat_rows, pack_column


def packb(x):
    return msgpack.packb(x, use_bin_type=True)


def rows(data, offsets):
    return [bytes(data[offsets[i]:offsets[i + 1]]) for i in range(len(offsets) - 1)]


# ------------------------------------------------------------------ op codes and payloads

def test_op_codes_are_flinks():
    # Flink's StateChangeOperation: ... ADD 3, MERGE_NS 4, ADD_ELEMENT 5, ... REMOVE_FIRST_ELEMENT 8
    assert (C.CLEAR, C.SET, C.SET_INTERNAL, C.ADD, C.ADD_ELEMENT, C.ADD_OR_UPDATE_ELEMENT,
            C.REMOVE_ELEMENT, C.METADATA) == (0, 1, 2, 3, 5, 6, 7, 9)
    assert C.MERGE_NS not in C.OP_NAMES and C.REMOVE_FIRST_ELEMENT not in C.OP_NAMES  # never valid here
    assert C.KEY_GROUP_SNAPSHOT not in range(0, 10)


def test_encode_decode_round_trip():
    p = C.encode(C.SET, [3, "user", {"a": [1, 2.5, b"x"]}])
    assert p[0] == 1 and p[1:] == packb([3, "user", {"a": [1, 2.5, b"x"]}])
    assert C.decode(p) == (C.SET, [3, "user", {"a": [1, 2.5, b"x"]}])
    # map keys of any msgpack type survive (ints, bytes)
    op, body = C.decode(C.encode(C.ADD, [0, 7, {1: "a", b"k": 2}]))
    assert body[2] == {1: "a", b"k": 2}


def test_meta_round_trip_and_identity():
    m = C.StateMeta(4, "last", "list", "msgpack", {"max_length": 10})
    p = C.encode_meta(m)
    assert p[0] == C.METADATA
    op, body = C.decode(p)
    assert op == C.METADATA and C.decode_meta(body) == m
    other = C.StateMeta(9, "last", "list", "msgpack", {"max_length": 10})
    assert other.same_definition(m) and other != m


@pytest.mark.parametrize("payload, msg", [
    (b"", "empty"), (b"\x04\x90", "unknown state change operation code 4"),
    (b"\x01\xc1", "undecodable SET"), (b"\x01\x93\x01", "undecodable SET"),
])
def test_decode_rejects_garbage(payload, msg):
    with pytest.raises(CorruptChangelogError, match=msg):
        C.decode(payload)


def test_bad_meta_rejected():
    with pytest.raises(CorruptChangelogError, match="unsupported state metadata"):
        C.decode_meta({"v": 99})
    with pytest.raises(CorruptChangelogError, match="malformed"):
        C.decode_meta({"v": 1, "id": 0, "name": "x", "kind": "tree", "serializer": "msgpack"})
    with pytest.raises(ValueError, match="unknown state kind"):
        C.StateMeta(0, "x", "tree", "msgpack")


def test_row_prefix_matches_encode():
    n = 3
    prefix = C.row_prefix(C.SET, n, 200)
    full = C.encode(C.SET, [200, "k", 1])
    assert full.startswith(prefix) and full == prefix + packb("k") + packb(1)


# ------------------------------------------------------------------ serializers

def test_serializers_round_trip_and_registry():
    assert S.resolve_serializer(None) is S.MSGPACK
    assert S.MSGPACK.native and not S.PICKLE.native
    assert S.PICKLE.loads(S.PICKLE.dumps((1, {2}))) == (1, {2})
    assert S.MSGPACK.loads(S.MSGPACK.dumps((1, [2]))) == [1, [2]]  # tuples come back as lists
    with pytest.raises(ValueError, match="unknown state serializer id 'nope'"):
        S.get_serializer("nope")

    class Upper:
        id = "test-upper"

        def dumps(self, obj):
            return obj.upper().encode()

        def loads(self, data):
            return bytes(data).decode().lower()

    u = S.register_serializer(Upper())
    assert S.get_serializer("test-upper") is u
    assert S.get_serializer("x", {"x": u}) is u
    with pytest.raises(TypeError, match="non-empty string `id`"):
        S.register_serializer(object())


# ------------------------------------------------------------------ vectorised msgpack columns

INTS = [0, 1, 31, 127, 128, 255, 256, 65535, 65536, 2**32 - 1, 2**32, 2**63 - 1,
        -1, -31, -32, -33, -127, -128, -129, -32768, -32769, -2**31, -2**31 - 1, -2**63]


def check(values, source=None):
    data, offsets = pack_column(values if source is None else source)
    assert len(offsets) == len(values) + 1 and offsets[0] == 0
    assert rows(data, offsets) == [packb(v) for v in values]


def test_ints_match_msgpack_python_byte_for_byte():
    check(INTS, np.array(INTS, dtype=np.int64))
    check(INTS)  # a plain list
    check(INTS, pd.Series(INTS))
    check(INTS, pa.array(INTS, type=pa.int64()))
    small = [0, 5, -3, 127]
    for dt in (np.int8, np.int16, np.int32, np.uint8, np.uint16, np.uint32):
        vals = [v for v in small if v >= 0] if np.dtype(dt).kind == "u" else small
        check(vals, np.array(vals, dtype=dt))
    check([2**64 - 1, 2**63, 7], np.array([2**64 - 1, 2**63, 7], dtype=np.uint64))


def test_random_ints_match(tmp_path):
    rng = np.random.default_rng(5)
    v = np.concatenate([rng.integers(-2**63, 2**63 - 1, 2000, dtype=np.int64),
                        rng.integers(-70000, 70000, 2000)])
    check(v.tolist(), v)


def test_floats_bools_strings_bytes():
    fl = [0.0, -0.0, 1.5, 1e300, float("inf")]
    check(fl, np.array(fl))
    check([0.5, 2.0], np.array([0.5, 2.0], dtype=np.float32))  # float32 columns are packed as float64
    check([True, False], np.array([True, False]))
    ss = ["", "a", "x" * 31, "y" * 32, "z" * 255, "w" * 256, "é" * 40000, "😀 mixed"]
    check(ss); check(ss, pd.Series(ss)); check(ss, pa.array(ss)); check(ss, pa.array(ss, pa.large_string()))
    check(ss, pd.Series(ss, dtype="string[pyarrow]")); check(ss, np.array(ss))
    check(["short", "s2"], pa.chunked_array([["short"], ["s2"]]))
    bs = [b"", b"\x00", b"x" * 300, b"\xff" * 70000]
    check(bs); check(bs, pa.array(bs)); check(bs, pd.Series(bs))


def test_sliced_arrow_and_all_empty():
    arr = pa.array(["aa", "bbb", "c", "dddd"]).slice(1, 2)
    check(["bbb", "c"], arr)
    check(["", ""], pa.array(["", ""]))


def test_object_fallback_and_nulls():
    objs = [1, "a", None, [1, 2], {"k": b"v"}, 2.5]
    check(objs)
    check([1, None, 3], pa.array([1, None, 3]))
    check([1, None], pd.Series([1, None], dtype="Int64"))


def test_concat_rows_constants_and_mixed_widths():
    n = 4
    k = as_column(np.array([1, 300, -5, 2**40]))
    v = as_column(["x", "yy" * 30, "", "z"])  # one value beyond the short-matrix width
    data, offsets = concat_rows([b"\x01\x93\x00"] + k.pack() + v.pack(), n)
    expect = [b"\x01" + packb([0, kk, vv]) for kk, vv in zip([1, 300, -5, 2**40], ["x", "yy" * 30, "", "z"])]
    assert rows(data, offsets) == expect
    long = as_column(["q" * 100, "r"])
    data, offsets = concat_rows([b"A"] + long.pack() + [b"B"], 2)
    assert rows(data, offsets) == [b"A" + packb("q" * 100) + b"B", b"A" + packb("r") + b"B"]


def test_column_rejects_non_columns():
    with pytest.raises(TypeError, match="expected a column"):
        as_column("abc")
    with pytest.raises(TypeError, match="DataFrame"):
        as_column(pd.DataFrame({"a": [1]}))
    with pytest.raises(ValueError, match="1-d"):
        as_column(np.zeros((2, 2), dtype=np.int64))


# ------------------------------------------------------------------ encode_rows: Cython kernel and twin

def _kernels():
    from dstl._fast._statecols_py import encode_rows as encode_rows_py

    out = {"python": encode_rows_py}
    try:
        from dstl._fast import _statecols
    except ImportError:
        return out
    out["cython"] = _statecols.encode_rows
    return out


def _specs_for(columns):
    specs = []
    for c in columns:
        specs += as_column(c).specs()
    return specs


@pytest.mark.parametrize("impl", list(_kernels()))
def test_encode_rows_match_msgpack(impl):
    from dstl.state.columns import as_column as col_of

    fn = _kernels()[impl]
    rng = np.random.default_rng(9)
    n = 3000
    ints = np.concatenate([np.array(INTS, dtype=np.int64), rng.integers(-2**63, 2**63 - 1, n - len(INTS))])
    floats = rng.normal(size=n) * 1e6
    strs = [("é" * int(k)) if k % 7 else "x" * int(k) * 40 for k in rng.integers(0, 60, n)]
    bins = [bytes([k % 256]) * int(k % 300) for k in range(n)]
    bools = rng.integers(0, 2, n).astype(bool)
    uints = rng.integers(0, 2**63, n, dtype=np.uint64) * np.uint64(2)
    objs = [None if i % 5 == 0 else [i, str(i)] for i in range(n)]
    cols = [ints, floats, pa.array(strs), bins, bools, uints, objs]
    specs = []
    for c in cols:
        specs += col_of(c).specs()
    prefix = b"\x05\x97\x07"
    data, offsets = fn(prefix, specs, n)
    assert offsets.dtype == np.int64 and len(offsets) == n + 1
    pylists = [ints.tolist(), floats.tolist(), strs, bins, bools.tolist(), uints.tolist(), objs]
    for i in range(0, n, 7):
        expect = prefix + b"".join(packb(c[i]) for c in pylists)
        assert bytes(data[offsets[i]:offsets[i + 1]]) == expect, i


def test_encode_rows_kernel_and_twin_identical():
    ks = _kernels()
    if len(ks) < 2:
        pytest.skip("the Cython extension is not built")
    cols = [np.arange(-70000, 70000, 37), [f"k{i}" * (i % 20) for i in range(3784)],
            np.linspace(-1, 1, 3784)]
    specs = _specs_for(cols)
    a = ks["cython"](b"\x01\x93\x00", specs, 3784)
    b = ks["python"](b"\x01\x93\x00", specs, 3784)
    assert bytes(a[0]) == bytes(b[0]) and (a[1] == b[1]).all()
    empty_c, empty_p = ks["cython"](b"", [], 0), ks["python"](b"", [], 0)
    assert len(empty_c[0]) == len(empty_p[0]) == 0 and list(empty_c[1]) == list(empty_p[1]) == [0]


@pytest.mark.parametrize("impl", list(_kernels()))
def test_encode_rows_rejects_bad_specs(impl):
    fn = _kernels()[impl]
    with pytest.raises(ValueError, match="row count"):
        fn(b"", [("i", np.arange(3, dtype=np.int64))], 4)
    with pytest.raises(ValueError, match="unknown column spec"):
        fn(b"", [("q", np.arange(3, dtype=np.int64))], 3)


def _updaters():
    from dstl._fast._statecols_py import dict_update_rows as dict_update_rows_py

    out = {"python": dict_update_rows_py}
    try:
        from dstl._fast import _statecols
    except ImportError:
        return out
    out["cython"] = _statecols.dict_update_rows
    return out


@pytest.mark.parametrize("impl", list(_updaters()))
def test_dict_update_rows_later_rows_win(impl):
    fn = _updaters()[impl]
    rng = np.random.default_rng(3)
    n = 5000
    kgs = rng.integers(10, 20, n).astype(np.int32)
    keys = rng.integers(0, 300, n).astype(np.int64)
    for values in (rng.integers(-5, 5, n).astype(np.int64), rng.normal(size=n), [str(i) for i in range(n)]):
        tables = [{} for _ in range(10)]
        model = [{} for _ in range(10)]
        for kg, k, v in zip(kgs.tolist(), keys.tolist(), list(values)):
            model[kg - 10][k] = v if not isinstance(v, np.generic) else v.item()
        fn(tables, 10, kgs, keys, values)
        assert tables == model
        assert all(type(k) is int for t in tables for k in t)
    with pytest.raises(ValueError, match="has no table"):
        fn([None] * 10, 10, kgs, keys, keys)
    with pytest.raises(ValueError, match="differ in length"):
        fn([{}] * 10, 10, kgs, keys[:-1], keys)


def test_dict_update_rows_kernel_and_twin_identical():
    ups = _updaters()
    if len(ups) < 2:
        pytest.skip("the Cython extension is not built")
    kgs = np.array([1, 2, 1, 1, 2], dtype=np.int32)
    keys = ["a", "b", "a", "c", "b"]
    vals = [[1], {"x": 2}, None, 3.5, b"z"]
    a, b = [{}, {}], [{}, {}]
    ups["cython"](a, 1, kgs, keys, vals)
    ups["python"](b, 1, kgs, keys, vals)
    assert a == b == [{"a": None, "c": 3.5}, {"b": b"z"}]


def test_state_kernel_matches_the_implementation_in_use():
    from conftest import expected_implementation
    from dstl.state import columns

    # under `make test`'s Cython run the kernel must really be loaded, not a silent fallback
    assert columns.KERNEL == expected_implementation()
