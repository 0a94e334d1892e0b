"""Paths relative to a job's base path, so that a whole base path can be copied or moved.

Checkpoint metadata, the job file and the output commit list store every file that lies under the
base path as a path relative to it (`<job>/dstl/<uuid>`, `output/batch-000001/part-00000.parquet`).
A relative path has no scheme and no leading `/`; anything else is an absolute path or URL and is
used as it is (files outside the base path, metadata written before relative paths existed).
"""
from __future__ import annotations

from typing import Any, Callable, Tuple

__all__ = ["is_relative", "relative_to", "resolve", "map_handle_paths"]


def _split(url: str) -> Tuple[Any, str]:
    from dstl.changelog.fs import root_of

    return root_of(url)


def _protocol(fs) -> str:
    p = fs.protocol
    return p[0] if isinstance(p, (tuple, list)) else p


def _is_local(fs) -> bool:
    from dstl.changelog.handles import is_local_filesystem

    return is_local_filesystem(fs)


def is_relative(path: str) -> bool:
    """True for a path stored relative to a base path (no scheme, no leading slash)."""
    return isinstance(path, str) and bool(path) and "://" not in path and not path.startswith("/")


def relative_to(base_path: str, url: str) -> str:
    """`url` relative to `base_path` when it lies under it (same filesystem), else `url` unchanged."""
    if is_relative(url):
        return url
    bfs, root = _split(base_path)
    fs, path = _split(url)
    if _protocol(fs) != _protocol(bfs) and not (_is_local(fs) and _is_local(bfs)):
        return url
    prefix = root if root.endswith("/") else root + "/"
    if path.startswith(prefix) and len(path) > len(prefix):
        return path[len(prefix):]
    return url


def resolve(base_path: str, path: str) -> str:
    """The absolute spelling of a stored path: relative ones joined to `base_path`.

    Local files come back as plain absolute paths, others as URLs of the base path's filesystem
    (the spelling the changelog uploader uses for the files it writes).
    """
    if not is_relative(path):
        return path
    fs, root = _split(base_path)
    full = ("" if root == "/" else root) + "/" + path
    return full if _is_local(fs) else fs.unstrip_protocol(full)


def map_handle_paths(handle: Any, fn: Callable[[str], str]) -> Any:
    """A copy of a `ChangelogStateHandleStreamImpl` with every file path passed through `fn`."""
    from dstl.changelog.handles import ChangelogStateHandleStreamImpl, StreamStateHandle

    cache = {}
    pairs = []
    for h, off in handle.handles_and_offsets:
        new = cache.get(h)
        if new is None:
            new = cache[h] = StreamStateHandle(fn(h.path), h.size)
        pairs.append((new, off))
    return ChangelogStateHandleStreamImpl(pairs, handle.key_group_range, handle.state_size,
                                          handle.checkpointed_size, handle.storage_identifier,
                                          handle.state_handle_id)
