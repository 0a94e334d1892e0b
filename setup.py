"""Builds the Cython hot path in dstl/_fast (each `<name>.pyx` has its pure-Python twin `<name>_py.py` beside it)."""
import glob
import os

import numpy
from Cython.Build import cythonize
from setuptools import Extension, setup

extensions = [
    Extension(
        "dstl._fast." + os.path.splitext(os.path.basename(path))[0],
        [path],
        include_dirs=[numpy.get_include()],
        define_macros=[("NPY_NO_DEPRECATED_API", "NPY_1_7_API_VERSION")],
        extra_compile_args=["-O3"],
    )
    for path in sorted(glob.glob("dstl/_fast/*.pyx"))
    # DSTL_BUILD_ONLY=_buffer,_decode builds a subset (handy while one module is being edited)
    if not os.environ.get("DSTL_BUILD_ONLY")
    or os.path.splitext(os.path.basename(path))[0] in os.environ["DSTL_BUILD_ONLY"].split(",")
]

setup(
    ext_modules=cythonize(
        extensions,
        language_level=3,
        compiler_directives={"boundscheck": False, "wraparound": False, "cdivision": True},
    ),
)
