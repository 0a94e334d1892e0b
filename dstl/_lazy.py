"""Lazy re-exports for package facades: names resolve on first use, so importing a package is cheap."""
from __future__ import annotations

import importlib
import os
import sys
from typing import Any, Callable, Dict, Iterable


def refuse_shadowed_package() -> None:
    """Fail at once, naming the folder, when `dstl` itself was imported as an empty namespace package.

    That happens when a folder named `dstl` (without `__init__.py`, e.g. a state base path ./dstl)
    sits in a directory searched before an install that Python finds only after its path search
    (an import-hook editable install): `import dstl` then yields the folder, while `dstl.spark`
    still resolves to this package. A path-based install (`pip install -e .` of this project, or a
    regular install) is never shadowed that way.
    """
    pkg = sys.modules.get("dstl")
    if pkg is not None and getattr(pkg, "__file__", None) is None:
        folders = ", ".join(str(p) for p in getattr(pkg, "__path__", []))
        raise ImportError(
            f"'dstl' was imported from the folder {folders} (a namespace package without __init__.py), "
            f"not from the dstl package at {os.path.dirname(os.path.abspath(__file__))}: rename or move "
            f"that folder, or reinstall dstl (`pip install -e .` of this version installs by path, which "
            f"a folder cannot shadow)")


refuse_shadowed_package()


def lazy_getattr(package: str, exports: Dict[str, str], namespace: Dict[str, Any],
                 subpackages: Iterable[str] = ()) -> Callable[[str], Any]:
    """A module-level `__getattr__` that imports `exports[name]` and caches the value in `namespace`;
    a name in `subpackages` imports `package.name` itself (so `dstl.format.decode_file` works after
    a plain `import dstl`)."""
    subs = frozenset(subpackages)

    def __getattr__(name: str) -> Any:
        if name in subs:
            value = importlib.import_module(f"{package}.{name}")
        else:
            module = exports.get(name)
            if module is None:
                raise AttributeError(f"module {package!r} has no attribute {name!r}")
            value = getattr(importlib.import_module(module), name)
        namespace[name] = value
        return value

    return __getattr__
