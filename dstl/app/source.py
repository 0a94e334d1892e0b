"""Event sources for the pipeline: a seeded synthetic stream, or a parquet/CSV file cut into batches.

Events: batch, event_id (global order), ts (int64 µs since the epoch), user_id, item_id,
amount_cents. Batch b of the synthetic stream depends only on (seed, b), so a resumed run sees
exactly the events the crashed one would have seen.
"""
from __future__ import annotations

import os
from dataclasses import dataclass
from typing import Dict, List

import numpy as np

from dstl.app.activity import EVENT_COLUMNS

_EPOCH_2024_US = 1_704_067_200_000_000
_BATCH_SPAN_US = 60_000_000  # one minute of event time per batch


def batch_bounds(total: int, batches: int) -> List[int]:
    """Start offsets of each batch plus the end: sizes differ by at most one."""
    base, extra = divmod(total, batches)
    bounds = [0]
    for b in range(batches):
        bounds.append(bounds[-1] + base + (1 if b < extra else 0))
    return bounds


@dataclass(frozen=True)
class SyntheticSource:
    """Skewed e-commerce-like events: Zipf-distributed users and items, log-normal amounts."""

    events: int
    batches: int
    users: int = 10_000
    items: int = 2_000
    seed: int = 42
    zipf_a: float = 1.2

    def __post_init__(self):
        for name in ("events", "batches", "users", "items"):
            if getattr(self, name) < 1:
                raise ValueError(f"--{name} must be >= 1, got {getattr(self, name)}")
        if self.batches > self.events:
            raise ValueError(f"--batches ({self.batches}) must not exceed --events ({self.events})")

    def params(self) -> Dict[str, object]:
        return {"source": "synthetic", "events": self.events, "batches": self.batches, "users": self.users,
                "items": self.items, "seed": self.seed}

    def _user_ids(self) -> np.ndarray:
        # hot users spread over key groups: rank -> random id
        return np.random.default_rng([self.seed, 0x5EED]).permutation(self.users).astype(np.int64) + 1000

    def batch(self, b: int):
        import pandas as pd

        if not 0 <= b < self.batches:
            raise IndexError(f"batch {b} outside 0..{self.batches - 1}")
        bounds = batch_bounds(self.events, self.batches)
        lo, hi = bounds[b], bounds[b + 1]
        n = hi - lo
        rng = np.random.default_rng([self.seed, b])
        ranks = (rng.zipf(self.zipf_a, n) - 1) % self.users
        users = self._user_ids()[ranks]
        items = ((rng.zipf(1.4, n) - 1) % self.items).astype(np.int64)
        amounts = np.clip(rng.lognormal(7.5, 1.0, n), 1, 10_000_000).astype(np.int64)
        ts = _EPOCH_2024_US + b * _BATCH_SPAN_US + np.sort(rng.integers(0, _BATCH_SPAN_US, n))
        return pd.DataFrame({"batch": np.full(n, b, dtype=np.int64), "event_id": np.arange(lo, hi, dtype=np.int64),
                             "ts": ts.astype(np.int64), "user_id": users, "item_id": items,
                             "amount_cents": amounts})[EVENT_COLUMNS]

    def all(self):
        import pandas as pd

        return pd.concat([self.batch(b) for b in range(self.batches)], ignore_index=True)


class FileSource:
    """A parquet or CSV file (any fsspec URL) with columns user_id, item_id, amount_cents, ts
    (int µs or a timestamp), optionally event_id; cut into `batches` consecutive slices in file order."""

    REQUIRED = ("user_id", "item_id", "amount_cents", "ts")

    def __init__(self, path: str, batches: int):
        import pandas as pd

        from dstl.changelog.fs import filesystem

        if batches < 1:
            raise ValueError(f"--batches must be >= 1, got {batches}")
        fs, p = filesystem(path)
        if not fs.exists(p):
            raise FileNotFoundError(f"--input {path} does not exist")
        ext = os.path.splitext(p)[1].lower()
        with fs.open(p, "rb") as f:
            if ext in (".csv", ".txt") or ext.endswith(".csv"):
                df = pd.read_csv(f)
            elif ext in (".parquet", ".pq", ""):
                df = pd.read_parquet(f)
            else:
                raise ValueError(f"--input {path}: unknown format {ext!r} (use .parquet or .csv)")
        missing = [c for c in self.REQUIRED if c not in df.columns]
        if missing:
            raise ValueError(f"--input {path} lacks columns {missing} (needs {', '.join(self.REQUIRED)})")
        if len(df) < batches:
            raise ValueError(f"--input {path} has {len(df)} rows, fewer than --batches {batches}")
        for c in ("user_id", "item_id"):
            if df[c].isna().any():
                raise ValueError(f"--input {path}: column {c} has nulls")
        ts = df["ts"]
        if _is_text(ts.dtype):  # CSV: timestamps as text
            try:
                ts = pd.to_datetime(ts)
            except (ValueError, TypeError) as exc:
                raise ValueError(f"--input {path}: column ts is neither integer microseconds nor timestamps "
                                 f"({exc})") from None
        if isinstance(ts.dtype, pd.DatetimeTZDtype):
            ts = ts.dt.tz_convert("UTC").dt.tz_localize(None)
        if np.issubdtype(ts.dtype, np.datetime64):
            ts = ts.astype("datetime64[us]").astype(np.int64)
        try:
            df["ts"] = ts.astype(np.int64)
            df["amount_cents"] = df["amount_cents"].astype(np.int64)
        except (ValueError, TypeError) as exc:
            raise ValueError(f"--input {path}: ts and amount_cents must be integers ({exc})") from None
        if "event_id" not in df.columns:
            df["event_id"] = np.arange(len(df), dtype=np.int64)
        bounds = batch_bounds(len(df), batches)
        df["batch"] = np.repeat(np.arange(batches, dtype=np.int64), np.diff(bounds))
        self.path, self.batches, self.events = path, batches, len(df)
        self._df = df[EVENT_COLUMNS].reset_index(drop=True)
        self._bounds = bounds

    def params(self) -> Dict[str, object]:
        return {"source": "file", "input": self.path, "events": self.events, "batches": self.batches}

    def batch(self, b: int):
        return self._df.iloc[self._bounds[b]: self._bounds[b + 1]].reset_index(drop=True)

    def all(self):
        return self._df

    def spark_type(self, col: str) -> str:
        return "string" if _is_text(self._df[col].dtype) else "long"


def _is_text(dtype) -> bool:
    """Whether a column holds text: pandas 2 reads it as ``object``, pandas 3 as its ``str`` dtype."""
    import pandas as pd

    return dtype == object or pd.api.types.is_string_dtype(dtype)
