"""State on the changelog: keyed state, operator state (FLIP-8), materialization, checkpoint metadata."""
from __future__ import annotations

from typing import Dict

from dstl._lazy import lazy_getattr

_EXPORTS: Dict[str, str] = {
    "KeyedStateBackend": "dstl.state.backend", "ValueState": "dstl.state.value",
    "ListState": "dstl.state.list", "MapState": "dstl.state.map",
    "ReducingState": "dstl.state.value", "KeyedStateSnapshot": "dstl.state.snapshot",
    "register_serializer": "dstl.state.serializers",
    "OperatorListState": "dstl.state.operator", "OperatorStateHandle": "dstl.state.operator",
    "repartition": "dstl.state.operator",
    "CheckpointMetadata": "dstl.state.metadata", "SubtaskState": "dstl.state.metadata",
    "write_checkpoint": "dstl.state.metadata", "read_checkpoint": "dstl.state.metadata",
    "latest_checkpoint": "dstl.state.metadata",
    "snapshot_operator_state": "dstl.state.operator", "restore_operator_state": "dstl.state.operator",
    "list_checkpoints": "dstl.state.metadata", "retained_files": "dstl.state.metadata",
    "TimerService": "dstl.state.timers", "ValueSchema": "dstl.state.schema", "StateSchema": "dstl.state.schema",
    "TtlValueState": "dstl.state.ttl", "TtlListState": "dstl.state.ttl", "TtlMapState": "dstl.state.ttl",
    "read_state_pandas": "dstl.state.reader", "read_changes_pandas": "dstl.state.reader",
    "StateReadError": "dstl.state.reader", "read_timers_pandas": "dstl.state.reader",
    "SchemaEvolutionError": "dstl.state.evolution", "plan_evolution": "dstl.state.evolution",
    "plan_state_evolution": "dstl.state.evolution",
}
__all__ = sorted(_EXPORTS)

__getattr__ = lazy_getattr("dstl.state", _EXPORTS, globals())
