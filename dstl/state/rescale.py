"""Change a job's max parallelism offline (`dstl state rescale`).

The number of key groups fixes where every key lives, so changing it means moving every key: the
latest checkpoint's state is restored one old subtask at a time, every key is assigned its key group
under the new max parallelism, and each new subtask's state is written as one materialization
(KEY_GROUP_SNAPSHOT changes) into a new checkpoint with the next id. Timers, when they are kept as
keyed state, move with their key like any value. Operator state is repartitioned as on a rescale.
The job file's max parallelism is updated; a resumed job continues from the new checkpoint.

Runs in one process and holds the whole state in memory (an offline maintenance step).
"""
from __future__ import annotations

import json
import uuid
from typing import Any, Callable, Dict, Optional

__all__ = ["rescale_checkpoint"]

_OPERATOR = "dstl-rescale"


def _never() -> int:
    return -(1 << 62)


def rescale_checkpoint(base_path: str, max_parallelism: int, *, parallelism: Optional[int] = None,
                       serializers: Optional[Dict[str, Any]] = None,
                       storage_options: Optional[Dict[str, Any]] = None, options: Any = None,
                       on_step: Optional[Callable[[str, Optional[int]], None]] = None):
    """Rewrite the latest checkpoint at `base_path` with `max_parallelism` key groups (and
    `parallelism` subtasks, default: the old parallelism capped at the new max parallelism).
    `storage_options`: the file system's keyword arguments; `options`: dstl's storage options.
    `on_step(name, subtask)` is called at each step of the writes (`"mid_write"` once per new
    subtask's state uploaded, `"after_checkpoint"` before the job file is updated): the fault
    points `rescale.*` of `dstl state rescale` (dstl.spark.faults).
    Returns the new checkpoint's metadata."""
    from dstl.keygroups import UPPER_BOUND_MAX_PARALLELISM, assign_to_key_group
    from dstl.state import KeyedStateBackend
    from dstl.state.metadata import CheckpointMetadata, SubtaskState, write_checkpoint
    from dstl.state.operator import repartition
    from dstl.state.reader import _storage, key_group_ranges, open_checkpoint, restored_range

    if isinstance(max_parallelism, bool) or not isinstance(max_parallelism, int) \
            or not 1 <= max_parallelism <= UPPER_BOUND_MAX_PARALLELISM:
        raise ValueError(f"--max-parallelism must be in 1..{UPPER_BOUND_MAX_PARALLELISM}, got {max_parallelism!r}")
    old = open_checkpoint(base_path, storage_options=storage_options)
    p = parallelism if parallelism is not None else min(old.parallelism, max_parallelism)
    if isinstance(p, bool) or not isinstance(p, int) or not 1 <= p <= max_parallelism:
        raise ValueError(f"--parallelism must be in 1..{max_parallelism} (the new max parallelism), got {p!r}")
    ranges = key_group_ranges(max_parallelism, p)
    if len(ranges) != p:  # pragma: no cover - key_group_ranges caps at max parallelism
        raise ValueError(f"parallelism {p} exceeds max parallelism {max_parallelism}")
    new_id = old.checkpoint_id + 1
    storage = _storage(base_path, old.job_id, storage_options, options)
    # no TTL purge in an offline rewrite: expiry is judged in the job's own time (StatefulStream: the
    # batch timestamp), which the wall clock here may be far ahead of
    backends = [KeyedStateBackend(storage, _OPERATOR, r, max_parallelism, ttl_clock=_never)
                for r in ranges]
    try:
        for s in old.subtasks:
            if s.key_group_range.is_empty():
                continue
            with restored_range(base_path, old, s.key_group_range, serializers=serializers,
                                storage_options=storage_options, options=options) as src:
                for name in src.state_names:
                    st = src.get_state(name)
                    for b in backends:
                        b._register(name, st.kind, st.serializer, dict(st.meta.options))
                for per_state in src._table.values():
                    for name, entries in per_state.items():
                        for key, value in entries.items():
                            kg = assign_to_key_group(key, max_parallelism)
                            b = backends[kg * p // max_parallelism]
                            b._table.setdefault(kg, {}).setdefault(name, {})[key] = value
        snaps = []
        for i, b in enumerate(backends):
            b.materialize(force=True)
            snaps.append(b.snapshot(new_id).result())
            if on_step is not None:
                on_step("mid_write", i)  # subtasks 0..i uploaded, no checkpoint yet
        ops = repartition(old.operator_states(), p) if any(old.operator_states()) else [[] for _ in range(p)]
        props = dict(old.properties)
        props.update(tokens=[uuid.uuid4().hex for _ in range(p)], rescaled_from=old.checkpoint_id,
                     max_parallelism_from=old.max_parallelism)
        meta = CheckpointMetadata(new_id, max_parallelism, p,
                                  [SubtaskState.from_keyed_snapshot(i, sn, ops[i]) for i, sn in enumerate(snaps)],
                                  props, job_id=old.job_id)
        write_checkpoint(base_path, meta)
        for b in backends:
            b.confirm(new_id)
    finally:
        for b in backends:
            b.close()
        storage.close()
    if on_step is not None:
        on_step("after_checkpoint", None)  # the new checkpoint is durable, the job file not updated
    update_job_file(base_path, max_parallelism)
    from dstl.state.metadata import read_checkpoint

    return read_checkpoint(base_path, new_id)


def update_job_file(base_path: str, max_parallelism: int) -> bool:
    """Set the max parallelism in `<base>/_dstl_job.json` (if there is one); True if it changed."""
    from dstl.changelog.fs import filesystem

    fs, root = filesystem(base_path)
    path = f"{root.rstrip('/')}/_dstl_job.json"
    fs.invalidate_cache()
    if not fs.exists(path):
        return False
    d = json.loads(fs.cat_file(path).decode())
    if d.get("max_parallelism") == max_parallelism:
        return False
    d["max_parallelism"] = max_parallelism
    with fs.open(path, "wb") as f:
        f.write(json.dumps(d, indent=1, sort_keys=True).encode())
    return True
