"""The registry of keyed state kinds: kind name -> the `_State` subclass that implements it.

Importing this module imports every kind, so the registry is complete; it fails at import when a
kind of the format (dstl.state.changes.KINDS) has no class. A class that leaves out a member of
dstl.state.base.KIND_MEMBERS already fails at its class statement. Layers above the state kinds
that keep a table per kind (the processor's adapters, the in-memory baseline) check it with
`require_every_kind` when they are imported.
"""
from __future__ import annotations

from typing import Dict, List, Mapping

from dstl.state import changes as C
from dstl.state.base import KIND_CLASSES, KIND_MEMBERS, _State
from dstl.state.list import ListState
from dstl.state.map import MapState
from dstl.state.value import ReducingState, ValueState

__all__ = ["kind_class", "kind_names", "require_every_kind", "KIND_MEMBERS"]

#: the kinds' classes, imported here so that importing the registry registers them all
BUILT_IN = (ValueState, ListState, MapState, ReducingState)


def kind_names() -> List[str]:
    """Every state kind, in the format's order."""
    return list(C.KINDS)


def kind_class(kind: str) -> type:
    """The class of state kind `kind`; ValueError naming the known kinds otherwise."""
    cls = KIND_CLASSES.get(kind)
    if cls is None:
        raise ValueError(f"unknown state kind {kind!r} (known: {', '.join(C.KINDS)})")
    return cls


def require_every_kind(table: Mapping[str, object], what: str) -> None:
    """Raise TypeError unless `table` has an entry for exactly the registered kinds (an entry may be
    None where the kind deliberately has no such thing; it must still be listed)."""
    missing = [k for k in C.KINDS if k not in table]
    extra = sorted(k for k in table if k not in C.KINDS)
    if missing or extra:
        parts = ([f"no entry for {', '.join(missing)}"] if missing else []) + (
            [f"entries for unknown kinds {', '.join(extra)}"] if extra else [])
        raise TypeError(f"{what}: {'; '.join(parts)} (every state kind needs one, None where it has none)")


def _check_registry(classes: Dict[str, type]) -> None:
    missing = [k for k in C.KINDS if k not in classes]
    if missing:
        raise TypeError(f"state kinds {', '.join(missing)} of dstl.state.changes.KINDS have no class: "
                        f"subclass {_State.__module__}._State with kind = ... and import it in {__name__}")


_check_registry(KIND_CLASSES)
