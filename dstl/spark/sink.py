"""StatefulStream's output: the committed parquet folders and the once-per-batch sink call.

Each batch's output is staged by the tasks and committed by the coordinator under the output path
as ``batch_id=N/part-*.parquet`` (with ``_SUCCESS``), after the checkpoint that produced it is
durable. So ``spark.read.parquet(output_path)`` has a ``batch_id`` column, and the committed folder
is the batch's durable outbox: a user `sink(out_df, batch_id)` is given exactly that data, also
when it is called again after a crash.

After the sink returns, a marker ``<base>/_dstl_sink/batch-N`` records it. A replayed batch calls
the sink only if that marker is missing (the driver died between checkpoint and marker), so an
idempotent sink (Delta's ``txnVersion``, a JDBC upsert keyed by batch, this parquet layout) gets
each batch exactly once.
"""
from __future__ import annotations

from typing import Any, Callable, Dict, Optional

OUTPUT_LAYOUT = "batch_id={batch}"
SINK_DIR = "_dstl_sink"
#: how often (in batches) old sink markers are listed and pruned
PRUNE_EVERY = 10


def _fs(url: str):
    from dstl.changelog.fs import filesystem

    return filesystem(url)


def _marker(base_path: str, batch: int) -> str:
    return f"{base_path.rstrip('/')}/{SINK_DIR}/batch-{batch:06d}"


def sink_done(base_path: str, batch: int, storage_options: Optional[Dict[str, Any]] = None) -> bool:
    """True once the sink of `batch` has returned (`storage_options`: the file system's keyword arguments)."""
    from dstl.config import register_storage_options

    register_storage_options(base_path, storage_options)
    fs, path = _fs(_marker(base_path, batch))
    fs.invalidate_cache(path.rsplit("/", 1)[0])
    # one ranged GET (a marker is never empty): `exists`, or a whole-file read, asks an object
    # store for the size first, a HEAD and, for a missing marker, a LIST
    try:
        fs.cat_file(path, start=0, end=1)
    except FileNotFoundError:
        return False
    return True


def mark_sink_done(base_path: str, batch: int, checkpoint_id: int) -> None:
    from dstl.changelog.fs import make_parent_dirs

    fs, path = _fs(_marker(base_path, batch))
    make_parent_dirs(fs, path.rsplit("/", 1)[0])
    with fs.open(path, "wb") as f:
        f.write(f"checkpoint {checkpoint_id}\n".encode())


def prune_markers(base_path: str, keep_from_batch: int) -> None:
    """Drop the markers of batches before `keep_from_batch` (Spark never replays those); the
    listing this takes runs once every PRUNE_EVERY batches, so old markers go in groups."""
    if keep_from_batch % PRUNE_EVERY:
        return
    fs, root = _fs(f"{base_path.rstrip('/')}/{SINK_DIR}")
    try:
        fs.invalidate_cache(root)
        names = fs.ls(root, detail=False)
    except FileNotFoundError:
        return
    for p in names:
        name = p.rstrip("/").rsplit("/", 1)[-1]
        if name.startswith("batch-") and name[6:].isdigit() and int(name[6:]) < keep_from_batch:
            try:
                fs.rm(p)
            except FileNotFoundError:
                pass
    fs.invalidate_cache(root)


def read_batch_output(spark, batch_dir: str, schema: Any):
    """The committed output of one batch as a Spark DataFrame (empty, with `schema`, if none)."""
    from dstl.spark.session import struct_from_ddl

    struct = struct_from_ddl(schema) if isinstance(schema, str) else schema
    fs, path = _fs(batch_dir)
    fs.invalidate_cache(path)
    has_parts = fs.exists(path) and any(p.endswith(".parquet") for p in fs.ls(path, detail=False))
    if not has_parts:
        return spark.createDataFrame([], struct)
    return spark.read.schema(struct).parquet(batch_dir)


def call_sink(sink: Callable, out_df, batch_id: int) -> None:
    sink(out_df, batch_id)
