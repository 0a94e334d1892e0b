"""`dstl demo`: the pipeline with its defaults and --verify, into ./demo-run (what `make demo` runs).

A previous demo's directory (recognised by its `.dstl-demo` marker) is replaced; any other existing
directory at that path is left alone and reported as an error.
"""
from __future__ import annotations

import argparse
import os
import shutil
import sys

MARKER = ".dstl-demo"


def add_arguments(p: argparse.ArgumentParser) -> None:
    p.add_argument("--dir", default="./demo-run", help="where the demo writes (default ./demo-run)")
    p.add_argument("--events", type=int, default=200_000, help="synthetic events (default 200000)")
    p.add_argument("--batches", type=int, default=10, help="micro-batches (default 10)")
    p.add_argument("--master", default="local[2,4]", help="Spark master (default local[2,4])")
    p.add_argument("--retain", type=int, default=2, help="completed checkpoints kept (default 2)")


def run(args: argparse.Namespace) -> int:
    from dstl.app import pipeline

    target = os.path.abspath(args.dir)
    if os.path.exists(target):
        if not os.path.exists(os.path.join(target, MARKER)):
            print(f"dstl demo: error: {target} exists and is not a previous demo run; remove it or pass --dir",
                  file=sys.stderr)
            return 2
        shutil.rmtree(target)
    os.makedirs(target)
    open(os.path.join(target, MARKER), "w").close()
    base = os.path.join(target, "state")
    print(f"dstl demo: {args.events:,} events in {args.batches} micro-batches on Spark {args.master}, "
          f"state in {base}, output in {os.path.join(target, 'output')}", file=sys.stderr)
    p = argparse.ArgumentParser(prog="dstl pipeline")
    pipeline.add_arguments(p)
    argv = ["--base-path", base, "--output", os.path.join(target, "output"), "--events", str(args.events),
            "--batches", str(args.batches), "--master", args.master, "--retain", str(getattr(args, "retain", 2)),
            "--verify"]
    return pipeline.run(p.parse_args(argv))
