"""The on-disk checkpoint layout, read-only: which checkpoints are complete under a base path and
which files they reference. Used by the upload service's orphan decisions, `dstl gc` and the Spark
coordinator (the writing side and the full metadata model live in dstl.state.metadata).

Layout: `<base>/checkpoints/chk-<id>/_metadata`; the file is `MAGIC + msgpack body + CRC-32 (big
endian) of the body`. A checkpoint is complete once its `_metadata` exists. File paths in handles may
be absolute (URLs, local paths) or relative to the base path.
"""
from __future__ import annotations

import re
import struct
import zlib
from typing import Iterable, List, Optional, Set

from dstl.changelog import fs as dfs
from dstl.errors import DstlError

MAGIC = b"\x89DSTLCK1"
METADATA_FILE = "_metadata"
CHECKPOINTS_DIR = "checkpoints"
FORMAT_VERSION = 1
_CHK_RE = re.compile(r"^chk-(\d+)$")


class UnreadableCheckpointError(DstlError, ValueError):
    """A `_metadata` file that is truncated, torn or not dstl checkpoint metadata."""


def metadata_path(root: str, checkpoint_id: int) -> str:
    """`<root>/checkpoints/chk-<id>/_metadata` (root: a path inside its file system, or a URL)."""
    return dfs.join(root, CHECKPOINTS_DIR, f"chk-{int(checkpoint_id)}", METADATA_FILE)


def list_complete(fs, root: str) -> List[int]:
    """Ids of the checkpoints under `root` that have a `_metadata` file, ascending."""
    directory = dfs.join(root, CHECKPOINTS_DIR)
    fs.invalidate_cache(directory)
    try:
        found = fs.glob(dfs.join(directory, "chk-*", METADATA_FILE))
    except FileNotFoundError:
        return []
    ids = set()
    for p in found:
        m = _CHK_RE.match(p.rstrip("/").split("/")[-2])
        if m:
            ids.add(int(m.group(1)))
    return sorted(ids)


def unwrap_envelope(data: bytes, source: str = "checkpoint metadata",
                    error: type = None) -> object:
    """The msgpack value inside a `_metadata` file, magic and CRC checked; `error` (default
    `UnreadableCheckpointError`) is what a torn, foreign or undecodable file raises."""
    import msgpack

    error = error or UnreadableCheckpointError
    data = bytes(data)
    if len(data) < len(MAGIC) + 4 or not data.startswith(MAGIC):
        raise error(f"{source}: not dstl checkpoint metadata or truncated ({len(data)} bytes)")
    body, (crc,) = data[len(MAGIC):-4], struct.unpack(">I", data[-4:])
    if zlib.crc32(body) != crc:
        raise error(f"{source}: checksum mismatch (torn or truncated file)")
    try:
        return msgpack.unpackb(body, raw=False, strict_map_key=False)
    except Exception as exc:
        raise error(f"{source}: body is not valid msgpack ({exc})") from exc


def decode_envelope(data: bytes, source: str = "checkpoint metadata") -> dict:
    """The msgpack map inside a `_metadata` file (magic, CRC and format version checked)."""
    d = unwrap_envelope(data, source)
    if not isinstance(d, dict) or d.get("v") != FORMAT_VERSION:
        raise UnreadableCheckpointError(f"{source}: unsupported checkpoint metadata")
    return d


def resolve(base_path: str, path: str) -> str:
    """A handle's file path as an absolute URL or path: relative paths are below `base_path`."""
    if "://" in path or path.startswith("/"):
        return path
    return dfs.join(str(base_path), path)


def _files_of(d: dict, source: str) -> List[str]:
    from dstl.changelog.handles import ChangelogStateHandleStreamImpl

    out: List[str] = []
    try:
        for sub in d["subtasks"]:
            for blob in list(sub["materialized"]) + list(sub["changelog"]):
                out += ChangelogStateHandleStreamImpl.from_bytes(blob).files()
    except (KeyError, TypeError, ValueError) as exc:
        raise UnreadableCheckpointError(f"{source}: malformed handles ({exc})") from exc
    return out


def files_referenced(base_path: str, *, latest: Optional[int] = None,
                     checkpoint_ids: Optional[Iterable[int]] = None) -> Set[str]:
    """Keys (`dstl.changelog.fs.key`) of every file the complete checkpoints under `base_path`
    reference: all of them, the newest `latest`, or exactly `checkpoint_ids`.

    A checkpoint removed while it is read is skipped. Raises UnreadableCheckpointError when a
    checkpoint's metadata cannot be decoded (callers must then delete nothing), OSError when the
    store cannot be listed or read (a transient condition: decide later).
    """
    fs, root = dfs.root_of(base_path)
    ids = list_complete(fs, root) if checkpoint_ids is None else sorted(int(c) for c in checkpoint_ids)
    if latest is not None:
        ids = ids[-latest:] if latest > 0 else []
    keys: Set[str] = set()
    for cp in ids:
        path = metadata_path(root, cp)
        try:
            data = fs.cat_file(path)
        except FileNotFoundError:
            if checkpoint_ids is not None:
                raise FileNotFoundError(f"no checkpoint {cp} under {base_path}") from None
            continue  # removed (retention) while we looked
        for f in _files_of(decode_envelope(data, path), path):
            keys.add(dfs.key_of_url(resolve(base_path, f)))
    return keys


def files_in_metadata(url: str) -> Set[str]:
    """Keys of the files one `_metadata` file (any URL) references; relative paths resolve against the
    base path that holds it (`<base>/checkpoints/chk-<id>/_metadata`)."""
    fs, path = dfs.filesystem(url)
    try:
        data = fs.cat_file(path)
    except FileNotFoundError:
        raise FileNotFoundError(f"checkpoint manifest {url} does not exist") from None
    base = url.rstrip("/").rsplit("/", 3)[0] if url.count("/") >= 3 else "."
    return {dfs.key_of_url(resolve(base, f)) for f in _files_of(decode_envelope(data, url), url)}


__all__ = ["MAGIC", "METADATA_FILE", "CHECKPOINTS_DIR", "UnreadableCheckpointError", "metadata_path",
           "list_complete", "decode_envelope", "resolve", "files_referenced", "files_in_metadata"]
