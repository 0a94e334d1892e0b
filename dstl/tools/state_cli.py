"""`dstl state ls|show|changes|rescale BASE ...`: a job's checkpoints and state from the command line.

* `ls BASE`: every retained checkpoint: id, time, parallelism, states, live keys, bytes referenced
  (materialized and log).
* `show BASE [--state NAME] [--key K] [--checkpoint N] [--limit N]`: live values, one row each.
* `changes BASE --from N --to M [--key K] [--state NAME]`: the changes between two checkpoints.
* `rescale BASE --max-parallelism M [--parallelism P]`: rewrite the latest checkpoint's state into
  a new checkpoint with M key groups (dstl.state.rescale); the job continues from it.
* `verify BASE`: every file the retained checkpoints reference exists with its recorded length.

`ls` lists every checkpoint and marks the bad ones (torn metadata, missing or short files) instead
of stopping at the first. A readable table by default, `--json` for scripts. Exit codes: 0 ok, 1
`verify` found a problem, 2 a bad or unreachable path, an unknown checkpoint or state, or a bad
option (one line on stderr).
"""
from __future__ import annotations

import argparse
import datetime
import json
import sys
from typing import Any, Dict, List, Optional, Sequence

_VALUE_WIDTH = 60


def add_arguments(p: argparse.ArgumentParser) -> None:
    sub = p.add_subparsers(dest="state_command", metavar="SUBCOMMAND")
    sub.required = True
    ls = sub.add_parser("ls", help="list the retained checkpoints of a job")
    show = sub.add_parser("show", help="print the live state of a checkpoint")
    changes = sub.add_parser("changes", help="print the state changes between two checkpoints")
    rescale = sub.add_parser("rescale", help="rewrite the latest checkpoint with another max parallelism")
    verify = sub.add_parser("verify", help="check that every file the retained checkpoints need exists "
                                           "with the right length")
    for q in (ls, show, changes, rescale, verify):
        q.add_argument("base_path", metavar="BASE", help="the job's base path (any fsspec URL)")
        q.add_argument("--json", action="store_true", help="print JSON instead of a table")
        q.add_argument("--fs-option", action="append", default=[], metavar="NAME=VALUE",
                       help="a keyword argument of the base path's fsspec file system (repeatable), e.g. "
                            "profile=minio, client_kwargs.endpoint_url=http://host:9000")
    show.add_argument("--state", default=None, help="only this state")
    show.add_argument("--key", default=None, help="only this key (an int key is given as its digits)")
    show.add_argument("--checkpoint", type=int, default=None, help="checkpoint id (default: the latest)")
    show.add_argument("--limit", type=int, default=50, help="rows printed (default 50; 0 = all)")
    changes.add_argument("--from", dest="from_checkpoint", type=int, required=True, help="the earlier checkpoint")
    changes.add_argument("--to", dest="to_checkpoint", type=int, required=True, help="the later checkpoint")
    changes.add_argument("--key", default=None, help="only this key")
    changes.add_argument("--state", default=None, help="only this state")
    changes.add_argument("--limit", type=int, default=0, help="rows printed (default 0 = all)")
    rescale.add_argument("--max-parallelism", type=int, required=True, help="the new number of key groups")
    rescale.add_argument("--parallelism", type=int, default=None,
                         help="subtasks of the new checkpoint (default: the old one, capped at M)")


class _Usage(Exception):
    pass


def _key_arg(text: Optional[str], key_type) -> Any:
    if text is None:
        return None
    if key_type is int:
        try:
            return int(text)
        except ValueError:
            raise _Usage(f"--key {text!r}: this job's keys are integers") from None
    if key_type is bytes:
        return text.encode()
    return text


def _table(rows: Sequence[Sequence[Any]], header: Sequence[str]) -> str:
    cells = [[_cell(v) for v in r] for r in rows]
    widths = [max([len(h)] + [len(r[i]) for r in cells]) for i, h in enumerate(header)]
    lines = ["  ".join(h.ljust(w) for h, w in zip(header, widths)).rstrip()]
    lines += ["  ".join(c.ljust(w) for c, w in zip(r, widths)).rstrip() for r in cells]
    return "\n".join(lines)


def _cell(v: Any) -> str:
    if v is None or (isinstance(v, float) and v != v):
        return "-"
    try:
        import pandas as pd

        if v is pd.NA:
            return "-"
    except ImportError:  # pragma: no cover
        pass
    s = repr(v) if isinstance(v, bytes) else str(v)
    return s if len(s) <= _VALUE_WIDTH else s[:_VALUE_WIDTH - 3] + "..."


def _size(n: int) -> str:
    for unit in ("B", "KiB", "MiB", "GiB"):
        if n < 1024 or unit == "GiB":
            return f"{n:.0f} {unit}" if unit == "B" else f"{n:.1f} {unit}"
        n /= 1024
    return str(n)


# ------------------------------------------------------------------ ls

def checkpoint_summary(base_path: str, meta) -> Dict[str, Any]:
    """What `ls` prints for one checkpoint (restores it to count states and live keys)."""
    from dstl.state.reader import restored_range

    mat, log = {}, {}
    for s in meta.subtasks:
        for h in s.materialized:
            for f, _ in h.handles_and_offsets:
                mat[f.path] = f.size
        for h in s.changelog:
            for f, _ in h.handles_and_offsets:
                log[f.path] = f.size
    states: Dict[str, int] = {}
    live_keys = 0  # a key with values in two states counts once
    for s in meta.subtasks:
        if s.key_group_range.is_empty():
            continue
        with restored_range(base_path, meta, s.key_group_range) as backend:
            keys = set()
            for name in backend.state_names:
                states.setdefault(name, 0)
            for per_state in backend._table.values():
                for name, entries in per_state.items():
                    if entries:
                        states[name] = states.get(name, 0) + len(entries)
                        keys.update(entries)
            live_keys += len(keys)
    return {
        "checkpoint_id": meta.checkpoint_id,
        "time": datetime.datetime.fromtimestamp(meta.timestamp_ms / 1000, datetime.timezone.utc)
        .strftime("%Y-%m-%dT%H:%M:%SZ"),
        "parallelism": meta.parallelism, "max_parallelism": meta.max_parallelism,
        "states": dict(sorted(states.items())), "live_keys": live_keys,
        "bytes": sum(mat.values()) + sum(v for k, v in log.items() if k not in mat),
        "materialized_bytes": sum(mat.values()), "log_bytes": sum(log.values()),
        # the batch's subtasks: warm / restored / moved and the slowest restore (dstl.spark.placement)
        "placement": {k: v for k, v in (meta.properties.get("placement") or {}).items()
                      if k in ("warm", "restored", "moved", "restore_ms_max", "executors", "sources")},
        # the batch's progress figures (dstl.spark.progress) and Spark's batch id
        "batch_id": meta.properties.get("spark_batch_id"),
        "progress": dict(meta.properties.get("progress") or {}),
    }


def _bad_row(checkpoint_id: int, problem: str, detail: str) -> Dict[str, Any]:
    return {"checkpoint_id": checkpoint_id, "ok": False, "problem": problem, "detail": detail}


def _placement(p: Dict[str, Any]) -> str:
    if not p:
        return "-"
    # where the restores read their files: "local" (this host's copies), "local+dfs", "dfs"
    froms = sorted({s for s in p.get("sources") or () if s not in ("memory", "new")})
    return f"{p['warm']}/{p['restored']}/{p['moved']} ({p['restore_ms_max']:.0f})" + \
        (f" {','.join(froms)}" if froms else "")


def _progress(p: Dict[str, Any], batch_id: Any) -> str:
    """The batch's figures in a cell: batch id, rows in/out, state rows, update and commit ms, uploads."""
    if not p:
        return "-"
    rows = p.get("numRowsTotal", -1)
    uploads = p.get("ChangelogStorage.numberOfUploadRequests", 0)
    return (f"b{batch_id} {p.get('dstlRowsIn', 0)}>{p.get('dstlRowsOut', 0)} "
            f"rows={rows if rows >= 0 else '?'} upd={p.get('allUpdatesTimeMs', 0)}ms "
            f"commit={p.get('commitTimeMs', 0)}ms up={uploads}/{_size(p.get('ChangelogStorage.uploadSizes.sum', 0))}")


def _ls(args) -> int:
    from dstl.state.metadata import CorruptCheckpointError, list_checkpoints, read_checkpoint
    from dstl.state.reader import StateReadError

    ids = list_checkpoints(args.base_path)
    if not ids:
        from dstl.state.reader import open_checkpoint

        open_checkpoint(args.base_path)  # the reader's clear error when there is nothing
    out = []
    for c in ids:  # one bad checkpoint is marked, the others are still listed
        try:
            meta = read_checkpoint(args.base_path, c)
        except (CorruptCheckpointError, FileNotFoundError) as exc:
            out.append(_bad_row(c, "torn or unreadable _metadata", str(exc)))
            continue
        missing = _file_problems(meta)
        if missing:
            out.append(_bad_row(c, f"{len(missing)} file(s) missing or short", "; ".join(missing)))
            continue
        try:
            row = checkpoint_summary(args.base_path, meta)
        except (StateReadError, FileNotFoundError, ValueError, OSError) as exc:
            out.append(_bad_row(c, "cannot restore", str(exc)))
            continue
        row.update(ok=True, problem=None)
        out.append(row)
    if args.json:
        print(json.dumps({"base_path": args.base_path, "checkpoints": out}, indent=1))
        return 0
    rows = []
    for c in out:
        if not c["ok"]:
            rows.append((c["checkpoint_id"], "-", "-", "-", "-", "-", "-", "-", "-", "-", "BAD: " + c["problem"]))
            continue
        rows.append((c["checkpoint_id"], c["time"], f"{c['parallelism']}/{c['max_parallelism']}",
                     ", ".join(f"{n}({k})" for n, k in c["states"].items()) or "-", c["live_keys"],
                     _size(c["bytes"]), _size(c["materialized_bytes"]), _size(c["log_bytes"]),
                     _placement(c["placement"]), _progress(c["progress"], c["batch_id"]), "ok"))
    print(_table(rows, ["id", "time (UTC)", "par/max", "states (live keys)", "keys", "bytes", "materialized",
                        "log", "warm/restored/moved (restore ms)", "batch in>out, state rows, times, uploads",
                        "status"]))
    return 0


def _file_problems(meta) -> List[str]:
    """`path: missing` / `path: N bytes, the checkpoint needs M` for each file `meta` references."""
    from dstl.changelog import fs as dfs

    need: Dict[str, int] = {}
    for s in meta.subtasks:
        for h in s.materialized + s.changelog:
            for f, _ in h.handles_and_offsets:
                need[f.path] = max(need.get(f.path, 0), f.size)
    problems = []
    for path, size in sorted(need.items()):
        fs, p = dfs.filesystem(path)
        try:
            got = int(fs.info(p).get("size") or 0)
        except FileNotFoundError:
            problems.append(f"{path}: missing")
            continue
        if got < size:
            problems.append(f"{path}: {got} bytes, the checkpoint needs at least {size}")
    return problems


def _verify(args) -> int:
    from dstl.state.metadata import CorruptCheckpointError, list_checkpoints, read_checkpoint

    ids = list_checkpoints(args.base_path)
    if not ids:
        from dstl.state.reader import open_checkpoint

        open_checkpoint(args.base_path)
    report = []
    for c in ids:
        try:
            meta = read_checkpoint(args.base_path, c)
        except (CorruptCheckpointError, FileNotFoundError) as exc:
            report.append({"checkpoint_id": c, "files": 0, "problems": [f"unreadable metadata: {exc}"]})
            continue
        report.append({"checkpoint_id": c, "files": len(meta.files()), "problems": _file_problems(meta)})
    bad = [r for r in report if r["problems"]]
    if args.json:
        print(json.dumps({"base_path": args.base_path, "ok": not bad, "checkpoints": report}, indent=1))
    else:
        for r in report:
            state = "ok" if not r["problems"] else f"{len(r['problems'])} problem(s)"
            print(f"checkpoint {r['checkpoint_id']}: {r['files']} files, {state}")
            for p in r["problems"]:
                print(f"  {p}")
        print(f"{len(report) - len(bad)} of {len(report)} checkpoints complete")
    return 1 if bad else 0


# ------------------------------------------------------------------ show and changes

def _frame_out(df, args, columns: List[str]) -> None:
    total = len(df)
    if args.limit:
        df = df.head(args.limit)
    records = [{c: _plain(v) for c, v in zip(columns, row)} for row in df[columns].itertuples(index=False)]
    if args.json:  # user keys and values as JSON values, not as strings holding JSON
        for r in records:
            for c in ("user_key", "value"):
                if isinstance(r.get(c), str):
                    r[c] = json.loads(r[c])
        print(json.dumps(records, indent=1))
        return
    print(_table([[r[c] for c in columns] for r in records], columns))
    if len(records) < total:
        print(f"({len(records)} of {total} rows; --limit 0 prints all)")


def _plain(v: Any) -> Any:
    import pandas as pd

    if v is None or v is pd.NA or (isinstance(v, float) and v != v):
        return None
    if hasattr(v, "item"):
        v = v.item()
    if isinstance(v, bytes):
        return v.decode("utf-8", "backslashreplace")
    return v


def _show(args) -> int:
    from dstl.state.reader import first_look, open_checkpoint, read_state_pandas

    from dstl.spark.keys import display_key, job_key_columns, parse_display_key

    meta = open_checkpoint(args.base_path, args.checkpoint)
    _, key_type = first_look(meta)
    composite = job_key_columns(args.base_path) is not None
    try:
        key = parse_display_key(args.key) if composite and args.key is not None else _key_arg(args.key, key_type)
    except ValueError as exc:
        raise _Usage(f"--key: {exc}") from None
    df = read_state_pandas(args.base_path, args.state, checkpoint_id=meta.checkpoint_id, key=key)
    if composite:  # several key columns: each key shown as its values, a JSON list
        df["key"] = df["key"].map(display_key)
    columns = ["key", "key_group", "state", "kind", "user_key", "position"]
    # a state with a declared schema (every StatefulProcessor state) has its fields as columns
    columns += ["value"] if "value" in df.columns else [c for c in df.columns if c not in columns]
    _frame_out(df, args, columns)
    return 0


def _changes(args) -> int:
    from dstl.state.reader import first_look, open_checkpoint, read_changes_pandas

    _, key_type = first_look(open_checkpoint(args.base_path, args.to_checkpoint))
    df = read_changes_pandas(args.base_path, args.from_checkpoint, args.to_checkpoint,
                             key=_key_arg(args.key, key_type), state_name=args.state)
    _frame_out(df, args, ["checkpoint_id", "key", "key_group", "state", "op", "user_key", "value"])
    return 0


def _rescale(args) -> int:
    from dstl.spark import faults
    from dstl.state.rescale import rescale_checkpoint

    meta = rescale_checkpoint(args.base_path, args.max_parallelism, parallelism=args.parallelism,
                              on_step=lambda step, subtask: faults.point(f"rescale.{step}", None, subtask=subtask))
    info = {"checkpoint_id": meta.checkpoint_id, "max_parallelism": meta.max_parallelism,
            "parallelism": meta.parallelism}
    if args.json:
        print(json.dumps(info))
    else:
        print(f"checkpoint {meta.checkpoint_id} written: max parallelism {meta.max_parallelism}, "
              f"parallelism {meta.parallelism}; the job continues from it")
    return 0


def run(args) -> int:
    from dstl.state.reader import StateReadError

    handler = {"ls": _ls, "show": _show, "changes": _changes, "rescale": _rescale,
               "verify": _verify}[args.state_command]
    try:
        return handler(args)
    except (StateReadError, _Usage, FileNotFoundError) as exc:
        print(f"dstl state {args.state_command}: error: {exc}", file=sys.stderr)
        return 2
    except ValueError as exc:  # bad option values found by the library (e.g. max parallelism range)
        print(f"dstl state {args.state_command}: error: {exc}", file=sys.stderr)
        return 2
