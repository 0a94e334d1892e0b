"""Pure-Python twin of `dstl._fast._keyed`: the single-key path of keyed state.

One call does what `ValueState.update`, `ListState.add`, `MapState.put` and `clear` share: the key's
key group (with the backend's checks), the change payload (the operation byte, then the msgpack
array `[state_id, key, fields...]`, docs in dstl/state/changes.py) and the writer append, with the
backend's counters. The Cython module gives byte-identical payloads and the same errors.
"""
from __future__ import annotations

from typing import Any

import msgpack
import numpy as np

from dstl._fast._hash_py import assign_to_key_group

_KEY_TYPES = (int, str, bytes)


def key_group_of(key: Any, max_parallelism: int, kg_start: int, kg_end: int, key_group_range) -> int:
    """The key group of a state key; TypeError for keys that are not int, str or bytes, ValueError
    when the group is outside the backend's range."""
    if type(key) not in _KEY_TYPES:
        if isinstance(key, np.integer):
            raise TypeError(f"state keys must be Python int, str or bytes; convert {type(key).__name__} "
                            f"with int()")
        if isinstance(key, bool) or not isinstance(key, _KEY_TYPES):
            raise TypeError(f"state keys must be int, str or bytes, got {type(key).__name__}: {key!r}")
    kg = assign_to_key_group(key, max_parallelism)
    if not kg_start <= kg <= kg_end:
        raise ValueError(f"key {key!r} belongs to key group {kg}, outside this backend's range "
                         f"{key_group_range}")
    return kg


def serialize_error(exc: BaseException, name: str, key: Any) -> BaseException:
    """The error of a change that cannot be encoded, naming the state and the key."""
    err = type(exc)(f"state {name!r}, key {key!r:.80}: cannot serialize the change: {exc}")
    err.__cause__ = exc
    return err


def closed_error(backend) -> RuntimeError:
    return RuntimeError(f"keyed state backend {backend.operator_id!r} {backend.key_group_range} is closed")


class KeyedAppender:
    """The appends of one keyed state backend: key -> key group, writer append, change counters.

    `changes`/`nbytes` count the changes and payload bytes logged since the last materialization; an
    OSError of the append (a pre-emptive upload failed after the change was taken) is left in
    `deferred_error`, to be raised once the caller applied the change in memory. `every_changes` /
    `every_bytes` are the backend's materialization interval (0: none). The backend's
    `_deferred_error`, `_since_changes`, `materialize_every_*` are these fields: the bound
    `value_update` checks them without a Python attribute lookup on the backend.
    """

    __slots__ = ("backend", "writer_append", "max_parallelism", "kg_start", "kg_end", "key_group_range",
                 "changes", "nbytes", "every_changes", "every_bytes", "deferred_error", "closed")

    def __init__(self, backend, writer_append, max_parallelism: int, key_group_range):
        self.backend = backend
        self.writer_append = writer_append
        self.max_parallelism = max_parallelism
        self.kg_start = key_group_range.start
        self.kg_end = key_group_range.end
        self.key_group_range = key_group_range
        self.changes = 0
        self.nbytes = 0
        self.every_changes = 0
        self.every_bytes = 0
        self.deferred_error = None
        self.closed = False

    def kg(self, key: Any) -> int:
        return key_group_of(key, self.max_parallelism, self.kg_start, self.kg_end, self.key_group_range)

    def append(self, kg: int, payload: bytes) -> None:
        """Log one encoded change of key group `kg`."""
        if self.closed:
            raise closed_error(self.backend)
        try:
            self.writer_append(kg, payload)
        except OSError as exc:
            self.deferred_error = exc
        self.changes += 1
        self.nbytes += len(payload)

    def due(self) -> bool:
        """What the backend's `_mutated` would act on: a deferred append error, a reached interval."""
        return self.deferred_error is not None or (self.every_changes != 0 and self.changes >= self.every_changes) \
            or (self.every_bytes != 0 and self.nbytes >= self.every_bytes)

    def for_state(self, state_id: int, name: str) -> "StateAppender":
        return StateAppender(self, state_id, name)


class StateAppender:
    """The single-key changes of one state: `change(op, key, *fields)` logs `[state_id, key, *fields]`
    under operation `op` and returns the key's key group."""

    __slots__ = ("appender", "state_id", "name", "tables", "set_op", "slow_get", "slow_update")

    def __init__(self, appender: KeyedAppender, state_id: int, name: str):
        self.appender = appender
        self.state_id = state_id
        self.name = name
        self.tables = appender.backend._table  # key group -> state name -> {key: value}

    def change(self, op: int, key: Any, *fields: Any) -> int:
        k = self.appender
        kg = k.kg(key)
        try:
            payload = bytes((op,)) + msgpack.packb([self.state_id, key, *fields], use_bin_type=True)
        except (TypeError, ValueError, OverflowError) as exc:
            raise serialize_error(exc, self.name, key) from exc
        k.append(kg, payload)
        return kg

    def set(self, op: int, key: Any, logged: Any, value: Any) -> int:
        """`change(op, key, logged)`, then `value` becomes the key's entry in this state's table."""
        kg = self.change(op, key, logged)
        t = self.tables.get(kg)
        if t is None:
            t = self.tables[kg] = {}
        s = t.get(self.name)
        if s is None:
            s = t[self.name] = {}
        s[key] = value
        return kg

    def bind_value(self, set_op: int, slow_get, slow_update):
        """`(get, update)` of a ValueState with a native serializer as two bound methods: an int, str
        or bytes key (and, for update, a value that is not None) is handled here; anything else goes
        to `slow_get(key, default)` / `slow_update(key, value)`, the state's own methods."""
        self.set_op = set_op
        self.slow_get = slow_get
        self.slow_update = slow_update
        return self.value_get, self.value_update

    def value_get(self, key: Any, default: Any = None) -> Any:
        """ValueState.get (see bind_value)."""
        if type(key) not in _KEY_TYPES:
            return self.slow_get(key, default)
        t = self.tables.get(self.appender.kg(key))
        if t is None:
            return default
        s = t.get(self.name)
        if s is None:
            return default
        return s.get(key, default)

    def value_update(self, key: Any, value: Any) -> None:
        """ValueState.update (see bind_value): logs SET, sets the entry, then the backend's `_mutated`
        when it has something to do (a deferred append error, a reached materialization interval)."""
        if value is None or type(key) not in _KEY_TYPES:
            return self.slow_update(key, value)
        self.set(self.set_op, key, value, value)
        k = self.appender
        if k.due():
            k.backend._mutated()


def plain_list(value: Any, types: tuple) -> Any:
    """`list(value)` when `value` is a tuple or list (exactly) whose items have exactly the types in
    `types`, one for one; else None. The processor adapters' plain-value encode
    (dstl/spark/processor_adapters.py)."""
    if type(value) in (tuple, list) and tuple(map(type, value)) == types:
        return list(value)
    return None
