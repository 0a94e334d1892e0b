"""The keyed state kinds reach their backend only through dstl.state.host.StateHost (and the restore
replay through restore.RestoreTarget): a real KeyedStateBackend has every member those Protocols
name, methods with the same parameters, so the kinds' view of the backend cannot drift from it."""
from __future__ import annotations

import inspect

import pytest

from dstl.state.backend import KeyedStateBackend
from dstl.state.host import StateHost
from dstl.state.restore import RestoreTarget

from state_helpers import FULL, MAXP, storage  # noqa: F401  (storage: fixture)


def _members(protocol) -> dict:
    """name -> function (methods) or None (annotated attributes) of a Protocol and its bases."""
    out: dict = {}
    for cls in reversed(protocol.__mro__):
        if cls is object or not getattr(cls, "_is_protocol", False) or cls.__module__ == "typing":
            continue
        out.update({name: None for name in cls.__dict__.get("__annotations__", {})})
        out.update({name: fn for name, fn in vars(cls).items()
                    if inspect.isfunction(fn) and not (name.startswith("__") and name.endswith("__"))})
    return out


def test_the_protocols_name_what_the_kinds_use():
    """Guards the next test against passing on an empty member list."""
    host, target = _members(StateHost), _members(RestoreTarget)
    assert {"_table", "_k", "_kg", "_kg_start", "max_parallelism", "key_group_range", "_check_kgs",
            "_append", "_append_many", "_mutated"} <= set(host)
    assert set(host) < set(target)
    assert {"_new_state", "_states", "_next_sid", "_writer", "storage", "restore_stats"} <= set(target)


@pytest.mark.parametrize("protocol", [StateHost, RestoreTarget], ids=lambda p: p.__name__)
def test_a_real_backend_has_every_member(storage, protocol):  # noqa: F811
    backend = KeyedStateBackend(storage, "host", FULL, MAXP)
    try:
        missing, differ = [], []
        for name, fn in _members(protocol).items():
            if not hasattr(backend, name):
                missing.append(name)
            elif fn is not None:
                want = list(inspect.signature(fn).parameters)[1:]  # without self
                have = list(inspect.signature(getattr(backend, name)).parameters)
                if want != have:
                    differ.append(f"{name}: protocol {want}, backend {have}")
        assert not missing and not differ, f"missing {missing}; different parameters {differ}"
    finally:
        backend.close()
