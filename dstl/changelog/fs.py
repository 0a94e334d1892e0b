"""URLs to file systems and back: the one place that knows how a base path or a file URL maps to an
fsspec file system, a path inside it, and a comparable key.

Plain local paths and `file://` URLs are the local disk; anything else goes through fsspec's
registry of protocols (a module can register more, e.g. through DSTL_SERVICE_IMPORTS).
"""
from __future__ import annotations

import os
from typing import Any, Dict, Mapping, Optional, Tuple

# the registry of fsspec options lives with the options (dstl.config); re-exported here
from dstl.config import _prefix, fs_options_from_flags, options_for, register_options, register_storage_options
from dstl.errors import DstlError

_LOCAL_PROTOCOLS = frozenset({"file", "local"})
# protocols whose stores create a file only if it does not exist, atomically (S3: If-None-Match: *)
_ATOMIC_CREATE_PROTOCOLS = frozenset({"s3", "s3a"})
#: stores whose "folders" are key prefixes: nothing to make before a write
_FLAT_PROTOCOLS = frozenset({"s3", "s3a", "gs", "gcs", "abfs", "abfss", "az"})

#: how a process hands its fsspec options to the upload service it starts (environment, not a file)
OPTIONS_ENV = "DSTL_FS_OPTIONS"


def options_env(url: str, options: Optional[Mapping[str, Any]]) -> Dict[str, str]:
    """`{OPTIONS_ENV: ...}` carrying `options` for `url` to a child process, or {} without options."""
    if not options:
        return {}
    import base64
    import pickle

    return {OPTIONS_ENV: base64.b64encode(pickle.dumps({_prefix(os.fspath(url)): dict(options)})).decode()}


def _load_options_env() -> None:
    raw = os.environ.get(OPTIONS_ENV)
    if not raw:
        return
    import base64
    import pickle

    for url, options in pickle.loads(base64.b64decode(raw)).items():
        register_options(url, options)


def filesystem(url: str, options: Optional[Mapping[str, Any]] = None) -> Tuple[object, str]:
    """`(fsspec file system, path inside it)` for a URL or a plain local path; fsspec `options`
    default to those registered for the URL (`register_options`)."""
    from fsspec.core import url_to_fs

    if hasattr(url, "__fspath__"):
        url = os.fspath(url)
    opts = options_for(url) if options is None else dict(options)
    return url_to_fs(url, **opts)


def has_atomic_create(fs) -> bool:
    """True where `create_file` is atomic against a concurrent writer (local disk, S3)."""
    if is_local(fs):
        return True
    protocols = fs.protocol if isinstance(fs.protocol, (tuple, list)) else (fs.protocol,)
    return any(p in _ATOMIC_CREATE_PROTOCOLS for p in protocols)


def make_parent_dirs(fs, directory: str) -> None:
    """Make `directory` where the store has folders; on object stores a write needs none, and
    `makedirs` would cost a request (s3fs checks the bucket)."""
    protocols = fs.protocol if isinstance(fs.protocol, (tuple, list)) else (fs.protocol,)
    if not any(p in _FLAT_PROTOCOLS for p in protocols):
        fs.makedirs(directory, exist_ok=True)


def create_file(fs, path: str, data: bytes) -> bool:
    """Write `data` to a new file `path`, whole or not at all; FileExistsError if it exists.

    Local disk: a temporary file hard-linked into place (link fails if the name exists). S3: one PUT
    with `If-None-Match: *`. Elsewhere: an existence check, then a write (not atomic: the caller
    fences with a lease, dstl.state.fencing). Returns whether the create was atomic.
    """
    if is_local(fs):
        _create_local(fs._strip_protocol(path), data)
        return True
    directory = path.rsplit("/", 1)[0]
    if has_atomic_create(fs):
        try:
            fs.pipe_file(path, data, mode="create")
        except FileExistsError:
            # a PUT whose answer was lost, retried by the client library: the retry finds the
            # object the first one made. Byte for byte ours (every caller's data names its writer)
            # is our create; anything else is someone else's
            if not _holds(fs, path, data):
                raise
        fs.invalidate_cache(directory)
        return True
    fs.invalidate_cache(directory)
    if fs.exists(path):
        raise FileExistsError(f"{path} already exists")
    fs.makedirs(directory, exist_ok=True)
    fs.pipe_file(path, data)
    fs.invalidate_cache(directory)
    return False


def _holds(fs, path: str, data: bytes) -> bool:
    """Whether `path` exists with exactly `data`."""
    fs.invalidate_cache(path.rsplit("/", 1)[0])
    try:
        return fs.cat_file(path) == data
    except FileNotFoundError:
        return False


def replace_file(fs, path: str, data: bytes) -> None:
    """Write `data` to `path`, replacing what is there: readers see the old or the new file, whole."""
    if is_local(fs):
        _write_local(fs._strip_protocol(path), data, exclusive=False)
        return
    directory = path.rsplit("/", 1)[0]
    fs.makedirs(directory, exist_ok=True)
    fs.pipe_file(path, data)  # one PUT on object stores: the object appears whole or not at all
    fs.invalidate_cache(directory)


def _create_local(path: str, data: bytes) -> None:
    _write_local(path, data, exclusive=True)


def _write_local(path: str, data: bytes, exclusive: bool) -> None:
    """A temporary file, fsynced, then linked (exclusive) or renamed into place; the directory fsynced."""
    import uuid

    directory = os.path.dirname(path)
    os.makedirs(directory, exist_ok=True)
    tmp = os.path.join(directory, f".{os.path.basename(path)}.inprogress-{uuid.uuid4().hex}")
    try:
        with open(tmp, "wb") as f:
            f.write(data)
            f.flush()
            os.fsync(f.fileno())
        if not exclusive:
            os.replace(tmp, path)  # atomic on POSIX
        else:
            try:
                os.link(tmp, path)  # atomic and exclusive
            except FileExistsError:
                raise FileExistsError(f"{path} already exists") from None
            except OSError:  # no hard links on this filesystem: O_EXCL still decides who creates it
                fd = os.open(path, os.O_WRONLY | os.O_CREAT | os.O_EXCL, 0o644)
                with os.fdopen(fd, "wb") as f:
                    f.write(data)
                    f.flush()
                    os.fsync(f.fileno())
    finally:
        try:
            os.unlink(tmp)
        except FileNotFoundError:
            pass
    fd = os.open(directory, os.O_RDONLY)
    try:
        os.fsync(fd)  # make the new directory entry durable
    finally:
        os.close(fd)


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


# ------------------------------------------------------------------ reachability (driver probe, CLI)


class StoreUnreachableError(DstlError, OSError):
    """A base path whose store cannot be reached: no credentials, no bucket, endpoint down."""


_CREDENTIAL_SOURCES = {
    "s3": "storage_options (key/secret, profile), the environment (AWS_ACCESS_KEY_ID, "
          "AWS_SECRET_ACCESS_KEY, AWS_PROFILE), ~/.aws/credentials and ~/.aws/config, and the instance "
          "or container role",
    "gcs": "storage_options (token), GOOGLE_APPLICATION_CREDENTIALS, gcloud's default "
           "credentials and the instance's service account",
    "abfs": "storage_options (account_name, account_key, sas_token, ...), the environment "
            "(AZURE_STORAGE_*) and the managed identity",
}
_CREDENTIAL_SOURCES.update({"s3a": _CREDENTIAL_SOURCES["s3"], "gs": _CREDENTIAL_SOURCES["gcs"],
                            "az": _CREDENTIAL_SOURCES["abfs"]})


def protocol_of(url: str) -> str:
    """The protocol of a base path or URL ("file" for a plain path; the outer one of a chain)."""
    return url.split("://", 1)[0].split("::")[0] if "://" in url else "file"


def credential_sources(url: str) -> str:
    """Where credentials for `url`'s store are looked for, in words."""
    return _CREDENTIAL_SOURCES.get(protocol_of(url), "storage_options and the file system's "
                                                      "own defaults (its environment variables, config files)")


def unreachable_reason(exc: BaseException, url: str) -> Optional[str]:
    """One line saying why `url`'s store could not be reached, if `exc` is such a failure, else None
    (a plain missing file on a reachable store is not)."""
    name = type(exc).__name__
    text = str(exc).strip().splitlines()[0] if str(exc).strip() else name
    chain = []
    e: Optional[BaseException] = exc
    while e is not None and len(chain) < 6:
        chain.append(type(e).__name__)
        e = e.__cause__ or e.__context__
    if "NoCredentialsError" in chain or "PartialCredentialsError" in chain \
            or "Unable to locate credentials" in text:
        return f"no credentials found; looked in {credential_sources(url)}"
    if any(n in chain for n in ("EndpointConnectionError", "ConnectTimeoutError", "ConnectionRefusedError",
                                "ClientConnectorError", "ServerDisconnectedError", "ReadTimeoutError")):
        return f"cannot connect to the store's endpoint ({text})"
    if isinstance(exc, PermissionError) or any(w in text for w in ("AccessDenied", "InvalidAccessKeyId",
                                                                    "SignatureDoesNotMatch", "Forbidden")):
        return f"access denied ({text}); credentials are looked for in {credential_sources(url)}"
    if "NoSuchBucket" in text or "bucket does not exist" in text.lower() or "not valid" in text:
        return f"the bucket does not exist or its name is invalid ({text})"
    if isinstance(exc, ImportError):
        return f"the file system's package is missing ({text})"
    if isinstance(exc, (ConnectionError, TimeoutError)) or name in ("ClientError", "BotoCoreError"):
        return f"{name}: {text}"
    return None


def probe_base_path(base_path: str) -> None:
    """Check, on the driver before the first task runs, that `base_path`'s store answers with the
    registered options: its bucket (or top directory) can be listed. Raises StoreUnreachableError
    naming the URL and the cause (for missing credentials: where they were looked for). A base path
    that does not exist yet is fine (it is created), a missing bucket is not. Local paths: no-op."""
    base_path = os.fspath(base_path)
    if "://" not in base_path or base_path.startswith("file://"):
        return
    top = base_path
    try:
        fs, root = root_of(base_path)
        top = root.strip("/").split("/", 1)[0]
        fs.invalidate_cache(root)
        try:
            fs.ls(root, detail=False)
        except FileNotFoundError:
            fs.invalidate_cache(top)
            fs.ls(top, detail=False)  # the bucket itself: a missing one raises FileNotFoundError
    except FileNotFoundError as exc:
        raise StoreUnreachableError(f"cannot reach {base_path}: the bucket or top directory "
                                    f"{top!r} does not exist ({exc})") from None
    except Exception as exc:  # noqa: BLE001 - classified into one line; unknown ones pass through
        reason = unreachable_reason(exc, base_path)
        if reason is None:
            raise
        raise StoreUnreachableError(f"cannot reach {base_path}: {reason}") from None


__all__ = ["filesystem", "is_local", "root_of", "url_of", "key", "key_of_url", "join", "changelog_dir",
           "validate_base_path", "register_options", "options_for", "register_storage_options",
           "fs_options_from_flags", "has_atomic_create", "make_parent_dirs", "create_file", "replace_file",
           "probe_base_path", "StoreUnreachableError", "unreachable_reason"]

_load_options_env()  # the upload service and its uploaders: options from the client that started it
