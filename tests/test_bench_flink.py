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

from conftest import heavy

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


def _hot_path_rounds(run, n, rounds):
    """Per-round extras as run_rounds collects them (seconds), with known ratios."""
    extra = []
    for i in range(rounds):
        more = {"call_floor": 0.040 * n / 1e6, "append_calls": (0.050 + 0.010 * i) * n / 1e6,
                "state_ns.dict_set": 40.0, "state_ns.dict_get": 30.0,
                "state_ns.value_update": 400.0, "state_ns.value_get": 120.0,
                "phase.pack": 0.010, "phase.body_copy": 0.012, "phase.file_write": 0.024,
                "phase.body_copy_shm": 0.013, "phase.shm_to_file": 0.030, "phase.thread_upload": 0.040,
                "phase.bodies": 17, "plain_write_cpu": 0.025}
        for key in ("dstl_write_vectorised_process", "dstl_write_vectorised_thread", "dstl_write_per_record"):
            more[f"{key}.appends"] = 0.030
            more[f"{key}.tail"] = 0.020
            more[f"{key}.cpu"] = 0.060 + 0.010 * i
        extra.append(more)
    return extra


def test_hot_path_summary_ratios_goals_and_the_unstable_flag(bench_modules, capsys):
    """Floors are same-round throughput ratios; the per-call ratios divide ns by ns of the same round;
    a goal is met or missed on the median; a path whose slowest round took > 2x its fastest is flagged."""
    _, run = bench_modules
    n = 1_000_000
    seconds = {key: [1.0, 1.0, 1.0] for key, *_ in run.PATHS}
    seconds["plain_write"] = [0.5, 0.5, 0.5]
    seconds["dstl_write_vectorised_thread"] = [0.5, 1.0, 0.6]  # 1.0, 0.5, 0.83 of the plain write
    seconds["plain_read"] = [0.2, 0.2, 0.9]  # 4.5x between rounds: flagged
    seconds["dstl_read_arrays"] = [0.1, 0.4, 0.3]  # 2.0, 0.5, 3.0 of the plain read; 4x: flagged
    args = argparse.Namespace(changes=n, rounds=3)
    result = run.summarise(args, seconds, {}, "cython", "17")
    load = {"start": (1.0, 0.5, 0.2), "rounds": [1.1, 1.2, 1.3], "end": (1.4, 0.6, 0.3)}
    run.add_hot_paths(result, _hot_path_rounds(run, n, 3), load)

    thread = result["vs_floor"]["dstl_write_vectorised_thread"]
    assert thread["per_round"] == pytest.approx([1.0, 0.5, 0.5 / 0.6])
    assert thread["median"] == pytest.approx(0.5 / 0.6)
    assert result["vs_floor"]["dstl_read_arrays"]["per_round"] == pytest.approx([2.0, 0.5, 3.0])
    pr = result["per_record"]
    assert pr["call_floor_ns"]["median"] == pytest.approx(40.0)
    assert pr["append_call_ns"]["per_round"] == pytest.approx([50.0, 60.0, 70.0])
    assert pr["append_vs_call_floor"]["per_round"] == pytest.approx([1.25, 1.5, 1.75])
    assert result["keyed_state"]["update_vs_dict"]["median"] == pytest.approx(10.0)
    assert result["keyed_state"]["get_vs_call_floor"]["median"] == pytest.approx(3.0)
    assert result["phases_ms"]["pack"]["median"] == pytest.approx(10.0)
    assert result["phases_ms"]["dstl_write_vectorised_thread.cpu"]["per_round"] == pytest.approx([60.0, 70.0, 80.0])
    assert result["phases_ms"]["plain_write_cpu"]["median"] == pytest.approx(25.0)
    assert result["load"]["loadavg_1m_per_round"] == [1.1, 1.2, 1.3]
    assert result["load"]["rounds_disagree"] is True
    assert set(result["load"]["unstable_paths"]) == {"plain_read", "dstl_read_arrays"}
    goals = {g["goal"]: g for g in result["goals"]}
    assert goals["vectorised write, thread mode / plain write()"]["met"] is True  # 0.83 >= 0.8
    assert goals["vectorised write, process mode / plain write()"]["met"] is False  # 0.5
    assert goals["per-record append call / no-op C call (time, same loop)"]["met"] is False  # 1.5 > 1.3
    assert goals["restore as arrays / plain read()"]["met"] is True  # median 2.0 ...
    assert goals["restore as arrays / plain read()"]["conclusive"] is False  # ... of rounds 0.5 to 3.0
    assert goals["vectorised write, thread mode / plain write()"]["conclusive"] is True  # 0.5 to 1.0

    run.print_table(result)
    out = capsys.readouterr().out
    assert "WARNING: rounds disagree by more than 2x" in out and "MISSED" in out and "inconclusive" in out
    md = run.hot_path_markdown(result)
    assert "rounds disagree by more than 2x" in md and "missed" not in md
    table = run.markdown_table(result)
    assert "| read, dstl: `reader.get_changes_arrays(handle)` | " in table
    assert " | 2.00 (0.50-3.00) |" in table  # the arrays' same-round ratios to the plain read
    assert "| `ValueState.update(k, v)` | 400 (400-400) |" in md
    assert "CPU time of the write" in md


@heavy
def test_phases_of_a_small_write_on_a_real_disk(tmp_path, bench_modules):
    """The phase and floor measurements run on a real directory and storage, and clean up after."""
    bench_modules  # puts bench/flink on sys.path
    import _dstl_side as ds
    import phases as ph
    from dstl import open_storage

    workload = ds.make_workload(120_000)
    meter = ph.Phases(str(tmp_path), workload)
    try:
        got = meter.write_phases()
        assert got["bodies"] == 2  # 12 MB, cut after the 10,000-row call that reaches 5 MiB: 6 MB each
        assert all(got[k] > 0 for k in ("pack", "body_copy", "file_write", "thread_upload", "body_copy_shm",
                                        "shm_to_file"))
        floors = meter.plain_write_read("plain")
        assert floors["plain_write"] > 0 and floors["plain_read"] > 0 and floors["plain_write_cpu"] >= 0
        with open_storage(str(tmp_path / "storage"), upload_mode="thread") as storage:
            calls = meter.append_calls(storage)
            assert calls["append_calls"] > 0 and calls["call_floor"] > 0
            state = meter.keyed_state(storage)
            assert set(state) == {"dict_set", "dict_get", "value_update", "value_get"}
    finally:
        meter.close()
    assert sorted(os.listdir(tmp_path)) == ["storage"]  # the phases' files are gone


class _SlowingDownJit:
    """A stand-in for the Java harness whose calls speed up until call `settle`, then stay put."""

    def __init__(self, settle: int):
        self.settle, self.calls = settle, {"write": 0, "read": 0}

    def call(self, op):
        self.calls[op] += 1
        k = self.calls[op]
        return {"seconds": 0.5 ** min(k, self.settle)}  # twice as fast per call, then steady


class _Noisy:
    def __init__(self, speeds):
        self.speeds, self.calls = speeds, {"write": 0, "read": 0}

    def call(self, op):
        self.calls[op] += 1
        return {"seconds": 1.0 / self.speeds[self.calls[op] - 1]}


def test_flink_is_warmed_until_its_calls_agree(bench_modules):
    _, run = bench_modules
    fake = _SlowingDownJit(settle=12)
    jit = run.warm_flink(fake, 1_000_000, at_least=4)
    # twice as fast per call up to the 12th: the median of the last 4 calls matches the 4 before at the 18th
    assert jit["steady"] and jit["calls"] == 18
    assert jit["write_mb_s"][-3:] == [4096.0] * 3 and len(jit["read_mb_s"]) == 18
    noisy = run.warm_flink(_Noisy([1.0, 1.2, 0.9, 1.1] * 5), 1_000_000, at_least=4)
    assert noisy["steady"] and noisy["calls"] == 8  # +-20% per call, but no longer climbing
    capped = run.warm_flink(_SlowingDownJit(settle=100), 1_000_000, at_least=4, at_most=6)
    assert not capped["steady"] and capped["calls"] == 6
