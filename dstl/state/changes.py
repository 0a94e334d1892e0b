"""The payload of one keyed-state change: one operation byte, then one msgpack document.

Operation codes are Flink's `StateChangeOperation` codes (flink-statebackend-changelog, checked
against its source: CLEAR 0, SET 1, SET_INTERNAL 2, ADD 3, MERGE_NS 4, ADD_ELEMENT 5,
ADD_OR_UPDATE_ELEMENT 6, REMOVE_ELEMENT 7, REMOVE_FIRST_ELEMENT 8, METADATA 9), so a change reads the
same to anyone who knows Flink's changelog backend (docs/format.md §2 pins 9 = METADATA):

| code | name | dstl body (msgpack array unless noted) | produced by |
|---|---|---|---|
| 0 | CLEAR | `[state_id, key]` | every state's `clear(key)`; `ValueState.update(key, None)` |
| 1 | SET | `[state_id, key, value]` | `ValueState.update`, `ListState.update` (value = the whole list) |
| 2 | SET_INTERNAL | `[state_id, key, value]` | `ReducingState.add` (value = the already reduced result, so a replay needs no reduce function) |
| 3 | ADD | `[state_id, key, values]` | `ListState.add_all` (a list), `MapState.put_all` (a map) |
| 5 | ADD_ELEMENT | `[state_id, key, value]` | `ListState.add` |
| 6 | ADD_OR_UPDATE_ELEMENT | `[state_id, key, user_key, value]` | `MapState.put` |
| 7 | REMOVE_ELEMENT | `[state_id, key, user_key]` | `MapState.remove` |
| 9 | METADATA | a msgpack map: `v`, `id`, `name`, `kind`, `serializer`, `options` | state registration |
| 32 | KEY_GROUP_SNAPSHOT | `[[state_id, {key: value, ...}], ...]`: the whole state of one key group | materialization (dstl's own code; Flink materializes elsewhere) |

Flink's MERGE_NS (4, namespaces) and REMOVE_FIRST_ELEMENT (8, priority queues) have no use here. `state_id` is a small int that
is only meaningful together with the METADATA changes of the same log (every log segment a
checkpoint references starts with them, see keyed.py). Values are embedded as msgpack objects for the
native msgpack serializer and as msgpack `bin` (the serializer's bytes) otherwise.
"""
from __future__ import annotations

from typing import Any, Dict, List, Tuple

from dstl.errors import CorruptChangelogError
from dstl.state.serializers import packb, unpackb

__all__ = [
    "CLEAR", "SET", "SET_INTERNAL", "ADD", "ADD_ELEMENT", "ADD_OR_UPDATE_ELEMENT", "REMOVE_ELEMENT",
    "METADATA", "KEY_GROUP_SNAPSHOT", "OP_NAMES", "KINDS", "StateMeta",
    "encode", "decode", "encode_meta", "decode_meta", "row_prefix",
]

CLEAR = 0
SET = 1
SET_INTERNAL = 2
ADD = 3
MERGE_NS = 4              # Flink only (namespaces); never written by dstl
ADD_ELEMENT = 5
ADD_OR_UPDATE_ELEMENT = 6
REMOVE_ELEMENT = 7
REMOVE_FIRST_ELEMENT = 8  # Flink only (priority queues); never written by dstl
METADATA = 9
KEY_GROUP_SNAPSHOT = 32

OP_NAMES: Dict[int, str] = {
    CLEAR: "CLEAR", SET: "SET", SET_INTERNAL: "SET_INTERNAL", ADD: "ADD", ADD_ELEMENT: "ADD_ELEMENT",
    ADD_OR_UPDATE_ELEMENT: "ADD_OR_UPDATE_ELEMENT", REMOVE_ELEMENT: "REMOVE_ELEMENT",
    METADATA: "METADATA", KEY_GROUP_SNAPSHOT: "KEY_GROUP_SNAPSHOT",
}

KINDS = ("value", "list", "map", "reducing")
META_VERSION = 1
_OP_BYTES = {op: bytes((op,)) for op in OP_NAMES}


class StateMeta:
    """What a METADATA change records about one registered state."""

    __slots__ = ("state_id", "name", "kind", "serializer_id", "options")

    def __init__(self, state_id: int, name: str, kind: str, serializer_id: str,
                 options: Dict[str, Any] | None = None):
        if kind not in KINDS:
            raise ValueError(f"unknown state kind {kind!r} (expected one of {', '.join(KINDS)})")
        if not isinstance(name, str) or not name:
            raise ValueError(f"state name must be a non-empty str, got {name!r}")
        self.state_id = int(state_id)
        self.name = name
        self.kind = kind
        self.serializer_id = serializer_id
        self.options = dict(options or {})

    def same_definition(self, other: "StateMeta") -> bool:
        """Equal apart from the id (ids are per log)."""
        return (self.name, self.kind, self.serializer_id, self.options) == (
            other.name, other.kind, other.serializer_id, other.options)

    def __eq__(self, other) -> bool:
        return isinstance(other, StateMeta) and self.state_id == other.state_id and self.same_definition(other)

    def __repr__(self) -> str:
        return (f"StateMeta(id={self.state_id}, name={self.name!r}, kind={self.kind!r}, "
                f"serializer={self.serializer_id!r}, options={self.options!r})")


def encode(op: int, fields: List[Any]) -> bytes:
    """One change payload: the op byte followed by the msgpack of `fields`."""
    return _OP_BYTES[op] + packb(fields)


def row_prefix(op: int, num_fields: int, state_id: int) -> bytes:
    """The bytes every row of a bulk change starts with: op byte, array header, state id."""
    if not 0 <= num_fields <= 15:
        raise ValueError("bulk rows carry at most 15 fields")
    return _OP_BYTES[op] + bytes((0x90 | num_fields,)) + packb(state_id)


def decode(payload) -> Tuple[int, Any]:
    """`(op, body)` of one payload; raises CorruptChangelogError on anything malformed."""
    if len(payload) == 0:
        raise CorruptChangelogError("empty state change payload", 0)
    op = payload[0]
    if op not in OP_NAMES:
        raise CorruptChangelogError(f"unknown state change operation code {op}", 0)
    try:
        body = unpackb(payload[1:])
    except Exception as exc:  # msgpack raises several unrelated types
        raise CorruptChangelogError(f"undecodable {OP_NAMES[op]} change body: {exc}", 1) from exc
    return op, body


def encode_meta(meta: StateMeta) -> bytes:
    return _OP_BYTES[METADATA] + packb({
        "v": META_VERSION, "id": meta.state_id, "name": meta.name, "kind": meta.kind,
        "serializer": meta.serializer_id, "options": meta.options,
    })


def decode_meta(body: Any) -> StateMeta:
    """The StateMeta of a decoded METADATA body."""
    if not isinstance(body, dict) or body.get("v") != META_VERSION:
        raise CorruptChangelogError(f"unsupported state metadata change: {body!r}", 0)
    try:
        return StateMeta(body["id"], body["name"], body["kind"], body["serializer"], body.get("options"))
    except (KeyError, ValueError, TypeError) as exc:
        raise CorruptChangelogError(f"malformed state metadata change {body!r}: {exc}", 0) from exc
