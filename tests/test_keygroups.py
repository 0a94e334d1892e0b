"""Key groups (docs/rescaling.md §1-§4): test vectors, scalar and vectorised paths, errors, properties."""
import importlib

import numpy as np
import pandas as pd
import pyarrow as pa
import pytest
from hypothesis import given, settings
from hypothesis import strategies as st

from dstl import keygroups as kg
from dstl._impl import IMPLEMENTATION
from dstl.types import KeyGroupRange

from conftest import expected_implementation

# docs/rescaling.md §4: key, Java hash, murmur (None = not given), key group for maxP 128
VECTORS = [
    (0, 0, 593689054, 94),
    (1, 1, 68075478, 86),
    (2, 2, 1085422463, 127),
    (42, 42, 1134849565, 29),
    (-1, -1, 1982413648, 80),
    (2147483647, 2147483647, 1653689534, 62),
    (-2147483648, -2147483648, 1718298732, 108),
    ("hello", 99162322, None, 35),
    ("flink", 97520992, None, 98),
    (1234567890123, 1912276436, None, 92),
    (2**31, -2147483648, 1718298732, 108),
    (2**40, 256, 1409940790, 54),
    ("", 0, 593689054, 94),
    ("\U0001F600", 1772899, 1934073014, 54),
    (b"", 1, 68075478, 86),
    (b"abc", 126145, 774285724, 28),
    (b"\xff", 30, 173947034, 26),
]
INT_VECTORS = [v for v in VECTORS if isinstance(v[0], int)]
STR_VECTORS = [v for v in VECTORS if isinstance(v[0], str)]
BYTES_VECTORS = [v for v in VECTORS if isinstance(v[0], bytes)]


def test_facade_uses_the_expected_kernels():
    assert IMPLEMENTATION == expected_implementation()
    expected = "dstl._fast._hash" if IMPLEMENTATION == "cython" else "dstl._fast._hash_py"
    assert kg._kernels.__name__ == expected


# ------------------------------------------------------------------ scalar


@pytest.mark.parametrize("key,java,murmur,group", VECTORS, ids=repr)
def test_scalar_vectors(key, java, murmur, group):
    assert kg.java_hash_code(key) == java
    if murmur is not None:
        assert kg.murmur_hash(java) == murmur
    assert kg.assign_to_key_group(key, 128) == group


def test_bytearray_and_numpy_scalars_hash_like_their_python_values():
    assert kg.java_hash_code(bytearray(b"abc")) == 126145
    assert kg.java_hash_code(np.int64(1234567890123)) == 1912276436
    assert kg.java_hash_code(np.uint8(42)) == 42
    assert kg.java_hash_code(np.str_("hello")) == 99162322


def test_max_parallelism_32768_vectors():
    assert kg.assign_to_key_group(0, 32768) == 31198
    assert kg.assign_to_key_group(1, 32768) == 16342


def test_long_rule_differs_from_int_rule_only_outside_int32():
    # Flink keyed by Long would hash -1 to 0; dstl uses Integer for values that fit in int32
    assert kg.java_hash_code(-1) == -1
    # Long.hashCode = (int)(v ^ (v >>> 32)), worked out by hand from the two 32-bit halves
    assert kg.java_hash_code(-(2**31) - 1) == -(2**31)  # 0xFFFFFFFF_7FFFFFFF
    assert kg.java_hash_code(2**63 - 1) == -(2**31)  # 0x7FFFFFFF_FFFFFFFF
    assert kg.java_hash_code(-(2**63)) == -(2**31)  # 0x80000000_00000000
    assert kg.java_hash_code(2**32 + 5) == 4  # 0x00000001_00000005


def test_string_hash_uses_utf16_code_units_and_lone_surrogates():
    # U+1F600 = D83D DE00: 31 * 0xD83D + 0xDE00
    assert kg.java_hash_code("\U0001F600") == 31 * 0xD83D + 0xDE00
    assert kg.java_hash_code("\ud83d") == 0xD83D  # lone high surrogate counts as itself
    assert kg.java_hash_code("\ude00\ud83d") == 31 * 0xDE00 + 0xD83D  # reversed pair: two lone units
    assert kg.java_hash_code("é") == 0xE9
    assert kg.java_hash_code("ab") == 31 * 97 + 98


def test_string_hash_wraps_like_java():
    # "polygenelubricants".hashCode() == Integer.MIN_VALUE (a well-known Java fact)
    assert kg.java_hash_code("polygenelubricants") == -(2**31)
    assert kg.murmur_hash(-(2**31)) == 1718298732


@pytest.mark.parametrize("key", [True, False, np.bool_(True), 1.0, None, (1,), [1], {"a": 1}, object()],
                         ids=lambda k: type(k).__name__ if type(k) is object else repr(k))  # stable ids
def test_unsupported_key_types_raise_type_error(key):
    with pytest.raises(TypeError):
        kg.java_hash_code(key)
    with pytest.raises(TypeError):
        kg.assign_to_key_group(key, 128)


@pytest.mark.parametrize("key", [2**63, -(2**63) - 1, 10**30])
def test_ints_outside_int64_raise_value_error(key):
    with pytest.raises(ValueError, match="int64"):
        kg.assign_to_key_group(key, 128)


@pytest.mark.parametrize("max_p", [0, -1, 32769])
def test_bad_max_parallelism(max_p):
    with pytest.raises(ValueError, match="max_parallelism"):
        kg.assign_to_key_group(1, max_p)
    with pytest.raises(ValueError, match="max_parallelism"):
        kg.assign_key_groups(np.array([1]), max_p)


def test_max_parallelism_must_be_int():
    with pytest.raises(TypeError):
        kg.assign_to_key_group(1, 128.0)
    with pytest.raises(TypeError):
        kg.assign_to_key_group(1, True)


def test_murmur_hash_checks_its_input():
    with pytest.raises(ValueError):
        kg.murmur_hash(2**31)
    with pytest.raises(TypeError):
        kg.murmur_hash("1")


# ------------------------------------------------------------------ ranges and indices


def test_ranges_for_3_and_7():
    assert kg.key_group_ranges(128, 3) == [KeyGroupRange(0, 42), KeyGroupRange(43, 85), KeyGroupRange(86, 127)]
    assert [(r.start, r.end) for r in kg.key_group_ranges(128, 7)] == [
        (0, 18), (19, 36), (37, 54), (55, 73), (74, 91), (92, 109), (110, 127)]


def test_operator_index_vectors():
    for group, index in [(42, 0), (43, 1), (85, 1), (86, 2)]:
        assert kg.compute_operator_index_for_key_group(128, 3, group) == index
    got = kg.operator_indices_for_key_groups(np.array([42, 43, 85, 86]), 128, 3)
    assert got.dtype == np.int32 and got.tolist() == [0, 1, 1, 2]


@pytest.mark.parametrize("p,expected", [(1, 128), (10, 128), (85, 128), (86, 256), (100, 256),
                                        (1000, 2048), (30000, 32768)])
def test_default_max_parallelism(p, expected):
    assert kg.compute_default_max_parallelism(p) == expected


@pytest.mark.parametrize("p", [0, -3, 32769])
def test_default_max_parallelism_rejects_bad_parallelism(p):
    with pytest.raises(ValueError, match="parallelism"):
        kg.compute_default_max_parallelism(p)


@pytest.mark.parametrize("args", [(128, 3, 3), (128, 3, -1), (128, 0, 0), (128, 129, 0), (0, 1, 0),
                                  (32769, 1, 0)])
def test_range_function_rejects_bad_arguments(args):
    with pytest.raises(ValueError):
        kg.compute_key_group_range_for_operator_index(*args)


@pytest.mark.parametrize("args", [(128, 3, 128), (128, 3, -1), (128, 200, 1), (128, 0, 1)])
def test_operator_index_rejects_bad_arguments(args):
    with pytest.raises(ValueError):
        kg.compute_operator_index_for_key_group(*args)


def test_operator_indices_errors_name_the_row():
    with pytest.raises(ValueError, match="row 2"):
        kg.operator_indices_for_key_groups(np.array([0, 5, 128]), 128, 4)
    with pytest.raises(ValueError, match="row 1"):
        kg.operator_indices_for_key_groups(np.array([0, -1]), 128, 4)
    with pytest.raises(ValueError, match="row 0"):
        kg.operator_indices_for_key_groups(np.array([2**64 - 1], dtype=np.uint64), 128, 4)
    with pytest.raises(TypeError):
        kg.operator_indices_for_key_groups(np.array([1.0]), 128, 4)
    with pytest.raises(ValueError, match="parallelism"):
        kg.operator_indices_for_key_groups(np.array([1]), 128, 129)


@pytest.mark.parametrize("max_p", [1, 2, 7, 100, 128, 1000, 32768])
def test_ranges_and_operator_indices_agree(max_p):
    for p in sorted({1, 2, 3, 5, 7, 64, max_p} & set(range(1, max_p + 1))):
        ranges = kg.key_group_ranges(max_p, p)
        assert ranges[0].start == 0 and ranges[-1].end == max_p - 1
        for a, b in zip(ranges, ranges[1:]):
            assert b.start == a.end + 1
        groups = np.arange(max_p)
        owners = kg.operator_indices_for_key_groups(groups, max_p, p)
        for i, r in enumerate(ranges):
            assert (owners[r.start:r.end + 1] == i).all()
            assert kg.compute_operator_index_for_key_group(max_p, p, r.start) == i


def test_assign_key_to_parallel_operator():
    # "hello" -> kg 35 -> subtask 0 of 3 (range [0, 42]); 2 -> kg 127 -> subtask 2
    assert kg.assign_key_to_parallel_operator("hello", 128, 3) == 0
    assert kg.assign_key_to_parallel_operator(2, 128, 3) == 2


# ------------------------------------------------------------------ vectorised


def _groups(vectors):
    return [v[3] for v in vectors]


def test_numpy_int_vectors():
    keys = [v[0] for v in INT_VECTORS]
    got = kg.assign_key_groups(np.array(keys, dtype=np.int64), 128)
    assert got.dtype == np.int32 and got.tolist() == _groups(INT_VECTORS)


@pytest.mark.parametrize("dtype", [np.int8, np.int16, np.int32, np.uint8, np.uint16, np.uint32])
def test_numpy_small_int_dtypes_follow_the_value_rule(dtype):
    info = np.iinfo(dtype)
    keys = np.array([0, 1, 42, info.max, info.min], dtype=dtype)
    assert kg.assign_key_groups(keys, 128).tolist() == [kg.assign_to_key_group(int(k), 128) for k in keys]


def test_int32_rule_and_int64_rule_chosen_per_value():
    keys = [-1, 2**31 - 1, 2**31, -(2**31), -(2**31) - 1, 2**63 - 1, -(2**63), 1234567890123]
    expected = [kg.assign_to_key_group(k, 1000) for k in keys]
    assert kg.assign_key_groups(np.array(keys, dtype=np.int64), 1000).tolist() == expected
    assert kg.assign_key_groups(pa.array(keys, pa.int64()), 1000).tolist() == expected
    assert kg.assign_key_groups(pd.Series(keys, dtype="int64"), 1000).tolist() == expected
    assert kg.assign_key_groups(keys, 1000).tolist() == expected


def test_uint64_within_int64_follows_the_value_rule():
    keys = np.array([0, 2**31, 2**63 - 1], dtype=np.uint64)
    assert kg.assign_key_groups(keys, 128).tolist() == [kg.assign_to_key_group(int(k), 128) for k in keys]


def test_uint64_above_int64_is_rejected():
    with pytest.raises(ValueError, match="row 1"):
        kg.assign_key_groups(np.array([1, 2**63], dtype=np.uint64), 128)


def test_pandas_series_of_every_kind():
    ints = [v[0] for v in INT_VECTORS]
    strs = [v[0] for v in STR_VECTORS]
    blobs = [v[0] for v in BYTES_VECTORS]
    assert kg.assign_key_groups(pd.Series(ints), 128).tolist() == _groups(INT_VECTORS)
    assert kg.assign_key_groups(pd.Series(ints, dtype="Int64"), 128).tolist() == _groups(INT_VECTORS)
    assert kg.assign_key_groups(pd.Series(strs, dtype=object), 128).tolist() == _groups(STR_VECTORS)
    assert kg.assign_key_groups(pd.Series(strs, dtype="string[python]"), 128).tolist() == _groups(STR_VECTORS)
    assert kg.assign_key_groups(pd.Series(strs, dtype="string[pyarrow]"), 128).tolist() == _groups(STR_VECTORS)
    assert kg.assign_key_groups(pd.Series(strs, dtype=pd.ArrowDtype(pa.large_string())), 128).tolist() \
        == _groups(STR_VECTORS)
    assert kg.assign_key_groups(pd.Series(blobs, dtype=object), 128).tolist() == _groups(BYTES_VECTORS)
    assert kg.assign_key_groups(pd.Series(blobs, dtype=pd.ArrowDtype(pa.binary())), 128).tolist() \
        == _groups(BYTES_VECTORS)
    assert kg.assign_key_groups(pd.Index(strs), 128).tolist() == _groups(STR_VECTORS)
    cat = pd.Series(strs + strs[::-1], dtype="category")
    assert kg.assign_key_groups(cat, 128).tolist() == _groups(STR_VECTORS) + _groups(STR_VECTORS)[::-1]


def test_mixed_object_column_uses_the_scalar_rule_per_row():
    keys = [v[0] for v in VECTORS]
    assert kg.assign_key_groups(keys, 128).tolist() == _groups(VECTORS)
    assert kg.assign_key_groups(np.array(keys, dtype=object), 128).tolist() == _groups(VECTORS)


@pytest.mark.parametrize("type_", [pa.string(), pa.large_string(), pa.string_view()])
def test_arrow_strings(type_):
    arr = pa.array([v[0] for v in STR_VECTORS], type_)
    assert kg.assign_key_groups(arr, 128).tolist() == _groups(STR_VECTORS)


@pytest.mark.parametrize("type_", [pa.binary(), pa.large_binary(), pa.binary_view()])
def test_arrow_binaries(type_):
    arr = pa.array([v[0] for v in BYTES_VECTORS], type_)
    assert kg.assign_key_groups(arr, 128).tolist() == _groups(BYTES_VECTORS)


@pytest.mark.parametrize("type_", [pa.int32(), pa.int64(), pa.int8(), pa.uint32()])
def test_arrow_ints(type_):
    keys = [k for k, *_ in INT_VECTORS
            if pa.scalar(0, type_) is not None and _fits(k, type_)]
    assert keys
    expected = [kg.assign_to_key_group(k, 128) for k in keys]
    assert kg.assign_key_groups(pa.array(keys, type_), 128).tolist() == expected


def _fits(k, type_):
    try:
        pa.scalar(k, type_)
        return True
    except (pa.ArrowInvalid, OverflowError):
        return False


def test_arrow_chunked_sliced_and_dictionary():
    strs = [v[0] for v in STR_VECTORS]
    expected = _groups(STR_VECTORS)
    chunked = pa.chunked_array([strs[:2], [], strs[2:]], pa.string())
    assert kg.assign_key_groups(chunked, 128).tolist() == expected
    sliced = pa.array(["x"] * 3 + strs + ["y"], pa.large_string()).slice(3, len(strs))
    assert sliced.offset == 3
    assert kg.assign_key_groups(sliced, 128).tolist() == expected
    dictionary = pa.array(strs + strs).dictionary_encode()
    assert kg.assign_key_groups(dictionary, 128).tolist() == expected + expected
    assert kg.assign_key_groups(pa.chunked_array([], pa.string()), 128).tolist() == []
    assert kg.assign_key_groups(np.array([], dtype=np.int64), 128).tolist() == []


def test_nulls_are_rejected_with_the_row():
    with pytest.raises(ValueError, match="row 1"):
        kg.assign_key_groups(pa.array(["a", None, "b"]), 128)
    with pytest.raises(ValueError, match="row 4"):
        kg.assign_key_groups(pa.chunked_array([["a", "b", "c"], ["d", None]]), 128)
    with pytest.raises(ValueError, match="row 2"):
        kg.assign_key_groups(pa.array([1, 2, None], pa.int64()), 128)
    with pytest.raises(ValueError, match="row 1"):
        kg.assign_key_groups(pd.Series([1, None], dtype="Int64"), 128)
    with pytest.raises(ValueError, match="row 0"):
        kg.assign_key_groups(pd.Series([None, "a"], dtype="string[pyarrow]"), 128)
    with pytest.raises(ValueError, match="row 1"):
        kg.assign_key_groups(pd.Series(["a", None], dtype="category"), 128)
    # in an object column None is a value of an unsupported type, as for the scalar function
    with pytest.raises(TypeError, match="row 1"):
        kg.assign_key_groups(["a", None], 128)


def test_errors_in_later_chunks_name_the_global_row():
    bad = pa.Array.from_buffers(pa.string(), 2, [None, pa.py_buffer(np.array([0, 1, 2], np.int32)),
                                                 pa.py_buffer(b"a\xff")])
    with pytest.raises(ValueError, match="row 3 is not valid UTF-8"):
        kg.assign_key_groups(pa.chunked_array([pa.array(["x", "y"]), bad]), 128)


@pytest.mark.parametrize("payload,row", [(b"a\xe2\x82", 1), (b"\xed\xa0\x80", 0), (b"\xc0\x80", 0),
                                         (b"\xf4\x90\x80\x80", 0), (b"ok\xff", 1), (b"\x80", 0)])
def test_invalid_utf8_in_arrow_strings_is_rejected(payload, row):
    offsets = np.array([0, 1, len(payload)], np.int32)
    arr = pa.Array.from_buffers(pa.string(), 2, [None, pa.py_buffer(offsets), pa.py_buffer(payload)])
    with pytest.raises(ValueError, match=f"row {row} is not valid UTF-8"):
        kg.assign_key_groups(arr, 128)


def test_row_boundary_inside_a_character_is_invalid():
    data = "é".encode()  # two bytes, split between two rows
    arr = pa.Array.from_buffers(pa.string(), 2, [None, pa.py_buffer(np.array([0, 1, 2], np.int32)),
                                                 pa.py_buffer(data)])
    with pytest.raises(ValueError, match="row 0 is not valid UTF-8"):
        kg.assign_key_groups(arr, 128)


@pytest.mark.parametrize("column", [np.array([True, False]), pd.Series([True]), pa.array([True]),
                                    np.array([1.5]), pd.Series([1.0]), pa.array([1.0]),
                                    pd.Series([1.0], dtype="Float64")],
                         ids=lambda c: f"{type(c).__name__}-{getattr(c, 'dtype', None) or c.type}")  # stable ids
def test_bool_and_float_columns_raise_type_error(column):
    with pytest.raises(TypeError):
        kg.assign_key_groups(column, 128)


def test_non_columns_are_rejected():
    with pytest.raises(TypeError):
        kg.assign_key_groups("abc", 128)
    with pytest.raises(TypeError):
        kg.assign_key_groups(pd.DataFrame({"a": [1]}), 128)
    with pytest.raises(ValueError, match="1-d"):
        kg.assign_key_groups(np.zeros((2, 2), dtype=np.int64), 128)


def test_large_column_matches_scalar_on_a_sample():
    rng = np.random.default_rng(7)
    keys = rng.integers(-(2**63), 2**63 - 1, size=200_000, dtype=np.int64, endpoint=True)
    keys[:1000] = rng.integers(-(2**31), 2**31, size=1000)
    got = kg.assign_key_groups(keys, 1000)
    for i in list(range(0, 1000, 37)) + list(rng.integers(0, len(keys), size=300)):
        assert got[i] == kg.assign_to_key_group(int(keys[i]), 1000)
    # key groups are spread over every group
    assert np.bincount(got, minlength=1000).min() > 100


# ------------------------------------------------------------------ properties: vectorised == scalar

MAX_PS = st.sampled_from([1, 2, 3, 100, 128, 1000, 4096, 32768])
TEXT = st.text(alphabet=st.characters(exclude_categories=["Cs"]), max_size=40)  # valid UTF-8 for Arrow
TEXT_WITH_SURROGATES = st.text(alphabet=st.characters(), max_size=20)


@settings(max_examples=150, deadline=None)
@given(st.lists(st.integers(min_value=-(2**63), max_value=2**63 - 1), max_size=60), MAX_PS)
def test_property_ints(keys, max_p):
    expected = [kg.assign_to_key_group(k, max_p) for k in keys]
    assert kg.assign_key_groups(np.array(keys, dtype=np.int64), max_p).tolist() == expected
    assert kg.assign_key_groups(pa.array(keys, pa.int64()), max_p).tolist() == expected
    assert kg.assign_key_groups(keys, max_p).tolist() == expected


@settings(max_examples=150, deadline=None)
@given(st.lists(TEXT, max_size=40), MAX_PS)
def test_property_strings(keys, max_p):
    expected = [kg.assign_to_key_group(k, max_p) for k in keys]
    assert [kg.java_hash_code(k) for k in keys] == [_reference_string_hash(k) for k in keys]
    assert kg.assign_key_groups(pa.array(keys, pa.string()), max_p).tolist() == expected
    assert kg.assign_key_groups(pa.array(keys, pa.large_string()), max_p).tolist() == expected
    assert kg.assign_key_groups(pd.Series(keys, dtype=object), max_p).tolist() == expected


@settings(max_examples=100, deadline=None)
@given(st.lists(TEXT_WITH_SURROGATES, max_size=20), MAX_PS)
def test_property_strings_with_lone_surrogates(keys, max_p):
    expected = [_reference_string_hash(k) for k in keys]
    assert [kg.java_hash_code(k) for k in keys] == expected
    assert kg.assign_key_groups(keys, max_p).tolist() == [kg.assign_to_key_group(k, max_p) for k in keys]


@settings(max_examples=150, deadline=None)
@given(st.lists(st.binary(max_size=40), max_size=40), MAX_PS)
def test_property_bytes(keys, max_p):
    expected = [kg.assign_to_key_group(k, max_p) for k in keys]
    assert kg.assign_key_groups(pa.array(keys, pa.binary()), max_p).tolist() == expected
    assert kg.assign_key_groups(pa.array(keys, pa.large_binary()), max_p).tolist() == expected
    assert kg.assign_key_groups(pd.Series(keys, dtype=object), max_p).tolist() == expected


def _reference_string_hash(s: str) -> int:
    """Java's String.hashCode written out over UTF-16 code units (independent of both kernels)."""
    h = 0
    for ch in s:
        cp = ord(ch)
        units = [cp] if cp < 0x10000 else [0xD800 + ((cp - 0x10000) >> 10), 0xDC00 + ((cp - 0x10000) & 0x3FF)]
        for u in units:
            h = (h * 31 + u) % 2**32
    return h - 2**32 if h >= 2**31 else h


# ------------------------------------------------------------------ Cython and twin agree


def _both_kernels():
    try:
        compiled = importlib.import_module("dstl._fast._hash")
    except ImportError:
        pytest.skip("the Cython extension is not built")
    return compiled, importlib.import_module("dstl._fast._hash_py")


def test_cython_and_twin_agree_on_large_random_columns():
    compiled, twin = _both_kernels()
    rng = np.random.default_rng(3)
    ints = rng.integers(-(2**63), 2**63 - 1, size=300_000, dtype=np.int64)
    for max_p in (128, 1000):
        assert np.array_equal(compiled.int64_key_groups(ints, max_p), twin.int64_key_groups(ints, max_p))
    words = ["".join(chr(c) for c in rng.integers(1, 0x10FFFF, size=n) if not 0xD800 <= c < 0xE000)
             for n in rng.integers(0, 12, size=5000)]
    arr = pa.array(words, pa.large_string())
    offsets, data = kg._arrow_layout(arr, np.int64)
    assert np.array_equal(compiled.utf8_key_groups(offsets, data, 1000), twin.utf8_key_groups(offsets, data, 1000))
    blobs = pa.array([rng.bytes(int(n)) for n in rng.integers(0, 20, size=5000)], pa.binary())
    offsets, data = kg._arrow_layout(blobs, np.int32)
    assert np.array_equal(compiled.binary_key_groups(offsets, data, 77), twin.binary_key_groups(offsets, data, 77))


@pytest.mark.parametrize("offsets,data", [([0, 2, 1], b"abc"), ([0, 5], b"abc"), ([], b""), ([-1, 0], b"")])
def test_cython_and_twin_reject_bad_offsets_alike(offsets, data):
    compiled, twin = _both_kernels()
    messages = []
    for module in (compiled, twin):
        for fn in (module.utf8_key_groups, module.binary_key_groups):
            with pytest.raises(ValueError) as info:
                fn(np.array(offsets, dtype=np.int64), data, 128)
            messages.append(str(info.value))
    assert len(set(messages)) == 1, messages


def test_twin_chunking_gives_the_same_result(monkeypatch):
    """The twin bounds its temporaries by working in row chunks; chunk edges must not matter."""
    twin = importlib.import_module("dstl._fast._hash_py")
    words = [f"k{i}-\U0001F600" if i % 3 == 0 else f"é{i}" * (i % 5) for i in range(500)]
    expected = [kg.assign_to_key_group(w, 1000) for w in words]
    blobs = [w.encode() for w in words]
    expected_bytes = [kg.assign_to_key_group(b, 1000) for b in blobs]
    monkeypatch.setattr(twin, "_CHUNK_BYTES", 37)
    monkeypatch.setattr(twin, "_OBJECT_CHUNK", 41)
    offsets, data = kg._arrow_layout(pa.array(words, pa.string()), np.int32)
    assert twin.utf8_key_groups(offsets, data, 1000).tolist() == expected
    offsets, data = kg._arrow_layout(pa.array(blobs, pa.large_binary()), np.int64)
    assert twin.binary_key_groups(offsets, data, 1000).tolist() == expected_bytes
    assert twin.object_key_groups(words, 1000).tolist() == expected
    assert twin.object_key_groups(blobs, 1000).tolist() == expected_bytes


def test_cython_and_twin_agree_on_object_columns():
    compiled, twin = _both_kernels()
    rng = np.random.default_rng(5)
    words = ["".join(chr(c) for c in rng.integers(1, 0x10FFFF, size=n)) for n in rng.integers(0, 9, size=3000)]
    blobs = [rng.bytes(int(n)) for n in rng.integers(0, 9, size=3000)]
    ints = [int(x) for x in rng.integers(-(2**63), 2**63 - 1, size=3000)]
    mixed = [x for triple in zip(words, blobs, ints) for x in triple] + [bytearray(b"xy")]
    for column in (words, blobs, ints, mixed):
        assert np.array_equal(compiled.object_key_groups(column, 999), twin.object_key_groups(column, 999))
    for bad in (["a", None], [b"a", 1.0], [1, 2**64]):
        errors = []
        for module in (compiled, twin):
            with pytest.raises((TypeError, ValueError)) as info:
                module.object_key_groups(bad, 128)
            errors.append((type(info.value), str(info.value)))
        assert errors[0] == errors[1]


@settings(max_examples=100, deadline=None)
@given(st.integers(1, 32768).flatmap(lambda m: st.tuples(st.just(m), st.integers(1, m))))
def test_property_ranges_partition_the_key_groups(args):
    max_p, p = args
    ranges = kg.key_group_ranges(max_p, p)
    assert ranges[0].start == 0 and ranges[-1].end == max_p - 1
    assert all(b.start == a.end + 1 for a, b in zip(ranges, ranges[1:]))
    assert max(len(r) for r in ranges) - min(len(r) for r in ranges) <= 1
    owners = kg.operator_indices_for_key_groups(np.arange(max_p), max_p, p)
    assert np.array_equal(owners, np.repeat(np.arange(p), [len(r) for r in ranges]))


@settings(max_examples=300, deadline=None)
@given(st.integers(-(2**31), 2**31 - 1))
def test_property_cython_and_twin_murmur_agree(code):
    compiled, twin = _both_kernels()
    assert compiled.murmur_hash(code) == twin.murmur_hash(code) >= 0
    assert compiled.int64_key_groups(np.array([code], np.int64), 32768)[0] == twin.murmur_hash(code) % 32768


def test_murmur_min_value_branch():
    # found by scanning all 2^32 codes with the §3 steps: the only code whose mixed value is
    # Integer.MIN_VALUE (-> 0 by the last rule), and the only one whose mixed value is 0 itself
    assert kg.murmur_hash(-2089875627) == 0
    assert kg.murmur_hash(-1035494534) == 0
    assert kg.assign_key_groups(np.array([-2089875627, -1035494534, 0]), 1000).tolist() == [0, 0, 593689054 % 1000]
    assert kg.assign_to_key_group(-2089875627, 7) == 0
