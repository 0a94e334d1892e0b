"""Spark's event log as data: which tasks ran in a batch's stage, where and when.

A driver started with `EVENTLOG_CONF` writes one uncompressed JSON-lines file per application into
the directory; `batch_stages` finds, for each dstl batch, the stage that ran its subtasks (the
result stage of the last job whose description is ``dstl <operator> batch N``, set by
dstl.spark.session.collect) and the successful task of each partition in it.
"""
from __future__ import annotations

import glob
import json
import os
import re
from dataclasses import dataclass
from typing import Dict, List


def eventlog_conf(directory: str) -> Dict[str, str]:
    """Spark settings for a plain, single-file event log in `directory`."""
    return {"spark.eventLog.enabled": "true", "spark.eventLog.dir": directory,
            "spark.eventLog.compress": "false", "spark.eventLog.rolling.enabled": "false"}


@dataclass
class TaskRun:
    partition: int
    attempt: int
    executor: str
    launch_ms: int
    finish_ms: int
    success: bool
    #: Spark's locality level for the launch: PROCESS_LOCAL, NODE_LOCAL, ANY, ...
    locality: str = ""


def _events(directory: str):
    files = [p for p in glob.glob(os.path.join(directory, "**"), recursive=True) if os.path.isfile(p)]
    if not files:
        raise AssertionError(f"no event log under {directory}")
    for path in sorted(files):
        with open(path) as f:
            for line in f:
                if line.strip():
                    yield json.loads(line)


def batch_stages(directory: str) -> Dict[int, List[TaskRun]]:
    """{batch: every task run (all attempts) of the stage that ran the batch's subtasks}."""
    stage_of: Dict[int, int] = {}
    tasks: Dict[int, List[TaskRun]] = {}
    for e in _events(directory):
        kind = e["Event"]
        if kind == "SparkListenerJobStart":
            desc = (e.get("Properties") or {}).get("spark.job.description") or ""
            m = re.fullmatch(r"dstl \S+ batch (\d+)", desc)
            if m and e.get("Stage IDs"):
                stage_of[int(m.group(1))] = max(e["Stage IDs"])  # the later job (AQE) wins
        elif kind == "SparkListenerTaskEnd":
            ti = e["Task Info"]
            tasks.setdefault(e["Stage ID"], []).append(TaskRun(
                int(ti.get("Partition ID", ti["Index"])), int(ti["Attempt"]), str(ti["Executor ID"]),
                int(ti["Launch Time"]), int(ti["Finish Time"]),
                e["Task End Reason"]["Reason"] == "Success", str(ti.get("Locality", ""))))
    return {b: tasks.get(s, []) for b, s in sorted(stage_of.items())}


def batch_plan_nodes(directory: str) -> Dict[int, List[str]]:
    """{batch: the node names of every physical plan Spark reported for the SQL execution that ran
    the batch's stage (the initial plan and each adaptive re-plan, the final one included)}."""
    execution_of: Dict[int, int] = {}
    plans: Dict[int, List[dict]] = {}
    for e in _events(directory):
        kind = e["Event"]
        if kind == "SparkListenerJobStart":
            props = e.get("Properties") or {}
            m = re.fullmatch(r"dstl \S+ batch (\d+)", props.get("spark.job.description") or "")
            if m and props.get("spark.sql.execution.id") is not None:
                execution_of[int(m.group(1))] = int(props["spark.sql.execution.id"])
        elif kind.endswith(("SparkListenerSQLExecutionStart", "SparkListenerSQLAdaptiveExecutionUpdate")):
            if e.get("sparkPlanInfo") is not None:
                plans.setdefault(int(e["executionId"]), []).append(e["sparkPlanInfo"])

    def names(info: dict) -> List[str]:
        out = [info.get("nodeName", "")]
        for child in info.get("children") or ():
            out += names(child)
        return out

    return {b: [n for info in plans.get(x, []) for n in names(info)] for b, x in sorted(execution_of.items())}


def successful(runs: List[TaskRun]) -> Dict[int, TaskRun]:
    """Partition -> its successful task run."""
    return {r.partition: r for r in runs if r.success}


def overlapping(runs: List[TaskRun]) -> bool:
    """True if two successful tasks of the stage ran at the same time."""
    end = None
    for launch, finish in sorted((r.launch_ms, r.finish_ms) for r in runs if r.success):
        if end is not None and launch < end:
            return True
        end = finish if end is None else max(end, finish)
    return False
