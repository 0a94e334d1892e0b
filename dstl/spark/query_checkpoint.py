"""Rewind a Structured Streaming checkpoint location to an earlier batch (after a dstl roll-back).

After `StatefulStream(..., resume_from=N)` the job's next batch is N's Spark batch id + 1, but the
query's own checkpoint location remembers later batches. `rewind_query_checkpoint(location, batch)`
makes Spark plan batch + 1 next, reading the same input again:

* the write-ahead logs `offsets/` and `commits/` lose every entry after `batch` (Spark then restarts
  from the offsets `batch` ended at);
* a file source's log (`sources/<i>/`) loses the entries after the file-source offset that batch
  ended at, so the files of the dropped batches count as new again. A compacted file-source log
  entry after that offset cannot be split: that is an error (raise
  `spark.sql.streaming.fileSource.log.compactInterval`, or keep the query's checkpoint instead).

Other sources (Kafka, rate, ...) keep their positions in `offsets/` only. Run it while the query is
stopped.
"""
from __future__ import annotations

import json
import posixpath
from typing import Dict, List

from dstl.changelog.fs import root_of

__all__ = ["rewind_query_checkpoint"]


def _fs(url: str):
    return root_of(url)


def _entries(fs, d: str) -> Dict[int, List[str]]:
    """Batch id -> its files (the entry, `.compact` and Hadoop's `.N.crc` checksums) in a log dir."""
    out: Dict[int, List[str]] = {}
    try:
        names = fs.ls(d, detail=False)
    except FileNotFoundError:
        return out
    for p in names:
        name = posixpath.basename(p.rstrip("/"))
        core = name[1:-4] if name.startswith(".") and name.endswith(".crc") else name
        core = core[:-len(".compact")] if core.endswith(".compact") else core
        if core.isdigit():
            out.setdefault(int(core), []).append(p)
    return out


def _file_source_offsets(fs, offsets_file: str) -> List[object]:
    """The per-source offsets recorded for a batch (lines after the version and metadata lines)."""
    with fs.open(offsets_file, "rb") as f:
        lines = f.read().decode().splitlines()
    out: List[object] = []
    for line in lines[2:]:
        try:
            out.append(json.loads(line))
        except ValueError:
            out.append(None)
    return out


def rewind_query_checkpoint(location: str, batch_id: int) -> Dict[str, int]:
    """Make the streaming query checkpointed at `location` continue with batch `batch_id` + 1 (see
    the module docstring). Returns how many log entries were removed per log."""
    if isinstance(batch_id, bool) or not isinstance(batch_id, int) or batch_id < -1:
        raise ValueError(f"batch_id must be an int >= -1, got {batch_id!r}")
    fs, root = _fs(location)
    fs.invalidate_cache()
    offsets = _entries(fs, f"{root}/offsets")
    if not offsets:
        raise ValueError(f"{location} is not a Structured Streaming checkpoint location (no offsets/ log)")
    if batch_id >= 0 and batch_id not in offsets:
        raise ValueError(f"{location} has no offsets of batch {batch_id} (batches {min(offsets)}..{max(offsets)})")
    removed: Dict[str, int] = {}
    # file sources: drop their log entries after the offset batch_id ended at
    if batch_id >= 0:
        offs_file = next(p for p in offsets[batch_id] if not p.endswith(".crc"))
        source_offsets = _file_source_offsets(fs, offs_file)
    else:
        source_offsets = []
    plans = [(d, [p for n, ps in _entries(fs, f"{root}/{d}").items() if n > batch_id for p in ps])
             for d in ("commits", "offsets")]
    try:
        sources = sorted(int(posixpath.basename(p.rstrip("/"))) for p in fs.ls(f"{root}/sources", detail=False)
                         if posixpath.basename(p.rstrip("/")).isdigit())
    except FileNotFoundError:
        sources = []
    for i in sources:
        off = source_offsets[i] if i < len(source_offsets) else None
        if batch_id < 0:
            keep = -1  # back to the very start: every source log entry goes
        elif isinstance(off, dict) and "logOffset" in off:
            keep = int(off["logOffset"])
        else:
            continue  # not a file source: its position is in offsets/ only
        entries = _entries(fs, f"{root}/sources/{i}")
        for n, paths in entries.items():
            if n > keep and any(p.endswith(".compact") for p in paths):
                raise ValueError(f"file source {i} of {location} compacted its log at entry {n}, after the "
                                 f"offset batch {batch_id} ended at ({keep}); it cannot be rewound that far")
        plans.append((f"sources/{i}", [p for n, ps in entries.items() if n > keep for p in ps]))
    # idempotent: entries are chosen from offsets/<batch_id>, which stays; an interrupted rewind is
    # finished by running it again (the query must stay stopped until then)
    for name, paths in plans:
        for p in sorted(paths):
            fs.rm(p)
        removed[name] = len([p for p in paths if not p.endswith(".crc")])
    fs.invalidate_cache()
    return removed
