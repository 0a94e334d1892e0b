"""A folder named `dstl` beside the user's script (e.g. the state base path ./dstl) must not shadow
the installed package: a real `pip install -e .` into a fresh virtual environment, then scripts run
in a directory holding such a folder. An import-hook install (which a folder does shadow) fails at
once with a message naming the folder.
"""
from __future__ import annotations

import os
import shutil
import subprocess
import sys
import sysconfig
import textwrap

import pytest

from conftest import expected_implementation

ROOT = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))


def _run(python, script, cwd, env=None, timeout=300):
    return subprocess.run([python, "-c", textwrap.dedent(script)], cwd=cwd, capture_output=True, text=True,
                          timeout=timeout, env=dict(os.environ, **(env or {})))


@pytest.fixture
def user_dir(tmp_path):
    """A user's working directory with a `dstl` folder in it (what a base path ./dstl leaves)."""
    d = tmp_path / "work"
    (d / "dstl" / "checkpoints").mkdir(parents=True)
    (d / "dstl" / "notes.txt").write_text("not a package")
    return d


@pytest.mark.skipif(expected_implementation() == "python", reason="installs and starts Spark: runs once")
def test_editable_install_beats_a_dstl_folder_and_base_path_dstl_works(tmp_path, user_dir):
    # a copy of the project (the install writes build files into it), installed the way `make
    # install` does, into a venv that sees this interpreter's dependencies but not its dstl
    src = tmp_path / "src"
    shutil.copytree(ROOT, src, ignore=shutil.ignore_patterns(".git", ".venv", "build", "*.egg-info", "__pycache__",
                                                             "tests", "bench", "docs", "demo-run", "dist"))
    venv = tmp_path / "venv"
    subprocess.run([sys.executable, "-m", "venv", "--without-pip", str(venv)], check=True, timeout=120)
    py = str(venv / "bin" / "python")
    site = subprocess.run([py, "-c", "import sysconfig; print(sysconfig.get_paths()['purelib'])"],
                          capture_output=True, text=True, check=True).stdout.strip()
    with open(os.path.join(site, "deps.pth"), "w") as f:
        f.write(sysconfig.get_paths()["purelib"] + "\n")
    env = dict(os.environ, DSTL_BUILD_ONLY="none", PYTHONPATH="")  # the compiled modules are in the copy
    pip = subprocess.run([sys.executable, "-m", "pip", "--python", py, "install", "-q", "--no-deps",
                          "--no-build-isolation", "-e", str(src)], env=env, capture_output=True, text=True,
                         timeout=600)
    assert pip.returncode == 0, pip.stdout + pip.stderr

    out = _run(py, f"""
        import dstl
        assert dstl.__file__ == {str(src / "dstl" / "__init__.py")!r}, dstl.__file__
        import pandas as pd
        from pyspark.sql import SparkSession
        from dstl.spark import StatefulStream

        spark = (SparkSession.builder.master("local[1]").config("spark.ui.enabled", "false")
                 .config("spark.driver.host", "127.0.0.1").config("spark.driver.bindAddress", "127.0.0.1")
                 .getOrCreate())

        def count(rows, state):
            n = state.value_state("n")
            per = rows.groupby("user").size()
            total = [a + b for a, b in zip(n.get_many(per.index, 0), per.tolist())]
            n.update_many(per.index, total)
            return pd.DataFrame({{"user": per.index, "n": total}})

        stream = StatefulStream("./dstl", count, "user string, n long", key="user", parallelism=1)
        for b, users in enumerate((["a", "b", "a"], ["a", "c"])):
            stream(spark.createDataFrame(pd.DataFrame({{"user": users}})), b)
        stream.close()
        out = pd.read_parquet("dstl/output").sort_values(["user", "n"])
        print(sorted(zip(out["user"], out["n"])))
        spark.stop()
        """, str(user_dir), env={"PYTHONPATH": "", "PYSPARK_PYTHON": py, "SPARK_LOCAL_IP": "127.0.0.1"})
    assert out.returncode == 0, out.stdout + out.stderr[-3000:]
    assert out.stdout.strip().splitlines()[-1] == "[('a', 2), ('a', 3), ('b', 1), ('c', 1)]"


def test_import_hook_install_shadowed_by_a_folder_fails_naming_it(user_dir):
    """An install found by a finder after Python's path search (how setuptools' default editable
    install worked for this flat layout): `import dstl` yields the folder; the first dstl module
    imported through it refuses with the folder's path."""
    # -S: no site-packages and no installed dstl, only the folder and the hook below
    out = subprocess.run([sys.executable, "-S", "-c", textwrap.dedent(f"""
        import importlib.machinery, os, sys

        class Hook:  # what an import-hook editable install adds: dstl* found under the checkout
            @staticmethod
            def find_spec(name, path=None, target=None):
                if name == "dstl" or name.startswith("dstl."):
                    where = os.path.join({ROOT!r}, *name.split(".")[:-1])
                    return importlib.machinery.PathFinder.find_spec(name, [where])
                return None

        sys.meta_path.append(Hook)
        import dstl
        assert dstl.__file__ is None, dstl.__file__   # the folder won: an empty namespace package
        try:
            from dstl.spark import StatefulStream
        except ImportError as e:
            print(e)
        else:
            raise SystemExit("no error")
        """)], cwd=str(user_dir), capture_output=True, text=True, timeout=120, env=dict(os.environ, PYTHONPATH=""))
    assert out.returncode == 0, out.stdout + out.stderr[-3000:]
    assert str(user_dir / "dstl") in out.stdout and "namespace package" in out.stdout
