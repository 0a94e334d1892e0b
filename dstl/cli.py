"""The `dstl` command. Each subcommand lives in its own module with `add_arguments(p)` and `run(args)`."""
from __future__ import annotations

import argparse
import importlib
import sys
from typing import List, Optional

# subcommand -> (module, one-line help). Modules are imported only when their command runs.
COMMANDS = {
    "inspect": ("dstl.tools.inspect", "print the change sets of a changelog file (any fsspec URL)"),
    "dump": ("dstl.tools.dump", "print the changes of one change set of a changelog file"),
    "gc": ("dstl.tools.gc", "delete changelog files no retained checkpoint references"),
    "demo": ("dstl.tools.demo", "run the demo job"),
    "state": ("dstl.tools.state_cli", "a job's checkpoints, state and changes; offline max-parallelism change"),
    "pipeline": ("dstl.app.pipeline", "run the stateful PySpark pipeline"),
}


def build_parser() -> argparse.ArgumentParser:
    parser = argparse.ArgumentParser(
        prog="dstl",
        description="dstl: a durable, Flink-compatible state changelog for PySpark. "
                    "Inspect changelog files, collect garbage, run the stateful pipeline.",
        epilog="Run `dstl COMMAND --help` for a command's options.")
    parser.add_argument("--version", action=_Version, help="print the version and the implementation in use, and exit")
    sub = parser.add_subparsers(dest="command", metavar="COMMAND")
    sub.required = True
    for name, (module, help_text) in COMMANDS.items():
        p = sub.add_parser(name, help=help_text, description=help_text)
        p.set_defaults(_module=module)
        if name in _wanted:
            importlib.import_module(module).add_arguments(p)
            if name in _FS_COMMANDS:
                add_fs_option(p)
    return parser


# commands that open a URL themselves (the state subcommands and the pipeline add the flag their own way)
_FS_COMMANDS = ("inspect", "dump", "gc")


def add_fs_option(p: argparse.ArgumentParser) -> None:
    """`--fs-option NAME=VALUE`: a keyword argument of the URL's fsspec file system (repeatable)."""
    p.add_argument("--fs-option", action="append", default=[], metavar="NAME=VALUE",
                   help="a keyword argument of the URL's fsspec file system (repeatable), e.g. profile=minio, "
                        "client_kwargs.endpoint_url=http://host:9000 (a dotted NAME fills a nested dict; a "
                        "VALUE that parses as JSON, such as true or {...}, is that value)")


_wanted: set = set()


class _Version(argparse.Action):
    """`dstl --version`: the version, and whether the Cython modules or the twins are in use (the
    choice imports the compiled modules, so it is made only when asked)."""

    def __init__(self, option_strings, dest, **kwargs):
        super().__init__(option_strings, dest, nargs=0, default=argparse.SUPPRESS, **kwargs)

    def __call__(self, parser, namespace, values, option_string=None):
        import dstl

        sys.stdout.write(f"dstl {dstl.__version__} (implementation: {dstl.IMPLEMENTATION})\n")
        parser.exit()


def main(argv: Optional[List[str]] = None) -> int:
    argv = list(sys.argv[1:] if argv is None else argv)
    # only the chosen subcommand's module is imported (pyspark is heavy)
    _wanted.clear()
    _wanted.update(a for a in argv[:1] if a in COMMANDS)
    args = build_parser().parse_args(argv)
    url = _remote_url(args)
    name = " ".join(a for a in (args.command, getattr(args, "state_command", None)) if a)
    if url is not None and getattr(args, "fs_option", None) and args.command != "pipeline":
        from dstl.changelog.fs import fs_options_from_flags, register_storage_options

        try:  # before the probe: every file system opened on the URL's bucket uses them
            register_storage_options(url, fs_options_from_flags(args.fs_option))
        except ValueError as exc:
            print(f"dstl {name}: error: {exc}", file=sys.stderr)
            return 2
    try:
        if url is not None and args.command != "pipeline":  # the pipeline probes its paths itself
            from dstl.changelog.fs import probe_base_path

            probe_base_path(url)
        return int(importlib.import_module(args._module).run(args) or 0)
    except KeyboardInterrupt:
        return 130
    except BrokenPipeError:
        return 0
    except Exception as exc:  # an unreachable store: one line naming URL and cause, no traceback
        from dstl.changelog.fs import StoreUnreachableError, unreachable_reason

        if isinstance(exc, StoreUnreachableError):
            line = str(exc)
        else:
            reason = unreachable_reason(exc, url or "")
            if reason is None:
                raise
            line = f"cannot reach {url or 'the store'}: {reason}"
        print(f"dstl {name}: error: {line}", file=sys.stderr)
        return 2


# argument names that hold the path or URL a subcommand reads
_URL_ARGS = ("base_path", "base_url", "url", "file", "path")


def _remote_url(args) -> Optional[str]:
    """The remote (non-local) URL a subcommand works on, if any."""
    for name in _URL_ARGS:
        v = getattr(args, name, None)
        if isinstance(v, str) and "://" in v and not v.startswith("file://"):
            return v
    return None
