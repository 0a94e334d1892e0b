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
    sub = parser.add_subparsers(dest="command", metavar="COMMAND")
    sub.required = True
    for name, (module, help_text) in COMMANDS.items():
        p = sub.add_parser(name, help=help_text, description=help_text)
        p.set_defaults(_module=module)
        if name in _wanted:
            importlib.import_module(module).add_arguments(p)
    return parser


_wanted: set = set()


def main(argv: Optional[List[str]] = None) -> int:
    argv = list(sys.argv[1:] if argv is None else argv)
    # only the chosen subcommand's module is imported (pyspark is heavy)
    _wanted.clear()
    _wanted.update(a for a in argv[:1] if a in COMMANDS)
    args = build_parser().parse_args(argv)
    try:
        return int(importlib.import_module(args._module).run(args) or 0)
    except KeyboardInterrupt:
        return 130
    except BrokenPipeError:
        return 0
