"""The state handles a StatefulProcessor gets: Spark's ValueState, ListState and MapState on a dstl
state (the state's own object, or its TTL view), values encoded by the declared schema.

`ADAPTERS` names the adapter of every state kind (None where Spark's handle has no such state);
importing this module fails when a state kind (dstl.state.kinds) is missing from it.
"""
from __future__ import annotations

from typing import Any, Dict, Iterator, List, Optional, Tuple

from dstl.state.kinds import require_every_kind
from dstl.state.schema import StateSchema
from dstl.state.value import plain_list as _plain_list

__all__ = ["ValueStateAdapter", "ListStateAdapter", "MapStateAdapter", "ADAPTERS", "adapter_for"]


def _plain_types(value_schema) -> Optional[Tuple[type, ...]]:
    """The exact Python type of each field when every field is a plain long/int/double/string/bool
    (stored as itself), else None: then a tuple of exactly those types encodes and decodes as a plain
    copy, which is most per-key state and skips the per-field codecs."""
    from pyspark.sql import types as T  # PySpark: only where a processor runs

    plain = ((T.ByteType, int), (T.ShortType, int), (T.IntegerType, int), (T.LongType, int),
             (T.DoubleType, float), (T.FloatType, float), (T.StringType, str), (T.BooleanType, bool))
    out = []
    for f in value_schema.struct.fields:
        t = next((py for spark_t, py in plain if isinstance(f.dataType, spark_t)), None)
        if t is None:
            return None
        out.append(t)
    return tuple(out)


class _StateAdapter:
    """A state of the processor's handle (dstl.spark.processor_handle) seen as Spark's API has it:
    values are tuples of the declared schema, scoped to the handle's current grouping key."""

    kind = ""
    #: method -> the text Spark's error starts with once the state was deleted (deleteIfExists)
    dropped_messages: Dict[str, str] = {}

    def __init__(self, handle: Any, state: Any, spec: StateSchema):
        self._h = handle
        self._s = state
        self._spec = spec
        self._v = spec.value
        self._plain = _plain_types(spec.value)

    def _enc(self, value: Any) -> Any:
        """The value schema's encode, with the plain-tuple fast path (same result)."""
        enc = None if self._plain is None else _plain_list(value, self._plain)
        return self._v.encode(value) if enc is None else enc

    def _dec(self, stored: Any) -> Tuple:
        if self._plain is not None and len(stored) == len(self._plain):
            return tuple(stored)  # plain fields are stored as themselves (None included)
        return self._v.decode(stored)

    def _key(self) -> Any:
        k = self._h._key
        if k is None:
            raise RuntimeError(f"state {self._spec.name!r} is used outside handleInputRows, "
                               f"handleExpiredTimer or handleInitialState (no grouping key is set)")
        return k

    def __repr__(self) -> str:
        return f"{type(self).__name__}({self._spec!r})"


class ValueStateAdapter(_StateAdapter):
    """Spark's ValueState: exists / get / update / clear for the grouping key."""

    kind = "value"
    dropped_messages = {"exists": "Error checking value state exists", "get": "Error getting value state",
                        "update": "Error updating value state", "clear": "Error clearing value state"}

    # exists, get and update are called once or more per key: the key check and the plain-tuple codec
    # are inlined (one Python frame per call instead of three); the state's get/update are the keyed
    # kernel's bound C methods (tests/test_state_fastpath.py)
    def exists(self) -> bool:
        k = self._h._key
        return self._s.get(self._key() if k is None else k) is not None

    def get(self) -> Optional[Tuple]:
        k = self._h._key
        w = self._s.get(self._key() if k is None else k)
        if w is None:
            return None
        p = self._plain
        return tuple(w) if p is not None and len(w) == len(p) else self._v.decode(w)

    def update(self, newValue: Tuple) -> None:
        k = self._h._key
        if k is None:
            k = self._key()  # raises: no grouping key is set
        p = self._plain
        enc = None if p is None else _plain_list(newValue, p)
        self._s.update(k, self._v.encode(newValue) if enc is None else enc)

    def clear(self) -> None:
        self._s.clear(self._key())


class ListStateAdapter(_StateAdapter):
    """Spark's ListState: exists / get / put / appendValue / appendList / clear."""

    kind = "list"
    dropped_messages = {"exists": "Error checking value state exists", "get": "Error getting list state",
                        "put": "Error updating value state", "appendValue": "Error updating value state",
                        "appendList": "Error updating value state", "clear": "Error clearing value state"}

    def exists(self) -> bool:
        return bool(self._s.get(self._key()))

    def get(self) -> Iterator[Tuple]:
        dec = self._v.decode
        return iter([dec(w) for w in self._s.get(self._key())])

    def put(self, newState: List[Tuple]) -> None:
        enc = self._v.encode
        self._s.update(self._key(), [enc(v) for v in newState])

    def appendValue(self, newState: Tuple) -> None:
        self._s.add(self._key(), self._v.encode(newState))

    def appendList(self, newState: List[Tuple]) -> None:
        enc = self._v.encode
        self._s.add_all(self._key(), [enc(v) for v in newState])

    def clear(self) -> None:
        self._s.clear(self._key())


class MapStateAdapter(_StateAdapter):
    """Spark's MapState: exists / getValue / containsKey / updateValue / iterator / keys / values /
    removeKey / clear."""

    kind = "map"
    dropped_messages = {"exists": "Error checking map state exists", "getValue": "Error getting value",
                        "containsKey": "Error checking if map state contains key",
                        "updateValue": "Error updating map state value",
                        "iterator": "Error getting map state iterator", "keys": "Error getting map state keys",
                        "values": "Error getting map state values",
                        "removeKey": "Error removing key from map state", "clear": "Error clearing map state"}

    def __init__(self, handle, state, spec):
        super().__init__(handle, state, spec)
        self._k = spec.user_key

    def exists(self) -> bool:
        return not self._s.is_empty(self._key())

    def getValue(self, key: Tuple) -> Optional[Tuple]:
        w = self._s.get(self._key(), self._k.encode_key(key))
        return None if w is None else self._v.decode(w)

    def containsKey(self, key: Tuple) -> bool:
        return self._s.contains(self._key(), self._k.encode_key(key))

    def updateValue(self, key: Tuple, value: Tuple) -> None:
        self._s.put(self._key(), self._k.encode_key(key), self._v.encode(value))

    def iterator(self) -> Iterator[Tuple[Tuple, Tuple]]:
        kd, vd = self._k.decode_key, self._v.decode
        return iter([(kd(uk), vd(w)) for uk, w in self._s.items(self._key())])

    def keys(self) -> Iterator[Tuple]:
        kd = self._k.decode_key
        return iter([kd(uk) for uk in self._s.keys(self._key())])

    def values(self) -> Iterator[Tuple]:
        vd = self._v.decode
        return iter([vd(w) for w in self._s.values(self._key())])

    def removeKey(self, key: Tuple) -> None:
        uk = self._k.encode_key(key)
        if self._s.contains(self._key(), uk):
            self._s.remove(self._key(), uk)

    def clear(self) -> None:
        self._s.clear(self._key())


# After `deleteIfExists(name)` Spark's state server has no column family `name`: every call on a
# handle of it fails with a PySparkRuntimeError whose text starts as the state client's does.
_MISSING = ("[STATE_STORE_UNSUPPORTED_OPERATION_ON_MISSING_COLUMN_FAMILY] State store operation={op} "
            "not supported on missing column family={name}.")


def _dropped_class(live: type) -> type:
    """`live`'s methods, each raising as Spark does on a deleted state."""
    def failing(method: str, text: str):
        def call(self, *args, **kwargs):
            from pyspark.errors import PySparkRuntimeError  # PySpark: only where a processor runs

            raise PySparkRuntimeError(f"{text}: " + _MISSING.format(op=method, name=self._spec.name))
        call.__name__ = method
        return call

    attrs = {m: failing(m, t) for m, t in live.dropped_messages.items()}
    attrs["__doc__"] = f"A {live.__name__} whose state was deleted (deleteIfExists): every call raises."
    return type(f"Dropped{live.__name__}", (live,), attrs)


#: state kind -> the adapter a processor's handle gives out for it (None: Spark's StatefulProcessorHandle
#: has no such state, so no processor can declare one)
ADAPTERS: Dict[str, Optional[type]] = {
    "value": ValueStateAdapter, "list": ListStateAdapter, "map": MapStateAdapter,
    "reducing": None,  # Spark has no reducing state; StateSchema refuses the kind
}
require_every_kind(ADAPTERS, f"{__name__}.ADAPTERS")

for _cls in ADAPTERS.values():
    if _cls is not None:
        _cls._dropped = _dropped_class(_cls)


def adapter_for(kind: str) -> type:
    """The adapter class of state kind `kind`; ValueError when Spark's handle has no such state."""
    cls = ADAPTERS.get(kind)
    if cls is None:
        raise ValueError(f"a StatefulProcessor cannot hold {kind} state (Spark's handle offers "
                         f"{', '.join(k for k, c in ADAPTERS.items() if c is not None)})")
    return cls
