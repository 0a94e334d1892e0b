"""`dstl gc BASE_URL --keep MANIFEST... | --keep-latest N [--grace 1h] [--delete]`

The safety net for crashes after which no process was left to release changelog files: lists the
files under `<base>/<job>/dstl/`, keeps every file a retained checkpoint references and every file
younger than the grace period (uploads in progress, checkpoints not yet written), and deletes the
rest. Dry run unless `--delete`: prints what it would delete.

Retained checkpoints: each `--keep` names a checkpoint `_metadata` file (any fsspec URL);
`--keep-latest N` reads the N newest checkpoints under `<checkpoints base>/checkpoints` (default: the
base URL itself). A retained checkpoint that cannot be read stops the run: guessing would delete
files it may reference.
"""
from __future__ import annotations

import argparse
import datetime
import re
import sys
import time
from dataclasses import dataclass, field
from typing import Iterable, List, Optional, Set

from dstl.changelog import fs as dfs

_JOB = re.compile(r"^[0-9a-f]{32}$")
_FILE = re.compile(r"^[0-9a-f]{8}-[0-9a-f]{4}-[0-9a-f]{4}-[0-9a-f]{4}-[0-9a-f]{12}$")


@dataclass
class GcReport:
    """What one run found: candidates (unreferenced and old), kept files and the reason why."""

    deleted: List[tuple] = field(default_factory=list)  # (url, size, age_s)
    referenced: List[str] = field(default_factory=list)
    too_young: List[str] = field(default_factory=list)
    unknown_age: List[str] = field(default_factory=list)
    errors: List[tuple] = field(default_factory=list)  # (url, message)

    @property
    def bytes(self) -> int:
        return sum(s for _, s, _ in self.deleted)


def add_arguments(p: argparse.ArgumentParser) -> None:
    p.add_argument("base_url", metavar="BASE_URL", help="the changelog base path (dstl.dfs.base-path)")
    p.add_argument("--keep", metavar="MANIFEST", nargs="+", default=[], action="extend",
                   help="checkpoint _metadata file(s) whose files must be kept")
    p.add_argument("--keep-latest", metavar="N", type=int, default=None,
                   help="keep the files of the N newest checkpoints under <checkpoints>/checkpoints")
    p.add_argument("--checkpoints", metavar="URL", default=None,
                   help="base of the checkpoints directory for --keep-latest (default: BASE_URL)")
    p.add_argument("--no-checkpoints", action="store_true",
                   help="no checkpoint is retained: every file older than the grace period goes")
    p.add_argument("--grace", default="1h", help="minimum age of a deleted file (Flink duration syntax, default 1h)")
    p.add_argument("--job", default=None, help="only this job id (32 hex digits)")
    p.add_argument("--delete", action="store_true", help="really delete (default: dry run)")


def load_retained(manifests: Iterable[str], keep_latest: Optional[int], checkpoints_base: str) -> Set[str]:
    """Keys of every file the retained checkpoints reference."""
    from dstl.changelog.checkpoints import files_in_metadata, files_referenced, list_complete

    keys: Set[str] = set()
    for m in manifests:
        keys |= files_in_metadata(m)
    if keep_latest is not None:
        if keep_latest < 1:
            raise ValueError(f"--keep-latest must be >= 1, got {keep_latest}")
        fs, root = dfs.root_of(checkpoints_base)
        if not list_complete(fs, root):
            raise FileNotFoundError(f"--keep-latest {keep_latest}: no checkpoint under {checkpoints_base}/checkpoints")
        keys |= files_referenced(checkpoints_base, latest=keep_latest)
    return keys


def _mtime(info: dict) -> Optional[float]:
    for k in ("mtime", "LastModified", "last_modified", "updated", "created", "ctime"):
        v = info.get(k)
        if v is None:
            continue
        if isinstance(v, datetime.datetime):
            if v.tzinfo is None:
                v = v.replace(tzinfo=datetime.timezone.utc)
            return v.timestamp()
        if isinstance(v, (int, float)):
            return float(v)
        if isinstance(v, str):
            try:
                return datetime.datetime.fromisoformat(v.replace("Z", "+00:00")).timestamp()
            except ValueError:
                continue
    return None


def changelog_files(base_url: str, job: Optional[str] = None):
    """Yield (fs, path, info) for every changelog file under `<base>/<job>/dstl/` (uuid-named only)."""
    fs, root = dfs.root_of(base_url)
    fs.invalidate_cache()
    try:
        jobs = [e for e in fs.ls(root, detail=True) if e["type"] == "directory"]
    except FileNotFoundError:
        return
    for entry in jobs:
        name = entry["name"].rstrip("/").rsplit("/", 1)[-1]
        if not _JOB.match(name) or (job is not None and name != job):
            continue
        try:
            files = fs.ls(f"{root.rstrip('/')}/{name}/dstl", detail=True)
        except FileNotFoundError:
            continue
        for info in files:
            fname = info["name"].rstrip("/").rsplit("/", 1)[-1]
            if info.get("type") == "file" and _FILE.match(fname):
                yield fs, info["name"], info


def collect(base_url: str, retained: Set[str], grace_ms: int, *, job: Optional[str] = None,
            delete: bool = False, now: Optional[float] = None) -> GcReport:
    """Find (and with `delete`, remove) the changelog files nobody retains and older than `grace_ms`."""
    now = time.time() if now is None else now
    report = GcReport()
    for fs, path, info in changelog_files(base_url, job):
        key = dfs.key(fs, path)
        url = path if key.startswith("file://") else key
        if key in retained:
            report.referenced.append(url)
            continue
        mtime = _mtime(info)
        if mtime is None:
            report.unknown_age.append(url)
            continue
        age = now - mtime
        if age * 1000 < grace_ms:
            report.too_young.append(url)
            continue
        if delete:
            try:
                fs.rm_file(path)
            except FileNotFoundError:
                pass
            except Exception as exc:  # keep going: one undeletable file must not hide the others
                report.errors.append((url, str(exc)))
                continue
        report.deleted.append((url, int(info.get("size") or 0), age))
    return report


def run(args: argparse.Namespace) -> int:
    from dstl.config import parse_duration_ms

    try:
        grace_ms = parse_duration_ms(args.grace, "--grace")
        if args.job is not None and not _JOB.match(args.job):
            raise ValueError(f"--job must be 32 lowercase hex digits, got {args.job!r}")
        if not args.keep and args.keep_latest is None and not args.no_checkpoints:
            raise ValueError("name the retained checkpoints with --keep MANIFEST... or --keep-latest N "
                             "(or pass --no-checkpoints if none is retained)")
        retained = load_retained(args.keep, args.keep_latest, args.checkpoints or args.base_url)
        report = collect(args.base_url, retained, grace_ms, job=args.job, delete=args.delete)
    except (ValueError, OSError) as exc:
        print(f"dstl gc: error: {exc}", file=sys.stderr)
        return 2
    verb = "deleted" if args.delete else "would delete"
    for url, size, age in report.deleted:
        print(f"{verb} {url} ({size} bytes, {age / 3600:.1f} h old)")
    for url, msg in report.errors:
        print(f"could not delete {url}: {msg}", file=sys.stderr)
    for url in report.unknown_age:
        print(f"kept {url}: its age is unknown", file=sys.stderr)
    print(f"{len(report.deleted)} files ({report.bytes} bytes) {verb}; kept {len(report.referenced)} referenced, "
          f"{len(report.too_young)} younger than {args.grace}" + ("" if args.delete else " (dry run: add --delete)"))
    return 1 if report.errors else 0


__all__ = ["add_arguments", "run", "collect", "load_retained", "changelog_files", "GcReport"]
