"""Packaging: the version, the sdist and the wheel, and installs.

* One version, written in `dstl/__init__.py`, is the distribution's (`pyspark-dstl`), `dstl.__version__`
  and what `dstl --version` prints.
* The sdist and the wheel that `python -m build --no-isolation` makes from a clean copy of the
  checkout (as `make dist` does: the wheel from the sdist) install into fresh virtual environments
  (nothing of the checkout on the path) and pass a smoke check: the wheel compiled, the sdist where
  no C compiler exists, built in pip's isolated environment from pyproject.toml's requirements, on
  the twins.
* A folder named `dstl` beside the user's script (e.g. the state base path ./dstl) must not shadow
  the installed package: a real `pip install -e .` into a fresh virtual environment, then scripts run
  in a directory holding such a folder. An import-hook install (which a folder does shadow) fails at
  once with a message naming the folder.
"""
from __future__ import annotations

import ast
import concurrent.futures
import glob
import json
import os
import re
import shutil
import subprocess
import sys
import sysconfig
import tarfile
import textwrap
import zipfile

import pytest

from conftest import expected_implementation, heavy

ROOT = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))
DIST_NAME = "pyspark-dstl"


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


@heavy  # installs and starts Spark
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


# --- the version ---------------------------------------------------------------------------------

def _version_in_source() -> str:
    """The `__version__ = "..."` literal of dstl/__init__.py, read as setuptools reads it (no import)."""
    with open(os.path.join(ROOT, "dstl", "__init__.py")) as f:
        tree = ast.parse(f.read())
    found = [node.value.value for node in tree.body if isinstance(node, ast.Assign)
             and [getattr(t, "id", None) for t in node.targets] == ["__version__"]
             and isinstance(node.value, ast.Constant)]
    assert len(found) == 1, "dstl/__init__.py must assign __version__ one string literal"
    return found[0]


def test_the_version_is_written_once_and_is_pep_440():
    from packaging.version import Version

    import dstl

    version = _version_in_source()
    assert dstl.__version__ == version and str(Version(version)) == version
    try:
        import tomllib
    except ImportError:  # Python < 3.11
        tomllib = pytest.importorskip("tomli")
    with open(os.path.join(ROOT, "pyproject.toml"), "rb") as f:
        project = tomllib.load(f)
    assert project["project"]["name"] == DIST_NAME
    assert "version" not in project["project"] and "version" in project["project"]["dynamic"]
    assert project["tool"]["setuptools"]["dynamic"]["version"] == {"attr": "dstl.__version__"}
    # no second place: no other module of the package writes a version
    others = [path for path in glob.glob(os.path.join(ROOT, "dstl", "**", "*.py"), recursive=True)
              if re.search(r"^__version__\s*=", open(path).read(), re.M)]
    assert others == [os.path.join(ROOT, "dstl", "__init__.py")]
    # the changelog's newest release is not newer than the version (an unreleased one is a .devN of the next)
    with open(os.path.join(ROOT, "CHANGELOG.md")) as f:
        releases = re.findall(r"^## \[(\d[^\]]*)\]", f.read(), re.M)
    assert releases and Version(releases[0]) <= Version(version), releases


def test_dstl_version_prints_the_version_and_the_implementation():
    import dstl

    out = subprocess.run([sys.executable, "-m", "dstl", "--version"], capture_output=True, text=True, timeout=120)
    assert out.returncode == 0, out.stderr
    assert out.stdout == f"dstl {dstl.__version__} (implementation: {expected_implementation()})\n"
    # a command is still required without --version
    out = subprocess.run([sys.executable, "-m", "dstl"], capture_output=True, text=True, timeout=120)
    assert out.returncode == 2 and "COMMAND" in out.stderr


# --- the sdist and the wheel, installed ----------------------------------------------------------

# the variables a developer's shell may carry that would change what is built or which dstl is imported
_DEV_VARS = ("PYTHONPATH", "PYTHONHOME", "VIRTUAL_ENV", "DSTL_PUREPYTHON", "DSTL_BUILD_ONLY",
             "DSTL_REQUIRE_CYTHON", "PIP_NO_BUILD_ISOLATION", "PIP_REQUIRE_VIRTUALENV")


def _user_env(**extra) -> dict:
    env = {k: v for k, v in os.environ.items() if k not in _DEV_VARS}
    env.update(extra)
    return env


def _clean_copy(dest) -> str:
    """The checkout's files as a fresh clone has them (tracked and new, not ignored: no build
    artifacts, no .so, no venv), with the working tree's content."""
    listed = subprocess.run(["git", "ls-files", "-z", "--cached", "--others", "--exclude-standard"],
                            cwd=ROOT, capture_output=True, timeout=120)
    if listed.returncode != 0:  # not a git checkout
        shutil.copytree(ROOT, dest, ignore=shutil.ignore_patterns(
            ".git", ".venv*", "build", "dist", "*.egg-info", "__pycache__", "*.so", "*.c", "*.pyc"))
        return str(dest)
    for rel in listed.stdout.decode().split("\0"):
        if rel and os.path.isfile(os.path.join(ROOT, rel)):
            os.makedirs(os.path.dirname(os.path.join(dest, rel)), exist_ok=True)
            shutil.copy2(os.path.join(ROOT, rel), os.path.join(dest, rel))
    return str(dest)


def _fresh_venv(path) -> str:
    """A new virtual environment with its own pip, and nothing else."""
    subprocess.run([sys.executable, "-m", "venv", str(path)], check=True, timeout=300, env=_user_env())
    return os.path.join(str(path), "bin", "python")


def _pip_install(python, target, env, cwd):
    """`pip install <target>` as a user runs it: dependencies from the configured index, the sdist
    built in an isolated build environment from pyproject.toml's build requirements."""
    out = subprocess.run([python, "-m", "pip", "install", "-v", "--disable-pip-version-check", target],
                         capture_output=True, text=True, timeout=1500, env=env, cwd=cwd)
    assert out.returncode == 0, out.stdout[-6000:] + out.stderr[-6000:]
    return out.stdout + out.stderr


_SMOKE = """
    import glob, importlib.metadata, json, os, sys, tempfile
    import numpy as np
    import dstl
    from dstl import KeyGroupRange

    base = tempfile.mkdtemp()
    with dstl.open_storage(base) as storage:   # the default upload mode: the host's upload service
        with storage.create_writer("op", KeyGroupRange(0, 127)) as w:
            w.append_meta(b"schema")
            w.append(7, b"seven")
            w.append_many(np.array([1, 2], dtype=np.int32), b"onetwo", np.array([0, 3, 6], dtype=np.int64))
            handle = w.persist(w.initial_sequence_number(), checkpoint_id=1).result(timeout=120)\
                .job_manager_owned_snapshot
        changes = [[c.key_group, c.data.decode()] for c in storage.create_reader().get_changes(handle)]
    print(json.dumps({"file": dstl.__file__, "prefix": sys.prefix, "path": sys.path,
                      "version": dstl.__version__, "dist": importlib.metadata.version("pyspark-dstl"),
                      "implementation": dstl.IMPLEMENTATION, "changes": changes,
                      "files": glob.glob(os.path.join(base, "*", "dstl", "*"))}))
    """


def _smoke(python, implementation, workdir, version):
    """Import, a storage round trip through the upload service, the CLI, the implementation."""
    from service_util import stop_services_under

    runtime = os.path.join("/tmp", f"dqp{os.getpid()}-{os.path.basename(os.path.dirname(os.path.dirname(python)))}")
    os.makedirs(runtime, exist_ok=True)
    env = _user_env(DSTL_RUNTIME_DIR=runtime, DSTL_SERVICE_LINGER_MS="300")
    try:
        # -I: no PYTHONPATH, no user site, no script directory; only the venv's own packages
        out = subprocess.run([python, "-I", "-c", textwrap.dedent(_SMOKE)], capture_output=True, text=True,
                             timeout=300, env=env, cwd=workdir)
    finally:
        stop_services_under(runtime)
        shutil.rmtree(runtime, ignore_errors=True)
    assert out.returncode == 0, out.stdout + out.stderr[-4000:]
    got = json.loads(out.stdout.strip().splitlines()[-1])
    venv = os.path.dirname(os.path.dirname(python))
    assert got["prefix"] == venv and got["file"].startswith(os.path.join(venv, "lib")), got
    assert not any(p.startswith(ROOT) for p in got["path"]), got["path"]
    assert got["version"] == got["dist"] == version
    assert got["implementation"] == implementation
    assert got["changes"] == [[-1, "schema"], [1, "one"], [2, "two"], [7, "seven"]]
    assert len(got["files"]) == 1

    dstl_cmd = os.path.join(venv, "bin", "dstl")
    out = subprocess.run([dstl_cmd, "--version"], capture_output=True, text=True, timeout=120, env=env, cwd=workdir)
    assert out.returncode == 0 and out.stdout == f"dstl {version} (implementation: {implementation})\n", out
    out = subprocess.run([dstl_cmd, "inspect", got["files"][0]], capture_output=True, text=True, timeout=120,
                         env=env, cwd=workdir)
    assert out.returncode == 0, out.stderr
    assert "change sets: 1 (4 changes, 17 payload bytes)" in out.stdout, out.stdout


def _kernels():
    from dstl._impl import MODULES

    return MODULES


@heavy  # one build (sdist, then the wheel from it; one compile), two fresh environments
@pytest.mark.timeout(2400)
def test_sdist_and_wheel_from_a_clean_copy_install_in_fresh_environments(tmp_path):
    pytest.importorskip("build", reason="the test extra installs `build`")
    import time

    t0 = time.monotonic()
    phases = []
    version = _version_in_source()
    src = _clean_copy(tmp_path / "src")
    dist = tmp_path / "dist"
    # what a release runs (`make dist`): the sdist, then the wheel built from that sdist, with this
    # environment's build requirements (--no-isolation; `build` checks they satisfy pyproject.toml's).
    # The isolated build from pyproject.toml's requirements is what `pip install <sdist>` does below.
    out = subprocess.run([sys.executable, "-m", "build", "--no-isolation", "--outdir", str(dist), src],
                         capture_output=True, text=True, timeout=1500,
                         env=_user_env(DSTL_REQUIRE_CYTHON="1"), cwd=str(tmp_path))
    assert out.returncode == 0, out.stdout[-6000:] + out.stderr[-6000:]
    phases.append(("build", time.monotonic() - t0))
    stem = f"pyspark_dstl-{version}"
    (sdist,) = glob.glob(str(dist / f"{stem}.tar.gz"))
    (wheel,) = glob.glob(str(dist / f"{stem}-*.whl"))

    with tarfile.open(sdist) as tar:
        names = {n.split("/", 1)[1] for n in tar.getnames() if "/" in n}
    for name in _kernels():  # the sources and the generated C (a build without Cython still compiles)
        assert {f"dstl/_fast/{name}.pyx", f"dstl/_fast/{name}.c", f"dstl/_fast/{name}_py.py"} <= names
    assert {"pyproject.toml", "setup.py", "README.md", "CHANGELOG.md", "dstl/py.typed"} <= names
    assert not [n for n in names if n.endswith((".so", ".pyc")) or n.startswith("tests/")], names

    with zipfile.ZipFile(wheel) as whl:
        names = set(whl.namelist())
        entry_points = whl.read(f"{stem}.dist-info/entry_points.txt").decode()
        metadata = whl.read(f"{stem}.dist-info/METADATA").decode()
    compiled = {n.split("/")[-1].split(".")[0] for n in names if n.startswith("dstl/_fast/") and n.endswith(".so")}
    assert compiled == set(_kernels()), names
    assert "dstl = dstl.cli:main" in entry_points
    assert f"Name: {DIST_NAME}\nVersion: {version}\n" in metadata
    assert not [n for n in names if n.startswith("tests/")]

    work = tmp_path / "work"  # an empty working directory: nothing to import from
    work.mkdir()

    # the sdist where no C compiler exists: CC fails, and the PATH holds no compiler either. Its
    # environment is made beside the wheel's (two installs that wait on pip's downloads and builds)
    no_cc = tmp_path / "no-cc-bin"
    no_cc.mkdir()
    env = _user_env(CC="false", CXX="false", PATH=str(no_cc))
    assert shutil.which("gcc", path=env["PATH"]) is None and shutil.which("cc", path=env["PATH"]) is None

    def sdist_install():
        python = _fresh_venv(tmp_path / "sdist-env")
        return python, _pip_install(python, sdist, env, str(work))

    with concurrent.futures.ThreadPoolExecutor(1) as pool:
        sdist_env = pool.submit(sdist_install)
        # the wheel: compiled
        python = _fresh_venv(tmp_path / "wheel-env")
        _pip_install(python, wheel, _user_env(), str(work))
        _smoke(python, "cython", str(work), version)
        phases.append(("wheel install", time.monotonic() - t0))
        python, log = sdist_env.result()
    assert "Installing build dependencies" in log, log[-6000:]  # isolated: pyproject.toml's requirements
    assert "installing without the compiled modules" in log, log[-6000:]
    _smoke(python, "python", str(work), version)
    phases.append(("sdist install", time.monotonic() - t0))
    sys.stderr.write("\npackaging: " + ", ".join(f"{what} done at {t:.0f} s" for what, t in phases) + "\n")
