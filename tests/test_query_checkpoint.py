"""rewind_query_checkpoint on a Structured Streaming checkpoint layout (offsets/, commits/, a file
source's sources/0/ with Hadoop's .crc files and a compacted entry): what goes, what stays, and the
errors. The real query round trip is in tests/test_stream_checkpoints.py."""
from __future__ import annotations

import json
import os

import pytest

from dstl.spark.query_checkpoint import rewind_query_checkpoint


def _write(path, text):
    os.makedirs(os.path.dirname(path), exist_ok=True)
    with open(path, "w") as f:
        f.write(text)


def _layout(root, batches=5, compact_at=None):
    """Batch b read file-source log entry b + 1 (entry 0: an empty first listing); Kafka-like source 1."""
    for b in range(batches):
        offsets = [json.dumps({"logOffset": b + 1}), json.dumps({"topic": {"0": 10 * b}})]
        _write(f"{root}/offsets/{b}", "v1\n{\"batchWatermarkMs\":0}\n" + "\n".join(offsets) + "\n")
        _write(f"{root}/offsets/.{b}.crc", "x")
        _write(f"{root}/commits/{b}", "v1\n{}\n")
    for n in range(batches + 1):
        name = f"{n}.compact" if n == compact_at else str(n)
        _write(f"{root}/sources/0/{name}", "v1\n{\"path\":\"f\"}\n")
    _write(f"{root}/sources/1/0", "v1\n{}\n")


def _names(d):
    return sorted(os.listdir(d))


def test_rewind_drops_later_batches_and_file_source_entries(tmp_path):
    root = str(tmp_path / "ckpt")
    _layout(root)
    removed = rewind_query_checkpoint(root, 2)
    assert removed == {"commits": 2, "offsets": 2, "sources/0": 2}
    assert _names(root + "/offsets") == [".0.crc", ".1.crc", ".2.crc", "0", "1", "2"]
    assert _names(root + "/commits") == ["0", "1", "2"]
    assert _names(root + "/sources/0") == ["0", "1", "2", "3"]     # up to batch 2's logOffset 3
    assert _names(root + "/sources/1") == ["0"]                    # not a file source: untouched
    assert rewind_query_checkpoint(root, 2) == {"commits": 0, "offsets": 0, "sources/0": 0}  # idempotent
    assert rewind_query_checkpoint(root, -1)["offsets"] == 3       # back to the very start
    assert os.listdir(root + "/offsets") == [] and _names(root + "/sources/1") == []


def test_rewind_errors_name_the_problem(tmp_path):
    root = str(tmp_path / "ckpt")
    _layout(root, compact_at=4)
    with pytest.raises(ValueError, match="compacted its log at entry 4"):
        rewind_query_checkpoint(root, 1)
    assert len(os.listdir(root + "/offsets")) == 10                 # nothing removed
    with pytest.raises(ValueError, match=r"no offsets of batch 7 \(batches 0..4\)"):
        rewind_query_checkpoint(root, 7)
    with pytest.raises(ValueError, match="not a Structured Streaming checkpoint location"):
        rewind_query_checkpoint(str(tmp_path / "nothing"), 0)
    with pytest.raises(ValueError, match="batch_id must be an int >= -1"):
        rewind_query_checkpoint(root, -2)
