"""Shared pieces of the keyed-state tests: a direct-mode storage on tmp_path and a state dump."""
import pytest

from dstl.changelog.storage import open_storage
from dstl.types import KeyGroupRange

MAXP = 128
FULL = KeyGroupRange(0, MAXP - 1)


@pytest.fixture
def storage(tmp_path):
    st = open_storage(str(tmp_path / "cl"), upload_mode="direct")
    try:
        yield st
    finally:
        st.close()


def dump(backend):
    return {name: dict(state.all_items()) for name, state in backend._states.items()}
