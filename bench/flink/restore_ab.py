"""Restore as objects (`for c in reader.get_changes(handle)`), A/B in one process: the decoder of a
base revision (its `dstl/_fast/_decode.pyx`, compiled beside this run as `_decode_base`, chained with
`itertools.chain`) against the working tree's, interleaved round by round, in the thread's CPU time
(time the OS gives to other jobs is not counted). The handle is bench-flink's workload: 1M x 100 B
over 128 key groups, written once by `append_many` in thread mode. Every variant's changes are
checked against the base's (key groups and a digest of the payloads) before the rounds start.

Beside them, the floor of the path (`_restore_floor.pyx`, compiled the same way): the same loop over a
C iterator that returns one object it keeps, then one that makes a `bytes` per change, then a `bytes`
and a `StateChange` per change, over the same payloads, with no file, parsing or checking.

Usage: .venv/bin/python bench/flink/restore_ab.py [--base-rev REV] [--changes N] [--rounds R]
"""
from __future__ import annotations

import argparse
import hashlib
import itertools
import os
import shutil
import statistics
import subprocess
import sys
import tempfile
import time

HERE = os.path.dirname(os.path.abspath(__file__))
ROOT = os.path.dirname(os.path.dirname(HERE))
sys.path.insert(0, HERE)

import _dstl_side as ds  # noqa: E402  (puts the repository first on sys.path too)

from dstl import IMPLEMENTATION, format as fmt, open_storage  # noqa: E402

SETUP = """
from Cython.Build import cythonize
from setuptools import Extension, setup
setup(script_args=["build_ext", "--inplace", "-q"], ext_modules=cythonize(
    [Extension(m, [m + ".pyx"], extra_compile_args=["-O3"]) for m in ("_decode_base", "_restore_floor")],
    include_path=[{root!r}], language_level=3, quiet=True))
"""


def build_base(rev: str, into: str):
    """Compile `rev`'s _decode.pyx as the module `_decode_base` in `into`, and the floor beside it;
    import both."""
    src = subprocess.check_output(["git", "show", f"{rev}:dstl/_fast/_decode.pyx"], cwd=ROOT)
    with open(os.path.join(into, "_decode_base.pyx"), "wb") as f:
        f.write(src)
    shutil.copy(os.path.join(HERE, "_restore_floor.pyx"), into)
    subprocess.run([sys.executable, "-c", SETUP.format(root=ROOT)], cwd=into, check=True,
                   stdout=subprocess.DEVNULL)
    sys.path.insert(0, into)
    import _decode_base
    import _restore_floor

    return _decode_base, _restore_floor


def floor_loop(floor, data: bytes, n: int, mode: int) -> int:
    count = 0
    for _ in floor.Floor(data, n, ds.VALUE, mode):
        count += 1
    return count


def read_objects(reader, handle, use) -> int:
    fmt.iter_change_set, fmt.chain_changes = use
    count = 0
    with reader.get_changes(handle) as it:
        for _ in it:
            count += 1
    return count


def digest(reader, handle, use) -> str:
    fmt.iter_change_set, fmt.chain_changes = use
    h = hashlib.blake2b()
    with reader.get_changes(handle) as it:
        for c in it:
            h.update(c.key_group.to_bytes(2, "big", signed=True))
            h.update(c.data)
    return h.hexdigest()


def main(argv=None) -> int:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--base-rev", default="HEAD", help="revision whose _decode.pyx is the base (default HEAD)")
    ap.add_argument("--changes", type=int, default=1_000_000)
    ap.add_argument("--rounds", type=int, default=11)
    args = ap.parse_args(argv)
    if IMPLEMENTATION != "cython":
        print("restore_ab compares compiled decoders: build the extension first", file=sys.stderr)
        return 2
    new = (fmt.iter_change_set, fmt.chain_changes)
    with tempfile.TemporaryDirectory(prefix="dstl-bench-restore-ab-") as tmp:
        base, floor = build_base(args.base_rev, tmp)
        variants = {
            f"base ({args.base_rev})": (base.iter_change_set, itertools.chain.from_iterable),
            "walk, itertools.chain": (new[0], itertools.chain.from_iterable),
            "walk, chain_changes": new,
        }
        w = ds.make_workload(args.changes)
        data_dir = os.path.join(tmp, "data")
        with open_storage(data_dir, upload_mode="thread") as storage:
            _, handle = ds.write_vectorised(storage, "restore-ab", w, 1)
            reader = storage.create_reader()
            want = digest(reader, handle, variants[f"base ({args.base_rev})"])
            for name, use in variants.items():
                got = digest(reader, handle, use)
                assert got == want, f"{name}: the changes differ from the base's"
            floors = {"floor: the loop, one kept object": 0, "floor: + a bytes per change": 1,
                      "floor: + a StateChange per change": 2}
            ns = {name: [] for name in (*variants, *floors)}
            for _ in range(args.rounds):
                for name, use in variants.items():
                    t0 = time.thread_time_ns()
                    n = read_objects(reader, handle, use)
                    ns[name].append((time.thread_time_ns() - t0) / n)
                    assert n == args.changes
                for name, mode in floors.items():
                    t0 = time.thread_time_ns()
                    n = floor_loop(floor, w.data, args.changes, mode)
                    ns[name].append((time.thread_time_ns() - t0) / n)
        fmt.iter_change_set, fmt.chain_changes = new
    print(f"restore as objects, {args.changes:,} changes x {ds.VALUE} B, medians of {args.rounds} interleaved "
          f"rounds, thread CPU time (load {os.getloadavg()[0]:.1f}):")
    first = next(iter(ns))
    for name, xs in ns.items():
        r = [b / x for b, x in zip(ns[first], xs)]
        print(f"  {name:34s} {statistics.median(xs):5.1f} ns a change ({min(xs):.1f}-{max(xs):.1f})   "
              f"base / this, per round: {statistics.median(r):.2f} ({min(r):.2f}-{max(r):.2f})")
    return 0


if __name__ == "__main__":
    sys.exit(main())
