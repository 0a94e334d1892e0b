"""`ProcessorHandle`: Spark's StatefulProcessorHandle on a dstl keyed state backend (the states a
processor declares, its timers, `deleteIfExists`), and `declared_schemas`, what the driver learns from
running `init` with a recording handle. See dstl.spark.processor."""
from __future__ import annotations

from typing import Any, Dict, Iterator, List, Optional

from dstl.spark.processor_adapters import (ListStateAdapter, MapStateAdapter, ValueStateAdapter, _StateAdapter,
                                           adapter_for)
from dstl.spark.processor_context import RESERVED_PREFIX, BatchContext
from dstl.state import ttl as T
from dstl.state.schema import StateSchema
from dstl.state.timers import TimerService

__all__ = ["ProcessorHandle", "declared_schemas"]


class ProcessorHandle:
    """Spark's StatefulProcessorHandle on a dstl backend (or, without one, a recorder of declared
    states: what the driver runs `init` with to learn the state schemas, as Spark's PRE_INIT does)."""

    def __init__(self, backend: Any = None, ctx: Optional[BatchContext] = None):
        self._b = backend
        self._ctx = ctx or BatchContext(0, 0)
        self._key: Any = None
        self.schemas: Dict[str, StateSchema] = {}
        self._timers = None
        #: the handles given out per state name (deleteIfExists turns them into failing ones)
        self._handed: Dict[str, List[_StateAdapter]] = {}
        self._defined: set = set()

    # ---------------------------------------------------------------- states
    def _declare(self, spec: StateSchema) -> StateSchema:
        if not isinstance(spec.name, str) or not spec.name:
            raise ValueError(f"a state name must be a non-empty str, got {spec.name!r}")
        if spec.name.startswith(RESERVED_PREFIX):
            raise ValueError(f"state names starting with {RESERVED_PREFIX!r} are reserved for dstl: {spec.name!r}")
        if spec.name in self._defined:
            from pyspark.errors import PySparkRuntimeError  # PySpark: only where a processor runs

            # Spark refuses a second definition in one init, even after deleteIfExists
            raise PySparkRuntimeError(
                f"Error initializing {spec.kind} state: [STATEFUL_PROCESSOR_DUPLICATE_STATE_VARIABLE_DEFINED] "
                f"State variable with name {spec.name} has already been defined in the StatefulProcessor.")
        self._defined.add(spec.name)
        self.schemas[spec.name] = spec
        return spec

    def _raw(self, spec: StateSchema):
        b = self._b
        if b is None:
            return None
        options = {T.TTL_OPTION: True} if spec.ttl_ms is not None else {}
        existing = b._states.get(spec.name)
        if existing is not None and bool(existing.meta.options.get(T.TTL_OPTION)) != bool(options):
            have = "with" if existing.meta.options.get(T.TTL_OPTION) else "without"
            raise ValueError(f"state {spec.name!r} was created {have} a TTL; its TTL cannot be "
                             f"{'removed' if have == 'with' else 'added'} (use another state name)")
        if existing is not None and existing.kind != spec.kind:
            raise ValueError(f"state {spec.name!r} holds {existing.kind} state, not {spec.kind} state")
        raw = b._register(spec.name, spec.kind, None, options)
        if spec.ttl_ms is None:
            return raw
        return raw.with_ttl(spec.ttl_ms, self._batch_clock)

    def _batch_clock(self) -> int:
        return self._ctx.batch_timestamp_ms

    def _hand_out(self, spec: StateSchema):
        adapter = adapter_for(spec.kind)(self, self._raw(spec), spec)
        self._handed.setdefault(spec.name, []).append(adapter)
        return adapter

    def getValueState(self, stateName: str, schema: Any, ttlDurationMs: Optional[int] = None) -> ValueStateAdapter:
        spec = self._declare(StateSchema(stateName, "value", schema, ttl_ms=ttlDurationMs))
        return self._hand_out(spec)

    def getListState(self, stateName: str, schema: Any, ttlDurationMs: Optional[int] = None) -> ListStateAdapter:
        spec = self._declare(StateSchema(stateName, "list", schema, ttl_ms=ttlDurationMs))
        return self._hand_out(spec)

    def getMapState(self, stateName: str, userKeySchema: Any, valueSchema: Any,
                    ttlDurationMs: Optional[int] = None) -> MapStateAdapter:
        spec = self._declare(StateSchema(stateName, "map", valueSchema, userKeySchema, ttlDurationMs))
        return self._hand_out(spec)

    def deleteIfExists(self, stateName: str) -> None:
        """Remove the state and every value of it (every key of this subtask: the whole state).
        As in Spark, a handle of it raises `PySparkRuntimeError` on any call afterwards, and the
        name cannot be defined again in the same `init`."""
        b = self._b
        self.schemas.pop(stateName, None)
        for adapter in self._handed.get(stateName, []):
            adapter.__class__ = adapter._dropped
        if b is None or stateName not in b._states:
            return
        raw = b._states[stateName]
        for key in raw.keys_with_state():
            raw.clear(key)

    # ---------------------------------------------------------------- timers
    def _timer_service(self):
        if self._ctx.time_mode == "None":
            raise RuntimeError("timers need time_mode='ProcessingTime' or 'EventTime' (this stream has "
                               "time_mode='None')")
        if self._b is None:
            raise RuntimeError("timers can only be used while handling rows or timers")
        if self._timers is None:
            self._timers = TimerService(self._b)
        return self._timers

    def _timer_key(self) -> Any:
        if self._key is None:
            raise RuntimeError("timers are per grouping key: use them in handleInputRows, "
                               "handleExpiredTimer or handleInitialState")
        return self._key

    def registerTimer(self, expiryTimestampMs: int) -> None:
        self._timer_service().register(self._timer_key(), expiryTimestampMs)

    def deleteTimer(self, expiryTimestampMs: int) -> None:
        self._timer_service().delete(self._timer_key(), expiryTimestampMs)

    def listTimers(self) -> Iterator[int]:
        return iter(self._timer_service().list(self._timer_key()))


def declared_schemas(processor: Any) -> Dict[str, StateSchema]:
    """The states `processor.init` declares (run on the driver with a recording handle)."""
    handle = ProcessorHandle(None)
    processor.init(handle)
    try:
        processor.close()
    except Exception:  # a close() that expects a fully initialised processor: harmless here
        pass
    return handle.schemas
