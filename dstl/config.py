"""Storage options (docs/options.md): dstl's own options (Flink's keys in both spellings, Flink's value
syntax, validation) and the fsspec keyword arguments of the base path's file system (`storage_options=`,
as pandas and fsspec name them), kept apart: a name given in the wrong one is an error saying where it goes."""
from __future__ import annotations

import dataclasses
import datetime
import os
import re
import threading
from dataclasses import dataclass
from typing import Any, Callable, Dict, Mapping, Optional, Tuple

PREFIX = "dstl.dfs."
PREFIX_2X = "state.changelog.dstl.dfs."
#: `dstl.dfs.fs.<name>`: in a Flink-key mapping (`StorageConfig.to_mapping()`, what tasks receive),
#: keyword argument `<name>` of the base path's fsspec file system; kept in memory, never written
FS_PREFIX = "fs."
INT64_MAX = 2**63 - 1
INT32_MAX = 2**31 - 1

KIB = 1024
MIB = 1024 * 1024

_DURATION_UNITS_MS: Dict[str, Tuple[int, int]] = {}  # label -> (numerator, denominator) to ms
for _labels, _ratio in (
    (("d", "day", "days"), (86_400_000, 1)),
    (("h", "hour", "hours"), (3_600_000, 1)),
    (("min", "m", "minute", "minutes"), (60_000, 1)),
    (("s", "sec", "secs", "second", "seconds"), (1_000, 1)),
    (("ms", "milli", "millis", "millisecond", "milliseconds"), (1, 1)),
    (("\u00b5s", "micro", "micros", "microsecond", "microseconds"), (1, 1_000)),
    (("ns", "nano", "nanos", "nanosecond", "nanoseconds"), (1, 1_000_000)),
):
    for _label in _labels:
        _DURATION_UNITS_MS[_label] = _ratio

_MEMORY_UNITS: Dict[str, int] = {}
for _labels, _factor in (
    (("b", "bytes"), 1),
    (("k", "kb", "kibibytes"), 1 << 10),
    (("m", "mb", "mebibytes"), 1 << 20),
    (("g", "gb", "gibibytes"), 1 << 30),
    (("t", "tb", "tebibytes"), 1 << 40),
):
    for _label in _labels:
        _MEMORY_UNITS[_label] = _factor

# ASCII digits only: str.isdigit() would accept '²' and other Unicode digits.
_AMOUNT = re.compile(r"([0-9]+)(.*)", re.DOTALL)

# URL prefix -> fsspec options (endpoint_url, key/secret, client_kwargs, ...), in memory only: the
# storage options that carry them are registered by every process that opens a storage on them
_OPTIONS: Dict[str, Dict[str, Any]] = {}
_OPTIONS_LOCK = threading.Lock()


def _prefix(url: str) -> str:
    return url.rstrip("/")


def register_options(url: str, options: Optional[Mapping[str, Any]]) -> None:
    """Use fsspec `options` for every file system opened on `url` or below it (and on the rest of
    its bucket or host, unless another registration is more specific). Kept in memory only."""
    if not options or "://" not in str(url):
        return
    url = _prefix(os.fspath(url))
    proto, rest = url.split("://", 1)
    with _OPTIONS_LOCK:
        _OPTIONS[url] = dict(options)
        _OPTIONS.setdefault(f"{proto}://{rest.split('/', 1)[0]}", dict(options))


def options_for(url: str) -> Dict[str, Any]:
    """The fsspec options registered for `url` (longest matching prefix), else {}."""
    if not _OPTIONS or "://" not in url:
        return {}
    with _OPTIONS_LOCK:
        best = max((p for p in _OPTIONS if url == p or url.startswith(p + "/")), key=len, default=None)
        return dict(_OPTIONS[best]) if best is not None else {}


def _bad(key: str, value: Any, why: str) -> ValueError:
    return ValueError(f"invalid value {value!r} for option {key!r}: {why}")


def _split_amount(value: str, key: str, kind: str) -> Tuple[int, str]:
    text = value.strip()
    m = _AMOUNT.fullmatch(text)
    if not m:
        raise _bad(key, value, f"expected a {kind} like '<digits>[ ]<unit>'")
    number = int(m.group(1))
    if number > INT64_MAX:
        raise _bad(key, value, "the number does not fit in a 64-bit signed integer")
    return number, m.group(2).strip().lower()  # lower(), not casefold(): keeps 'µ'


def parse_duration_ms(value: Any, key: str = "duration") -> int:
    """A Flink Duration (`"10 ms"`, `"1s"`, `"155"`, int ms, `timedelta`) in whole milliseconds."""
    if isinstance(value, bool) or isinstance(value, float):
        raise _bad(key, value, "a duration must be a string, an int (ms) or a datetime.timedelta")
    if isinstance(value, int):
        ms = value
    elif isinstance(value, datetime.timedelta):
        ms = value // datetime.timedelta(milliseconds=1)
    elif isinstance(value, str):
        number, unit = _split_amount(value, key, "duration")
        if unit == "":
            ratio = (1, 1)
        elif unit in _DURATION_UNITS_MS:
            ratio = _DURATION_UNITS_MS[unit]
        else:
            raise _bad(key, value, f"unknown time unit {unit!r} (use d, h, min/m, s, ms, \u00b5s, ns)")
        ms = number * ratio[0] // ratio[1]
    else:
        raise _bad(key, value, f"a duration must be a string, an int (ms) or a timedelta, "
                               f"not {type(value).__name__}")
    if ms < 0:
        raise _bad(key, value, "a duration must not be negative")
    if ms > INT64_MAX:
        raise _bad(key, value, "the duration in milliseconds overflows a 64-bit signed integer")
    return ms


def parse_memory_size(value: Any, key: str = "memory size") -> int:
    """A Flink MemorySize (`"5mb"`, `"64kb"`, `"1024"`, int bytes) in bytes (binary units)."""
    if isinstance(value, bool) or isinstance(value, float):
        raise _bad(key, value, "a memory size must be a string or an int (bytes)")
    if isinstance(value, int):
        size = value
    elif isinstance(value, str):
        number, unit = _split_amount(value, key, "memory size")
        if unit == "":
            factor = 1
        elif unit in _MEMORY_UNITS:
            factor = _MEMORY_UNITS[unit]
        else:
            raise _bad(key, value, f"unknown memory unit {unit!r} (use b, kb, mb, gb, tb)")
        size = number * factor
    else:
        raise _bad(key, value, f"a memory size must be a string or an int, not {type(value).__name__}")
    if size < 0:
        raise _bad(key, value, "a memory size must not be negative")
    if size > INT64_MAX:
        raise _bad(key, value, "the size in bytes overflows a 64-bit signed integer")
    return size


def parse_bool(value: Any, key: str = "boolean") -> bool:
    """`True`/`False` or the strings "true"/"false" in any case."""
    if isinstance(value, bool):
        return value
    if isinstance(value, str):
        text = value.strip().lower()
        if text in ("true", "false"):
            return text == "true"
    raise _bad(key, value, "expected true or false")


def parse_int(value: Any, key: str = "integer") -> int:
    """An int (not bool) or a decimal string; must fit in a Java int, as Flink's int options do."""
    if isinstance(value, bool):
        raise _bad(key, value, "expected an integer, not a bool")
    if isinstance(value, int):
        result = value
    elif isinstance(value, str) and re.fullmatch(r"[+-]?[0-9]+", value.strip()):
        result = int(value.strip())
    else:
        raise _bad(key, value, "expected an integer")
    if not -2**31 <= result <= INT32_MAX:
        raise _bad(key, value, "the integer does not fit in 32 bits")
    return result


def _enum(*allowed: str) -> Callable[[Any, str], str]:
    def parse(value: Any, key: str) -> str:
        if not isinstance(value, str) or value not in allowed:
            raise _bad(key, value, "expected one of " + ", ".join(allowed) + " (exact, lower case)")
        return value
    return parse


def _path(value: Any, key: str) -> str:
    if isinstance(value, os.PathLike):
        value = os.fspath(value)
    if not isinstance(value, str) or not value.strip():
        raise _bad(key, value, "expected a non-empty path or fsspec URL")
    return value


# upper bound of upload.num-threads: in process mode each is an uploader process (~30 MB)
MAX_UPLOAD_THREADS = 64


@dataclass(frozen=True)
class _Option:
    suffix: str
    field: str
    parse: Callable[[Any, str], Any]
    kind: str  # for docs and to_mapping(as_strings=True)


OPTIONS: Tuple[_Option, ...] = (
    _Option("base-path", "base_path", _path, "string"),
    _Option("compression.enabled", "compression_enabled", parse_bool, "bool"),
    _Option("compression.codec", "compression_codec", _enum("snappy", "zstd"), "enum"),
    _Option("preemptive-persist-threshold", "preemptive_persist_threshold", parse_memory_size, "memory"),
    _Option("batch.persist-delay", "persist_delay_ms", parse_duration_ms, "duration"),
    _Option("batch.persist-size-threshold", "persist_size_threshold", parse_memory_size, "memory"),
    _Option("upload.buffer-size", "upload_buffer_size", parse_memory_size, "memory"),
    _Option("upload.num-threads", "upload_num_threads", parse_int, "int"),
    _Option("discard.num-threads", "discard_num_threads", parse_int, "int"),
    _Option("upload.max-in-flight", "max_in_flight", parse_memory_size, "memory"),
    _Option("upload.retry-policy", "retry_policy", _enum("fixed", "none"), "enum"),
    _Option("upload.timeout", "upload_timeout_ms", parse_duration_ms, "duration"),
    _Option("upload.max-attempts", "max_attempts", parse_int, "int"),
    _Option("upload.next-attempt-delay", "next_attempt_delay_ms", parse_duration_ms, "duration"),
    _Option("download.local-cache.idle-timeout-ms", "cache_idle_timeout_ms", parse_duration_ms, "duration"),
    _Option("upload.mode", "upload_mode", _enum("process", "thread", "direct"), "enum"),
)
_BY_SUFFIX = {o.suffix: o for o in OPTIONS}
_BY_FIELD = {o.field: o for o in OPTIONS}
# open_storage(..., batch_persist_delay="10 ms"): suffix with '.' and '-' replaced by '_'
_BY_KWARG = {o.suffix.replace(".", "_").replace("-", "_"): o for o in OPTIONS}


def canonical_key(field_or_suffix: str) -> str:
    """`"persist_delay_ms"` or `"batch.persist-delay"` -> `"dstl.dfs.batch.persist-delay"`."""
    opt = _BY_FIELD.get(field_or_suffix) or _BY_SUFFIX.get(field_or_suffix)
    if opt is None:
        raise KeyError(field_or_suffix)
    return PREFIX + opt.suffix


def _fs_option_of(key: str) -> Optional[str]:
    """`"dstl.dfs.fs.endpoint_url"` -> `"endpoint_url"`; None for other keys."""
    for prefix in (PREFIX_2X, PREFIX):
        if key.startswith(prefix + FS_PREFIX):
            return key[len(prefix + FS_PREFIX):] or None
    return None


def _suffix_of(key: str) -> Optional[str]:
    for prefix in (PREFIX_2X, PREFIX):  # the 2.x prefix contains the 1.x one: test it first
        if key.startswith(prefix):
            suffix = key[len(prefix):]
            return suffix if suffix in _BY_SUFFIX else None
    return None


@dataclass(frozen=True)
class StorageConfig:
    """Validated options of one `FsStateChangelogStorage`; sizes in bytes, durations in ms."""

    base_path: str
    compression_enabled: bool = False
    compression_codec: str = "snappy"
    preemptive_persist_threshold: int = 5 * MIB
    persist_delay_ms: int = 10
    persist_size_threshold: int = 10 * MIB
    upload_buffer_size: int = 1 * MIB
    upload_num_threads: int = 5
    discard_num_threads: int = 1
    max_in_flight: int = 100 * MIB
    retry_policy: str = "fixed"
    upload_timeout_ms: int = 1000
    max_attempts: int = 3
    next_attempt_delay_ms: int = 500
    cache_idle_timeout_ms: int = 600_000
    upload_mode: str = "process"  # the host's upload service (docs/options.md); "thread" keeps uploads in-process
    #: fsspec keyword arguments of the base path's file system (credentials among them): never in
    #: repr, logs, config files or the base path; registered in memory for the base path (dstl.changelog.fs)
    fs_options: Mapping[str, Any] = dataclasses.field(default_factory=dict, repr=False)

    def __post_init__(self) -> None:
        # Direct construction goes through the same parsers, so Flink strings work here too.
        for opt in OPTIONS:
            key = PREFIX + opt.suffix
            parsed = opt.parse(getattr(self, opt.field), key)
            object.__setattr__(self, opt.field, parsed)
        object.__setattr__(self, "fs_options", fs_options_of(self.fs_options, "fs_options"))
        self._validate()
        if self.fs_options:
            register_options(self.base_path, self.fs_options)

    def __setstate__(self, state: Dict[str, Any]) -> None:
        # unpickled in another process (a Spark Connect foreachBatch worker): register there too
        self.__dict__.update(state)
        if self.fs_options:
            register_options(self.base_path, self.fs_options)

    def _validate(self) -> None:
        def need(ok: bool, field: str, why: str) -> None:
            if not ok:
                raise ValueError(f"invalid value {getattr(self, field)!r} for option "
                                 f"{canonical_key(field)!r}: {why}")

        need(1 <= self.upload_buffer_size <= INT32_MAX, "upload_buffer_size", "must be 1 .. 2^31-1 bytes")
        need(1 <= self.upload_num_threads <= MAX_UPLOAD_THREADS, "upload_num_threads",
             f"must be 1 .. {MAX_UPLOAD_THREADS} (each is an uploader process in process mode)")
        need(self.discard_num_threads >= 1, "discard_num_threads", "must be >= 1")
        need(self.max_in_flight >= 1, "max_in_flight", "must be >= 1 byte")
        need(self.max_attempts >= 1, "max_attempts", "must be >= 1")
        if self.persist_size_threshold > self.max_in_flight:
            raise ValueError(
                f"option {canonical_key('persist_size_threshold')!r} ({self.persist_size_threshold} bytes) "
                f"must be <= {canonical_key('max_in_flight')!r} ({self.max_in_flight} bytes)")

    @property
    def compression(self) -> Optional[str]:
        """The codec to write with, or None when compression is disabled."""
        return self.compression_codec if self.compression_enabled else None

    @classmethod
    def from_mapping(cls, mapping: Mapping[str, Any]) -> "StorageConfig":
        """Build from Flink option keys (`dstl.dfs.*` or `state.changelog.dstl.dfs.*`)."""
        if isinstance(mapping, StorageConfig):
            return mapping
        if not isinstance(mapping, Mapping):
            raise TypeError(f"options must be a mapping of option keys, got {type(mapping).__name__}")
        values: Dict[str, Any] = {}
        seen_key: Dict[str, str] = {}
        fs_options: Dict[str, Any] = {}
        for key, raw in mapping.items():
            if not isinstance(key, str):
                raise ValueError(f"option keys must be strings, got {key!r}")
            fs_name = _fs_option_of(key)
            if fs_name is not None:
                fs_options[fs_name] = raw
                continue
            suffix = _suffix_of(key)
            if suffix is None:
                raise ValueError(f"unknown option {key!r} (dstl options are {PREFIX}<suffix> or "
                                 f"{PREFIX_2X}<suffix>; suffixes: {', '.join(_BY_SUFFIX)}; the file "
                                 f"system's keyword arguments go in storage_options=, in a mapping "
                                 f"{PREFIX}{FS_PREFIX}<name>)")
            opt = _BY_SUFFIX[suffix]
            parsed = opt.parse(raw, key)
            if opt.field in values and values[opt.field] != parsed:
                raise ValueError(f"conflicting values for one option: {seen_key[opt.field]!r} = "
                                 f"{mapping[seen_key[opt.field]]!r} and {key!r} = {raw!r}")
            values[opt.field] = parsed
            seen_key[opt.field] = key
        if "base_path" not in values:
            raise ValueError(f"missing required option {PREFIX}base-path (or {PREFIX_2X}base-path)")
        return cls(**values, fs_options=fs_options)

    @classmethod
    def from_options(cls, base_path: Any = None, *, storage_options: Optional[Mapping[str, Any]] = None,
                     **options: Any) -> "StorageConfig":
        """Keyword form: suffixes with '.'/'-' as '_' (`batch_persist_delay="10 ms"`) or field names;
        `storage_options`: the fsspec file system's keyword arguments (key, secret, client_kwargs, ...)."""
        if "fs_options" in options:
            raise ValueError("fs_options= is now storage_options= (the file system's keyword arguments)")
        for name in options:
            if _BY_KWARG.get(name) is None and _BY_FIELD.get(name) is None:
                raise _unknown(name, "options")
        return storage_config(base_path, options, storage_options)

    @classmethod
    def of(cls, config: Any) -> "StorageConfig":
        """A StorageConfig as is, or one built from a mapping of option keys."""
        return config if isinstance(config, StorageConfig) else cls.from_mapping(config)

    def to_mapping(self, as_strings: bool = False, *, with_fs_options: bool = True) -> Dict[str, Any]:
        """Canonical `dstl.dfs.*` keys; `as_strings=True` writes Flink syntax ("10 ms", "5242880 b").
        fsspec options come as `dstl.dfs.fs.<name>` unless `with_fs_options=False` (anything written
        to a file must leave them out: they may hold credentials)."""
        out: Dict[str, Any] = {}
        for opt in OPTIONS:
            value = getattr(self, opt.field)
            if as_strings:
                if opt.kind == "duration":
                    value = f"{value} ms"
                elif opt.kind == "memory":
                    value = f"{value} b"
                elif opt.kind == "bool":
                    value = "true" if value else "false"
                elif opt.kind == "int":
                    value = str(value)
            out[PREFIX + opt.suffix] = value
        if with_fs_options:
            for name, value in self.fs_options.items():
                out[f"{PREFIX}{FS_PREFIX}{name}"] = value
        return out

    def replace(self, **changes: Any) -> "StorageConfig":
        """A copy with some fields changed (validated again)."""
        return dataclasses.replace(self, **changes)


def dstl_option_key(name: Any) -> Optional[str]:
    """The canonical `dstl.dfs.*` key of a dstl option written in any spelling (either key prefix,
    the bare suffix, the suffix with '.'/'-' as '_', or the field name), else None. dstl's option
    names are this finite set; a file system's keyword arguments are open-ended, so this set is what
    tells the two apart."""
    if not isinstance(name, str):
        return None
    name = name.strip()
    suffix = _suffix_of(name)
    if suffix is not None:
        return PREFIX + suffix
    opt = _BY_SUFFIX.get(name) or _BY_KWARG.get(name) or _BY_FIELD.get(name)
    return None if opt is None else PREFIX + opt.suffix


def _old_fs_name(name: str) -> Optional[str]:
    """`"fs.key"`, `"dstl.dfs.fs.key"` -> `"key"`: the spelling fsspec arguments had among dstl's options."""
    name = name.strip()
    found = _fs_option_of(name)
    if found is None and name.startswith(FS_PREFIX) and len(name) > len(FS_PREFIX):
        found = name[len(FS_PREFIX):]
    return found


def _go(place: str, name: str, cli: bool) -> str:
    """How to pass `name` in `place` ("options" or "storage_options"), in the API's or the CLI's syntax."""
    if cli:
        # only `dstl pipeline` takes dstl options; the readers (state, inspect, dump, gc) use the defaults
        return f"--option {name}=... (a flag of dstl pipeline)" if place == "options" else f"--fs-option {name}=..."
    return f"{place}={{{name!r}: ...}}"


def _label(place: str, cli: bool) -> str:
    return ("--option" if place == "options" else "--fs-option") if cli else place


def _unknown(name: Any, where: str, cli: bool = False) -> ValueError:
    return ValueError(f"{where}: unknown dstl option {name!r} (a key {PREFIX}<suffix> or "
                      f"{PREFIX_2X}<suffix>, or the bare suffix as in upload.mode or upload_mode; suffixes: "
                      f"{', '.join(_BY_SUFFIX)}); the file system's keyword arguments (key, secret, "
                      f"client_kwargs, ...) go in {_label('storage_options', cli)}")


def fs_options_of(storage_options: Optional[Mapping[str, Any]], where: str = "storage_options",
                  cli: bool = False) -> Dict[str, Any]:
    """`storage_options=` checked: the fsspec file system's keyword arguments, as pandas and fsspec
    take them (`{"key": ..., "secret": ..., "client_kwargs": {"endpoint_url": ...}}`). A dstl option
    or the old `fs.<name>` spelling is a ValueError saying where it goes (`cli`: in the CLI's flags).
    Values never appear in an error: they may be credentials."""
    if storage_options is None:
        return {}
    if not isinstance(storage_options, Mapping):
        raise ValueError(f"{where} must be a mapping of the file system's keyword arguments (key, secret, "
                         f"client_kwargs, ...), got {type(storage_options).__name__}")
    out: Dict[str, Any] = {}
    for name, value in storage_options.items():
        if not isinstance(name, str) or not name.strip():
            raise ValueError(f"{where}: keys must be keyword argument names, got {name!r}")
        old = _old_fs_name(name)
        if old is not None:
            raise ValueError(f"{where}: {name!r} is the old spelling of the file system's keyword argument "
                             f"{old!r}: pass {_go(where if not cli else 'storage_options', old, cli)}")
        key = dstl_option_key(name)
        if key is not None:
            raise ValueError(f"{where}: {name!r} is a dstl option ({key}): pass it in "
                             f"{_go('options', name, cli)}; {where} takes the file system's keyword arguments")
        if name.startswith(("dstl.", "state.changelog.")):
            raise ValueError(f"{where}: {name!r} is not a file system argument but looks like a dstl option "
                             f"key, and no dstl option has that name; dstl options go in {_label('options', cli)}")
        if not name.isidentifier():
            raise ValueError(f"{where}: {name!r} is not a keyword argument name ({where} takes the file "
                             f"system's keyword arguments, e.g. key, secret, client_kwargs; dstl options "
                             f"go in {_label('options', cli)})")
        out[name] = value
    return out


def parse_options(options: Optional[Mapping[str, Any]], where: str = "options", cli: bool = False) -> Dict[str, Any]:
    """`options=` checked: dstl options in any spelling (`dstl.dfs.upload.mode`, its Flink 2.x key,
    `upload.mode`, `upload_mode`) as a mapping of full keys, values not yet parsed. A file system
    argument in its old `fs.<name>` spelling is a ValueError pointing to `storage_options=`."""
    if options is None:
        return {}
    if not isinstance(options, Mapping):
        raise ValueError(f"{where} must be a mapping of dstl option names to values, got {type(options).__name__}")
    out: Dict[str, Any] = {}
    for name, value in options.items():
        if not isinstance(name, str):
            raise ValueError(f"{where}: option names must be strings, got {name!r}")
        old = _old_fs_name(name)
        if old is not None:
            raise ValueError(f"{where}: {name!r} is a keyword argument of the file system: pass it as "
                             f"{_go('storage_options', old, cli)}")
        key = dstl_option_key(name)
        if key is None:
            raise _unknown(name, where, cli)
        full = name.strip()
        if not full.startswith((PREFIX, PREFIX_2X)):
            full = key
        if full in out:
            opt = _BY_SUFFIX[key[len(PREFIX):]]
            if opt.parse(out[full], full) != opt.parse(value, full):
                raise ValueError(f"{where}: option {full!r} given twice with different values")
        out[full] = value
    return out


def fs_options_from_flags(items: Any, flag: str = "--fs-option") -> Dict[str, Any]:
    """Command-line `--fs-option NAME=VALUE` items as the file system's keyword arguments: a dotted
    NAME fills a nested dict (`client_kwargs.endpoint_url=...`); a VALUE that parses as JSON (`true`,
    `5`, `{...}`, `"12345"`) is that value, any other VALUE the string itself. ValueError names the
    problem, never the value."""
    import json

    out: Dict[str, Any] = {}
    for item in items or ():
        if "=" not in item:  # not echoed: it may be a credential
            raise ValueError(f"{flag} expects NAME=VALUE; an argument has no '='")
        name, text = item.split("=", 1)
        name, parts = name.strip(), name.strip().split(".")
        if dstl_option_key(name) is not None or name.startswith(("fs.", "dstl.", "state.changelog.")) \
                or not all(parts):
            fs_options_of({name: None}, flag, cli=True)  # raises, saying where it goes
        fs_options_of({parts[0]: None}, flag, cli=True)
        try:
            value = json.loads(text)
        except ValueError:
            value = text
        node = out
        for part in parts[:-1]:
            node = node.setdefault(part, {})
            if not isinstance(node, dict):
                raise ValueError(f"{flag} {name}: {part} is given both as a value and as a dict")
        node[parts[-1]] = value
    return out


def storage_config(base_path: Any = None, options: Any = None,
                   storage_options: Optional[Mapping[str, Any]] = None) -> StorageConfig:
    """The validated `StorageConfig` of dstl `options` (a mapping in any spelling, or a StorageConfig)
    and the file system's keyword arguments `storage_options`; the base path is `base_path` unless
    `options` names one. Registers the keyword arguments for the base path in this process."""
    fs = fs_options_of(storage_options)
    if isinstance(options, StorageConfig):
        return options.replace(fs_options={**options.fs_options, **fs}) if fs else options
    mapping = parse_options(options)
    if base_path is not None and not any(_suffix_of(k) == "base-path" for k in mapping):
        mapping[PREFIX + "base-path"] = base_path
    for name, value in fs.items():
        mapping[f"{PREFIX}{FS_PREFIX}{name}"] = value
    try:
        return StorageConfig.from_mapping(mapping)
    except ValueError as exc:
        raise ValueError(f"options: {exc}") from None


def register_storage_options(url: str, storage_options: Optional[Mapping[str, Any]]) -> Dict[str, Any]:
    """Check `storage_options` (fs_options_of) and use them for every file system opened on `url`
    or below it in this process; returns them checked."""
    fs = fs_options_of(storage_options)
    if fs:
        register_options(url, fs)
    return fs


__all__ = ["StorageConfig", "parse_duration_ms", "parse_memory_size", "parse_bool", "parse_int",
           "canonical_key", "OPTIONS", "PREFIX", "PREFIX_2X", "FS_PREFIX", "dstl_option_key", "fs_options_of",
           "parse_options", "storage_config", "register_storage_options", "fs_options_from_flags"]
