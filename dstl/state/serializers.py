"""Value serializers for keyed state: msgpack by default, pluggable by id.

A serializer is any object with an `id` (a short string recorded in the state's metadata change, so a
restore knows how to read the values), `dumps(obj) -> bytes` and `loads(data) -> obj`. The built-in
`MsgpackSerializer` is *native*: its values are embedded directly into the change body (one msgpack
document per change, no double encoding). Values of other serializers are embedded as msgpack `bin`.

Register your own with `register_serializer(obj)` (or pass `serializers={id: obj}` to
`KeyedStateBackend.restore`) so that a restored backend can decode what an earlier run wrote.
"""
from __future__ import annotations

import functools
import pickle
import threading
from typing import Any, Dict, Optional

import msgpack

__all__ = [
    "Serializer", "MsgpackSerializer", "PickleSerializer", "MSGPACK", "PICKLE",
    "packb", "unpackb", "register_serializer", "get_serializer", "resolve_serializer",
]


def packb(obj: Any) -> bytes:
    """msgpack with the options dstl uses everywhere: bytes stay `bin`, str stays `str`."""
    return msgpack.packb(obj, use_bin_type=True)


# Inverse of `packb`; map keys may be any hashable msgpack type (ints, bytes, ...). A partial, so a
# call costs no Python frame (replay calls it once per change).
unpackb = functools.partial(msgpack.unpackb, raw=False, strict_map_key=False, use_list=True)


class Serializer:
    """Base class (optional: duck typing is enough). `native` is True only for msgpack itself."""

    id: str = ""
    native: bool = False

    def dumps(self, obj: Any) -> bytes:  # pragma: no cover - interface
        raise NotImplementedError

    def loads(self, data) -> Any:  # pragma: no cover - interface
        raise NotImplementedError

    def __repr__(self) -> str:
        return f"{type(self).__name__}(id={self.id!r})"


class MsgpackSerializer(Serializer):
    """msgpack: ints, floats, str, bytes, bool, None, lists and maps. Tuples come back as lists."""

    id = "msgpack"
    native = True

    def dumps(self, obj: Any) -> bytes:
        return packb(obj)

    def loads(self, data) -> Any:
        return unpackb(data)


class PickleSerializer(Serializer):
    """Any picklable Python object (only for data you trust: unpickling runs code)."""

    id = "pickle"
    native = False

    def dumps(self, obj: Any) -> bytes:
        return pickle.dumps(obj, protocol=pickle.HIGHEST_PROTOCOL)

    def loads(self, data) -> Any:
        return pickle.loads(bytes(data))


MSGPACK = MsgpackSerializer()
PICKLE = PickleSerializer()

_lock = threading.Lock()
_registry: Dict[str, Any] = {MSGPACK.id: MSGPACK, PICKLE.id: PICKLE}


def _check(serializer: Any) -> Any:
    sid = getattr(serializer, "id", None)
    if not isinstance(sid, str) or not sid:
        raise TypeError(f"a serializer needs a non-empty string `id`, got {serializer!r}")
    for name in ("dumps", "loads"):
        if not callable(getattr(serializer, name, None)):
            raise TypeError(f"serializer {sid!r} has no callable {name}()")
    return serializer


def register_serializer(serializer: Any) -> Any:
    """Make `serializer` known by its id (process-wide). Re-registering the same id replaces it."""
    _check(serializer)
    with _lock:
        _registry[serializer.id] = serializer
    return serializer


def get_serializer(serializer_id: str, extra: Optional[Dict[str, Any]] = None) -> Any:
    """The serializer registered under `serializer_id` (`extra` is searched first)."""
    if extra and serializer_id in extra:
        return _check(extra[serializer_id])
    with _lock:
        found = _registry.get(serializer_id)
    if found is None:
        raise ValueError(
            f"unknown state serializer id {serializer_id!r}: register it with "
            f"dstl.state.serializers.register_serializer() or pass serializers={{id: obj}} to restore()")
    return found


def resolve_serializer(serializer: Any) -> Any:
    """None -> msgpack; a string -> the registered serializer; an object -> itself (checked)."""
    if serializer is None:
        return MSGPACK
    if isinstance(serializer, str):
        return get_serializer(serializer)
    return _check(serializer)
