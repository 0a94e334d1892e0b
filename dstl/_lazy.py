"""Lazy re-exports for package facades: names resolve on first use, so importing a package is cheap."""
from __future__ import annotations

import importlib
from typing import Any, Callable, Dict, Iterable


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
