"""Spark's event log as data: which tasks ran in a batch's stage, where and when.

A driver started with `EVENTLOG_CONF` writes one uncompressed JSON-lines file per application into
the directory; `batch_stages` finds, for each dstl batch, the stage that ran its subtasks (the
result stage of the last job named ``dstl <operator> batch N`` by dstl.spark.session.collect) and
the successful task of each partition in it.

How a job is named, in its SparkListenerJobStart "Properties": on a classic session by its
description, ``spark.job.description``; under Spark Connect by a tag. The Connect server keeps
``spark.job.description`` for its own text (the session id and the plan) and lists the job's tags,
comma-joined, in ``spark.job.tags``: its operation's tag, Spark SQL's session and execution-root
tags, and each tag the client added as ``SparkConnect_SessionTag_User_<user>_Session_<session
id>_Tag_<tag>``.
"""
from __future__ import annotations

import glob
import json
import os
import re
from dataclasses import dataclass
from typing import Dict, List, Optional


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


#: the name dstl gives a batch's jobs
_BATCH_NAME = re.compile(r"dstl \S+ batch (\d+)")
#: the prefix a Connect server puts before a tag its client added
_CONNECT_TAG = re.compile(r"SparkConnect_SessionTag_User_.*?_Session_[^_]+_Tag_(.*)")


def job_tags(props: dict) -> List[str]:
    """The tags a job's client set, Connect's session prefix taken off (the server's own tags, which
    have no such prefix, as they are)."""
    out = []
    for tag in (props.get("spark.job.tags") or "").split(","):
        m = _CONNECT_TAG.fullmatch(tag)
        if tag:
            out.append(m.group(1) if m else tag)
    return out


def batch_of(props: dict, scope: Optional[str] = None) -> Optional[int]:
    """The dstl batch a job ran (from its properties), None for another job. With `scope`, only a
    job that also carries the tag `scope` counts (several streams in one application)."""
    tags = job_tags(props)
    if scope is not None and scope not in tags:
        return None
    for name in [props.get("spark.job.description") or ""] + tags:
        m = _BATCH_NAME.fullmatch(name)
        if m:
            return int(m.group(1))
    return None


def _events(directory: str):
    files = [p for p in glob.glob(os.path.join(directory, "**"), recursive=True) if os.path.isfile(p)]
    if not files:
        raise AssertionError(f"no event log under {directory}")
    for path in sorted(files):
        with open(path) as f:
            for line in f:
                if line.strip():
                    yield json.loads(line)


def batch_stages(directory: str, scope: Optional[str] = None) -> Dict[int, List[TaskRun]]:
    """{batch: every task run (all attempts) of the stage that ran the batch's subtasks}; `scope`:
    see `batch_of`."""
    stage_of: Dict[int, int] = {}
    tasks: Dict[int, List[TaskRun]] = {}
    for e in _events(directory):
        kind = e["Event"]
        if kind == "SparkListenerJobStart":
            batch = batch_of(e.get("Properties") or {}, scope)
            if batch is not None and e.get("Stage IDs"):
                stage_of[batch] = max(e["Stage IDs"])  # the later job (AQE) wins
        elif kind == "SparkListenerTaskEnd":
            ti = e["Task Info"]
            tasks.setdefault(e["Stage ID"], []).append(TaskRun(
                int(ti.get("Partition ID", ti["Index"])), int(ti["Attempt"]), str(ti["Executor ID"]),
                int(ti["Launch Time"]), int(ti["Finish Time"]),
                e["Task End Reason"]["Reason"] == "Success", str(ti.get("Locality", ""))))
    return {b: tasks.get(s, []) for b, s in sorted(stage_of.items())}


def batch_plan_nodes(directory: str, scope: Optional[str] = None) -> Dict[int, List[str]]:
    """{batch: the node names of every physical plan Spark reported for the SQL execution that ran
    the batch's stage (the initial plan and each adaptive re-plan, the final one included)}; `scope`:
    see `batch_of`. Spark reports the plans in SQL execution events, under Spark Connect too."""
    execution_of: Dict[int, int] = {}
    plans: Dict[int, List[dict]] = {}
    for e in _events(directory):
        kind = e["Event"]
        if kind == "SparkListenerJobStart":
            props = e.get("Properties") or {}
            batch = batch_of(props, scope)
            if batch is not None and props.get("spark.sql.execution.id") is not None:
                execution_of[batch] = int(props["spark.sql.execution.id"])
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
