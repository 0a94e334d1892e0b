"""Lazy re-exports for package facades: names resolve on first use, so importing a package is cheap."""
from __future__ import annotations

import importlib
from typing import Any, Callable, Dict


def lazy_getattr(package: str, exports: Dict[str, str], namespace: Dict[str, Any]) -> Callable[[str], Any]:
    """A module-level `__getattr__` that imports `exports[name]` and caches the value in `namespace`."""

    def __getattr__(name: str) -> Any:
        module = exports.get(name)
        if module is None:
            raise AttributeError(f"module {package!r} has no attribute {name!r}")
        value = getattr(importlib.import_module(module), name)
        namespace[name] = value
        return value

    return __getattr__
