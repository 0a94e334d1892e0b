"""The Flink side-by-side benchmark's runner (bench/flink/run.py), without a JDK and without Flink:
it must refuse in one line with exit code 2 before downloading anything, and its figures must be
the ratios it claims. The benchmark itself never runs in the test suite (`make bench-flink`)."""
from __future__ import annotations

import argparse
import importlib
import os
import stat
import subprocess
import sys

import pytest

REPO = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))
FLINK_BENCH = os.path.join(REPO, "bench", "flink")
RUNNER = os.path.join(FLINK_BENCH, "run.py")


def _env_without_jdk(tmp_path, **extra):
    env = {k: v for k, v in os.environ.items() if k != "JAVA_HOME"}
    empty_bin = tmp_path / "bin"
    empty_bin.mkdir(exist_ok=True)
    env["PATH"] = str(empty_bin)  # no java, no javac (the runner is started by absolute path)
    env["DSTL_BENCH_CACHE"] = str(tmp_path / "cache")
    env.update(extra)
    return env


def _run(env):
    return subprocess.run([sys.executable, RUNNER, "--changes", "10", "--rounds", "1", "--out-dir",
                           str(env["DSTL_BENCH_CACHE"]) + "-results"], env=env, capture_output=True,
                          text=True, timeout=120, cwd=REPO)


def _fake_executable(path):
    path.write_text("#!/bin/sh\nexit 0\n")
    path.chmod(path.stat().st_mode | stat.S_IXUSR)


def _assert_refused(proc, tmp_path):
    assert proc.returncode == 2, (proc.returncode, proc.stdout, proc.stderr)
    lines = proc.stderr.splitlines()
    assert len(lines) == 1, proc.stderr
    assert "no JDK found" in lines[0] and "javac" in lines[0]
    assert proc.stdout == ""
    # nothing fetched, compiled or written
    assert not (tmp_path / "cache").exists()
    assert not (tmp_path / "cache-results").exists()


def test_no_jdk_on_path_exits_2_with_one_line(tmp_path):
    _assert_refused(_run(_env_without_jdk(tmp_path)), tmp_path)


def test_java_home_without_javac_is_no_jdk(tmp_path):
    home = tmp_path / "jre"
    (home / "bin").mkdir(parents=True)
    _fake_executable(home / "bin" / "java")  # a JRE: java but no javac
    _assert_refused(_run(_env_without_jdk(tmp_path, JAVA_HOME=str(home))), tmp_path)


@pytest.fixture
def bench_modules(monkeypatch):
    monkeypatch.syspath_prepend(FLINK_BENCH)
    for name in ("fetch", "run"):
        sys.modules.pop(name, None)
    yield importlib.import_module("fetch"), importlib.import_module("run")
    for name in ("fetch", "run"):
        sys.modules.pop(name, None)


def test_find_jdk_prefers_java_home_then_path(tmp_path, monkeypatch, bench_modules):
    fetch, _ = bench_modules
    home, on_path = tmp_path / "jdk", tmp_path / "path"
    for d in (home / "bin", on_path):
        d.mkdir(parents=True)
        for tool in ("java", "javac"):
            _fake_executable(d / tool)
    monkeypatch.setenv("PATH", str(on_path))
    monkeypatch.setenv("JAVA_HOME", str(home))
    assert fetch.find_jdk() == fetch.Jdk(str(home / "bin" / "java"), str(home / "bin" / "javac"))
    monkeypatch.delenv("JAVA_HOME")
    assert fetch.find_jdk() == fetch.Jdk(str(on_path / "java"), str(on_path / "javac"))
    (on_path / "javac").unlink()
    assert fetch.find_jdk() is None


def test_cache_dir_follows_the_environment(tmp_path, monkeypatch, bench_modules):
    fetch, _ = bench_modules
    monkeypatch.setenv("DSTL_BENCH_CACHE", str(tmp_path))
    assert fetch.cache_dir() == os.path.join(str(tmp_path), "flink-2.3.0")
    assert not fetch.cache_dir().startswith(REPO)


def test_summary_ratios_are_same_round_throughput_ratios(bench_modules, capsys):
    _, run = bench_modules
    seconds = {key: [1.0, 2.0, 4.0] for key, *_ in run.PATHS}
    seconds["flink_write"] = [2.0, 2.0, 2.0]
    seconds["dstl_write_per_record"] = [4.0, 1.0, 2.0]  # 0.5x, 2x, 1x of Flink in rounds 1..3
    seconds["flink_read"] = [1.0, 1.0, 1.0]
    args = argparse.Namespace(changes=1_000_000, rounds=3)
    result = run.summarise(args, seconds, {}, "cython", "17")
    per_record = result["paths"]["dstl_write_per_record"]
    assert per_record["ratio_vs_flink"]["per_round"] == [0.5, 2.0, 1.0]
    assert per_record["ratio_vs_flink"]["median"] == 1.0
    assert per_record["median_mb_per_s"] == pytest.approx(50.0)  # 100 MB in a median 2 s
    assert result["paths"]["dstl_read_objects"]["ratio_vs_flink"]["per_round"] == [1.0, 0.5, 0.25]
    assert "ratio_vs_flink" not in result["paths"]["flink_write"]
    run.print_table(result)
    out = capsys.readouterr().out
    assert " 1.00x (0.50-2.00)" in out and "baseline" in out
