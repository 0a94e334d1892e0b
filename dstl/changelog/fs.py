"""URLs to file systems and back: the one place that knows how a base path or a file URL maps to an
fsspec file system, a path inside it, and a comparable key.

Plain local paths and `file://` URLs are the local disk; anything else goes through fsspec's
registry of protocols (a module can register more, e.g. through DSTL_SERVICE_IMPORTS).
"""
from __future__ import annotations

import os
from typing import Tuple

_LOCAL_PROTOCOLS = frozenset({"file", "local"})


def filesystem(url: str) -> Tuple[object, str]:
    """`(fsspec file system, path inside it)` for a URL or a plain local path."""
    from fsspec.core import url_to_fs

    if hasattr(url, "__fspath__"):
        url = os.fspath(url)
    return url_to_fs(url)


def is_local(fs) -> bool:
    """True for the local disk (plain paths, no download cache needed)."""
    protocols = fs.protocol if isinstance(fs.protocol, (tuple, list)) else (fs.protocol,)
    return any(p in _LOCAL_PROTOCOLS for p in protocols)


def root_of(url: str) -> Tuple[object, str]:
    """`(fs, root)` of a base path: the root without a trailing slash (`/` stays `/`)."""
    fs, root = filesystem(url)
    return fs, (root.rstrip("/") or "/")


def url_of(fs, path: str) -> str:
    """How a file is named in handles: a plain path on the local disk, a full URL elsewhere."""
    return path if is_local(fs) else fs.unstrip_protocol(path)


def key(fs, path: str) -> str:
    """A comparable spelling of a file: `<protocol>://<path inside the fs>` (local: the real path)."""
    if is_local(fs):
        return "file://" + os.path.realpath(fs._strip_protocol(path))
    proto = fs.protocol[0] if isinstance(fs.protocol, (tuple, list)) else fs.protocol
    return f"{proto}://{fs._strip_protocol(path)}"


def key_of_url(url: str) -> str:
    """`key` of a URL or plain path."""
    fs, path = filesystem(url)
    return key(fs, path)


def join(*parts: str) -> str:
    """Join path parts with '/' (URLs and fs paths alike)."""
    return "/".join([parts[0].rstrip("/")] + [p.strip("/") for p in parts[1:]])


def changelog_dir(base_path: str, job_id: str) -> Tuple[object, str]:
    """`(fs, <root>/<job id>/dstl)`: where a job's changelog files live."""
    fs, root = root_of(base_path)
    return fs, join(root, job_id, "dstl") if root != "/" else f"/{job_id}/dstl"


def validate_base_path(base_path: str, option: str = "dstl.dfs.base-path") -> None:
    """Reject, at open, what would only fail at the first upload after every retry: an unknown
    protocol, or a base path that exists and is not a directory. ValueError names option and value.
    Transient I/O errors while checking are not reported here (the uploads retry them)."""
    import fsspec

    if not isinstance(base_path, str) or not base_path:
        raise ValueError(f"invalid value {base_path!r} for option {option!r}: must be a non-empty path or URL")
    protocol, _ = fsspec.core.split_protocol(base_path)
    if protocol is not None:
        chained = protocol.split("::")[0]
        try:
            fsspec.get_filesystem_class(chained)
        except (ValueError, ImportError) as exc:
            raise ValueError(f"invalid value {base_path!r} for option {option!r}: unknown file system "
                             f"protocol {chained!r} ({exc})") from None
    try:
        fs, root = root_of(base_path)
    except (ValueError, ImportError) as exc:
        raise ValueError(f"invalid value {base_path!r} for option {option!r}: {exc}") from None
    try:
        is_file = fs.isfile(root)
    except Exception:  # unreachable store, permissions: left to the uploads and their retries
        return
    if is_file:
        raise ValueError(f"invalid value {base_path!r} for option {option!r}: it is a file, not a directory")


__all__ = ["filesystem", "is_local", "root_of", "url_of", "key", "key_of_url", "join", "changelog_dir",
           "validate_base_path"]
