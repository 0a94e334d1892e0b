"""Roll a job back to an older retained checkpoint.

`roll_back(base, checkpoint_id, output_path)`:

1. writes `<base>/_dstl_rollback.json` (the plan: target checkpoint, time, later checkpoints), so a
   crash half-way is finished by the next open;
2. moves the metadata of every later checkpoint to `<base>/checkpoints/_abandoned/<time>/chk-<id>/`
   (they are no longer complete checkpoints: nothing restores from them, and the ids are free again);
3. moves the committed output of their batches to `<output>/_rolled_back/<time>/batch-NNNNNN/`
   (StatefulStream: `batch_id=N/`), so the output holds each batch exactly once from the chosen
   checkpoint on;
4. drops StatefulStream's sink markers of those batches (`<base>/_dstl_sink/batch-N`), so each
   batch processed again after the roll-back is delivered to the sink again, once;
5. deletes the plan.

Their changelog files are then referenced by no retained checkpoint and are collected by the
coordinator's garbage collection like any unreferenced file.
"""
from __future__ import annotations

import datetime
import json
import logging
from dataclasses import dataclass, field
from typing import List, Optional

from dstl.changelog.fs import root_of
from dstl.spark.sink import SINK_DIR
from dstl.state.metadata import list_checkpoints, read_checkpoint
from dstl.state.reader import StateReadError
from dstl.state.relpaths import resolve

log = logging.getLogger(__name__)

ROLLBACK_FILE = "_dstl_rollback.json"
ABANDONED_DIR = "_abandoned"
ROLLED_BACK_DIR = "_rolled_back"


@dataclass
class RollbackResult:
    checkpoint_id: int
    abandoned: List[int] = field(default_factory=list)
    moved_batches: List[int] = field(default_factory=list)
    stamp: str = ""


def _fs(url: str):
    return root_of(url)


def _mv(fs, src: str, dst: str) -> None:
    fs.invalidate_cache()
    if not fs.exists(src):
        return
    parent = dst.rsplit("/", 1)[0]
    fs.makedirs(parent, exist_ok=True)
    if fs.isdir(src):
        fs.mv(src, dst, recursive=True)
    else:
        fs.mv(src, dst)
    fs.invalidate_cache()


def roll_back(base_path: str, checkpoint_id: int, output_path: Optional[str]) -> RollbackResult:
    """Make `checkpoint_id` the job's latest checkpoint again (see the module docstring)."""
    ids = list_checkpoints(base_path)
    if checkpoint_id not in ids:
        raise StateReadError(f"cannot roll back to checkpoint {checkpoint_id}: {base_path} retains "
                             f"{', '.join(map(str, ids)) or 'no checkpoints'} (raise the retention count "
                             "to keep older checkpoints)")
    target = read_checkpoint(base_path, checkpoint_id)  # must be readable before anything moves
    later = [c for c in ids if c > checkpoint_id]
    stamp = datetime.datetime.now(datetime.timezone.utc).strftime("%Y%m%dT%H%M%S%fZ")
    batches = []
    for c in later:
        try:
            batches.append(int(read_checkpoint(base_path, c).properties.get("batch")))
        except Exception:  # an unreadable later checkpoint: its batch is found from the target on
            pass
    first_batch = int(target.properties.get("batch", checkpoint_id - 1)) + 1
    plan = {"checkpoint_id": checkpoint_id, "stamp": stamp, "abandoned": later,
            "first_batch": first_batch, "output_path": output_path}
    fs, root = _fs(base_path)
    with fs.open(f"{root}/{ROLLBACK_FILE}", "wb") as f:
        f.write(json.dumps(plan, indent=1).encode())
    return finish_roll_back(base_path)


def _drop_sink_markers(base_path: str, first_batch: int) -> None:
    fs, root = _fs(f"{base_path.rstrip('/')}/{SINK_DIR}")
    fs.invalidate_cache()
    try:
        names = fs.ls(root, detail=False)
    except FileNotFoundError:
        return
    for p in names:
        name = p.rstrip("/").rsplit("/", 1)[-1]
        if name.startswith("batch-") and name[6:].isdigit() and int(name[6:]) >= first_batch:
            try:
                fs.rm(p)
            except FileNotFoundError:
                pass
    fs.invalidate_cache()


def finish_roll_back(base_path: str) -> Optional[RollbackResult]:
    """Carry out (again) a roll-back plan left at `base_path`; None if there is none."""
    fs, root = _fs(base_path)
    plan_file = f"{root}/{ROLLBACK_FILE}"
    fs.invalidate_cache()
    if not fs.exists(plan_file):
        return None
    plan = json.loads(fs.cat_file(plan_file).decode())
    stamp = plan["stamp"]
    for c in plan["abandoned"]:
        _mv(fs, f"{root}/checkpoints/chk-{c}", f"{root}/checkpoints/{ABANDONED_DIR}/{stamp}/chk-{c}")
    moved = []
    if plan.get("output_path"):
        out = resolve(base_path, plan["output_path"])
        ofs, oroot = _fs(out)
        ofs.invalidate_cache()
        try:
            entries = ofs.ls(oroot, detail=False)
        except FileNotFoundError:
            entries = []
        for e in sorted(entries):
            name = e.rstrip("/").rsplit("/", 1)[-1]
            if name.startswith("batch-") and name[6:].isdigit() and int(name[6:]) >= plan["first_batch"]:
                _mv(ofs, f"{oroot}/{name}", f"{oroot}/{ROLLED_BACK_DIR}/{stamp}/{name}")
                moved.append(int(name[6:]))
            elif name.startswith("batch_id=") and name[9:].isdigit() and int(name[9:]) >= plan["first_batch"]:
                _mv(ofs, f"{oroot}/{name}", f"{oroot}/{ROLLED_BACK_DIR}/{stamp}/{name}")
                moved.append(int(name[9:]))
    _drop_sink_markers(base_path, plan["first_batch"])
    fs.rm_file(plan_file)
    fs.invalidate_cache()
    log.info("rolled back to checkpoint %s: abandoned %s, output of batches %s moved", plan["checkpoint_id"],
             plan["abandoned"], moved)
    return RollbackResult(plan["checkpoint_id"], list(plan["abandoned"]), moved, stamp)
