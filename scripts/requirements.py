"""The requirements of the installed dstl distribution and of some of its extras, one a line.

  python scripts/requirements.py test --override "pandas>=2,<3" > reqs.txt

For a venv that runs this checkout's tests without installing the checkout into it (`make
test-pandas2`: the checkout goes on its path instead, so the extension `make build` compiled is the
one tested, and no second build writes into the tree). Run it with a Python where the checkout is
installed (`.venv`, whose install `make` refreshes whenever pyproject.toml changes). An `--override`
replaces the requirement of the same name.
"""
from __future__ import annotations

import argparse
import re
import sys
from importlib.metadata import PackageNotFoundError, requires
from typing import List, Optional

DIST = "pyspark-dstl"
_NAME = re.compile(r"^\s*([A-Za-z0-9][A-Za-z0-9._-]*)")
_EXTRA = re.compile(r"""extra\s*==\s*["']([^"']+)["']""")


def _name(requirement: str) -> str:
    m = _NAME.match(requirement)
    if not m:
        raise ValueError(f"not a requirement: {requirement!r}")
    return re.sub(r"[-_.]+", "-", m.group(1)).lower()


def requirements(extras: List[str], overrides: List[str], dist: str = DIST) -> List[str]:
    """The distribution's own requirements and those of `extras`, without their extra markers, each
    name once; an override takes the place of its name's requirement."""
    try:
        declared = requires(dist) or []
    except PackageNotFoundError:
        raise SystemExit(f"{dist} is not installed in {sys.executable}: run `make install` first") from None
    out = {}
    for line in declared:
        spec, _, marker = line.partition(";")
        m = _EXTRA.search(marker)
        if m and m.group(1) not in extras:
            continue
        rest = _EXTRA.sub("", marker).strip()
        rest = re.sub(r"^(and\s+)|(\s+and)$", "", rest).strip()
        out.setdefault(_name(spec), spec.strip() + (f"; {rest}" if rest else ""))
    for spec in overrides:
        if _name(spec) not in out:
            raise SystemExit(f"--override {spec!r}: {dist} does not require {_name(spec)!r}")
        out[_name(spec)] = spec
    return sorted(out.values(), key=_name)


def main(argv: Optional[List[str]] = None) -> int:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("extras", nargs="*", help="extras to include (e.g. test)")
    parser.add_argument("--override", action="append", default=[], metavar="REQ",
                        help="a requirement that replaces the one of the same name")
    args = parser.parse_args(argv)
    print("\n".join(requirements(args.extras, args.override)))
    return 0


if __name__ == "__main__":
    sys.exit(main())
