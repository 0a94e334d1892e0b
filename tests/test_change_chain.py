"""Change iterators of the object restore path, both implementations: `iter_change_set` walks a checked
change set record by record (groups outside the range skipped, empty groups, metadata), and
`chain_changes` chains them the way the reader does (each exhausted one closed before the next)."""
from __future__ import annotations

import numpy as np
import pytest

from dstl import format as fmt
from dstl.types import StateChange

from format_helpers import impl_params


def _random_changes(seed: int, n: int):
    rng = np.random.default_rng(seed)
    return [StateChange(int(k), rng.integers(0, 256, int(m), dtype=np.uint8).tobytes())
            for k, m in zip(rng.integers(-1, 30, n), rng.integers(0, 300, n))]


def _stream(change_sets):
    """The bodies back to back, and where each starts."""
    bodies = [fmt.encode_change_set(cs) for cs in change_sets]
    offsets = np.cumsum([0] + [len(b) for b in bodies])[:-1].tolist()
    return b"".join(bodies), offsets


@impl_params
@pytest.mark.parametrize("kgr", [None, (0, 29), (5, 9), (12, 12), (100, 200), (0, -1)])
def test_iterator_walk_matches_the_list_decoder(impl, kgr):
    logical, offsets = _stream([_random_changes(s, n) for s, n in ((1, 400), (2, 1), (3, 0), (4, 90))])
    for off in offsets:
        want, end = impl.decode.decode_change_set(logical, off, kgr)
        it = impl.decode.iter_change_set(logical, off, kgr)
        assert it.end == end and len(it) == len(want)
        got = []
        for c in it:
            got.append(c)
            assert len(it) == len(want) - len(got)
        assert got == want
        assert all(type(c) is impl.StateChange for c in got)
        assert next(it, None) is None  # stays exhausted


def test_empty_groups_are_walked_over():
    # a hand-built body: group 3 with no changes, then group 4 with two, then an empty metadata group
    def be(v):
        return int(v).to_bytes(4, "big", signed=True)
    body = be(3) + be(0) + be(3) + be(2) + be(4) + be(1) + b"a" + be(2) + b"bc" + be(0) + be(-1)
    from format_helpers import IMPLS
    for impl in IMPLS:
        assert list(impl.decode.iter_change_set(body)) == [StateChange(4, b"a"), StateChange(4, b"bc")]
        assert list(impl.decode.iter_change_set(body, 0, (5, 9))) == []


@impl_params
def test_chain_changes_in_order_closing_each_change_set(impl):
    sets = [_random_changes(s, n) for s, n in ((7, 50), (8, 0), (9, 3), (10, 200))]
    logical, offsets = _stream(sets)
    its = [impl.decode.iter_change_set(logical, off, (0, 20)) for off in offsets]
    want = [c for off in offsets for c in impl.decode.decode_change_set(logical, off, (0, 20))[0]]
    seen = []

    def entries():
        for it in its:
            seen.append(it)
            assert all(len(prev) == 0 for prev in seen[:-1])  # the previous ones are done (closed)
            yield it

    chain = impl.decode.chain_changes(entries())
    assert iter(chain) is chain
    assert list(chain) == want
    assert next(chain, None) is None
    assert len(seen) == len(its)


@impl_params
def test_chain_changes_refuses_other_items_and_passes_errors_on(impl):
    body = fmt.encode_change_set([StateChange(1, b"x")])
    chain = impl.decode.chain_changes([impl.decode.iter_change_set(body), [StateChange(2, b"y")]])
    assert next(chain) == StateChange(1, b"x")
    with pytest.raises(TypeError, match="expected a ChangeIterator, got list"):
        next(chain)

    def failing():
        yield impl.decode.iter_change_set(body)
        raise ValueError("entry failed")

    chain = impl.decode.chain_changes(failing())
    assert next(chain) == StateChange(1, b"x")
    with pytest.raises(ValueError, match="entry failed"):
        next(chain)
    with pytest.raises(TypeError):
        impl.decode.chain_changes(5)  # not iterable: refused at once
