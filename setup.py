"""Builds the Cython hot path in dstl/_fast (each `<name>.pyx` has its pure-Python twin `<name>_py.py` beside it).

The extensions are optional: where they cannot be built (no C compiler, a failing compile), the
install goes on without them and dstl runs on the twins (`dstl.IMPLEMENTATION == "python"`), with a
warning in the build log. `DSTL_REQUIRE_CYTHON=1` turns that fallback into an error (`make build`
and `make dist` set it: a developer's or an executor's build must be compiled).
"""
import glob
import os
import sys

from setuptools import Extension, setup
from setuptools.command.build_ext import build_ext
from setuptools.errors import CCompilerError, ExecError, PlatformError

REQUIRED = os.environ.get("DSTL_REQUIRE_CYTHON", "") not in ("", "0")


def _warn(message: str) -> None:
    if REQUIRED:
        raise SystemExit(f"dstl: {message} (DSTL_REQUIRE_CYTHON is set)")
    bar = "*" * 78
    print(f"\n{bar}\ndstl: {message}\ndstl: installing without the compiled modules: dstl runs on its "
          f"pure-Python twins (slower, same results)\n{bar}\n", file=sys.stderr)


def _modules():
    only = os.environ.get("DSTL_BUILD_ONLY")  # e.g. _buffer,_decode: a subset while one module is edited
    for path in sorted(glob.glob("dstl/_fast/*.pyx")):
        name = os.path.splitext(os.path.basename(path))[0]
        if not only or name in only.split(","):
            yield name, path


def _extensions():
    try:
        import numpy
    except ImportError:  # only without build isolation: pyproject.toml's build requirements include it
        _warn("numpy is not installed in the build environment")
        return []
    try:
        from Cython.Build import cythonize
    except ImportError:
        cythonize = None
    exts = []
    for name, pyx in _modules():
        source = pyx
        if cythonize is None:  # an sdist carries the generated C next to each .pyx
            source = pyx[:-4] + ".c"
            if not os.path.exists(source):
                _warn("Cython is not installed and there is no generated C for dstl._fast." + name)
                return []
        exts.append(Extension(
            "dstl._fast." + name, [source],
            include_dirs=[numpy.get_include()],
            define_macros=[("NPY_NO_DEPRECATED_API", "NPY_1_7_API_VERSION")],
            extra_compile_args=["-O3"],
        ))
    if cythonize is None:
        return exts
    return cythonize(exts, language_level=3,
                     compiler_directives={"boundscheck": False, "wraparound": False, "cdivision": True})


class OptionalBuildExt(build_ext):
    """build_ext that falls back to the twins when a module cannot be compiled.

    `dstl._impl` uses the compiled modules only when every one of them imports, so the first failure
    ends the build, and the modules already built are removed: the install then holds none.
    """

    def run(self):
        try:
            super().run()
        except (PlatformError, CCompilerError, ExecError) as exc:  # e.g. no compiler configured at all
            self.extensions = []
            _warn(f"cannot build the Cython modules: {exc}")

    def build_extensions(self):
        self.check_extensions_list(self.extensions)
        built = []
        for ext in self.extensions:
            try:
                self.build_extension(ext)
            except (CCompilerError, ExecError, PlatformError) as exc:
                for done in built:
                    path = self.get_ext_fullpath(done.name)
                    if os.path.exists(path):
                        os.remove(path)
                # later steps (the in-place copy, the wheel's file list) then see no extensions
                self.extensions = []
                _warn(f"cannot compile {ext.name}: {exc}")
                return
            built.append(ext)


setup(ext_modules=_extensions(), cmdclass={"build_ext": OptionalBuildExt})
