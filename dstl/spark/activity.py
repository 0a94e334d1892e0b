"""The pipeline's stateful operator (per-user activity) and its plain-pandas reference.

State per user: event count and amount sum (ValueState), distinct items (MapState item -> batch
first seen, plus its size in a ValueState), the last 10 items (ListState). Each call receives all of
one subtask's events of one micro-batch, ordered by (ts, event_id), and emits one update row per user
it saw. Work per call is vectorised with pandas; state is touched once per user and once per new
(user, item) pair, so the change count is independent of how many events a user had in the batch.
"""
from __future__ import annotations

from typing import Any, Dict, Iterable, List, Tuple

import numpy as np

LAST_N = 10

#: Spark DDL of the output rows; {user} and {item} are the key/item column types
OUTPUT_DDL = ("batch long, user_id {user}, events long, amount_cents long, distinct_items long, "
              "last_items array<{item}>, last_ts long")
OUTPUT_COLUMNS = ["batch", "user_id", "events", "amount_cents", "distinct_items", "last_items", "last_ts"]
EVENT_COLUMNS = ["batch", "event_id", "ts", "user_id", "item_id", "amount_cents"]


def output_ddl(user_type: str = "long", item_type: str = "long") -> str:
    return OUTPUT_DDL.format(user=user_type, item=item_type)


def user_activity(rows, state):
    """`fn(rows, state)` for `stateful_map_in_pandas`: update and emit per-user aggregates."""
    import pandas as pd

    count = state.value_state("count")
    amount = state.value_state("amount_cents")
    n_items = state.value_state("distinct_items")
    items = state.map_state("items")
    last = state.list_state("last_items")

    batch = int(rows["batch"].iat[0])
    grouped = rows.groupby("user_id", sort=True)
    sizes = grouped.size()
    users = sizes.index.tolist()
    sums = grouped["amount_cents"].sum().tolist()
    last_ts = grouped["ts"].max().tolist()
    tails = rows.groupby("user_id", sort=True).tail(LAST_N).groupby("user_id", sort=True)["item_id"].agg(list)

    new_items: Dict[Any, int] = {}
    pairs = rows.drop_duplicates(["user_id", "item_id"])
    for user, item in zip(pairs["user_id"].tolist(), pairs["item_id"].tolist()):
        if not items.contains(user, item):
            items.put(user, item, batch)
            new_items[user] = new_items.get(user, 0) + 1

    out_events: List[int] = []
    out_amount: List[int] = []
    out_distinct: List[int] = []
    out_last: List[list] = []
    for user, n, s, tail in zip(users, sizes.tolist(), sums, tails.tolist()):
        c = count.get(user, 0) + n
        count.update(user, c)
        a = amount.get(user, 0) + s
        amount.update(user, a)
        d = n_items.get(user, 0)
        if user in new_items:
            d += new_items[user]
            n_items.update(user, d)
        recent = (last.get(user) or []) + tail
        recent = recent[-LAST_N:]
        last.update(user, recent)
        out_events.append(c)
        out_amount.append(a)
        out_distinct.append(d)
        out_last.append(recent)
    return pd.DataFrame({"batch": batch, "user_id": users, "events": out_events, "amount_cents": out_amount,
                         "distinct_items": out_distinct, "last_items": out_last, "last_ts": last_ts})


def read_state(backend) -> Dict[Any, Dict[str, Any]]:
    """Every user's state held by `backend`: {user: {events, amount_cents, distinct_items, last_items, items}}."""
    count = backend.value_state("count")
    amount = backend.value_state("amount_cents")
    n_items = backend.value_state("distinct_items")
    items = backend.map_state("items")
    last = backend.list_state("last_items")
    out = {}
    for user, c in count.items():
        out[user] = {"events": c, "amount_cents": amount.get(user, 0), "distinct_items": n_items.get(user, 0),
                     "last_items": list(last.get(user) or []), "items": dict(items.items(user))}
    return out


# ------------------------------------------------------------------ in-memory twin (benchmark baseline)

class _MemValue:
    def __init__(self):
        self.d: Dict[Any, Any] = {}

    def get(self, key, default=None):
        return self.d.get(key, default)

    def update(self, key, value):
        self.d[key] = value

    def items(self):
        return self.d.items()


class _MemList(_MemValue):
    def get(self, key, default=None):
        return self.d.get(key, [] if default is None else default)


class _MemMap:
    def __init__(self):
        self.d: Dict[Any, Dict[Any, Any]] = {}

    def contains(self, key, user_key) -> bool:
        m = self.d.get(key)
        return m is not None and user_key in m

    def put(self, key, user_key, value):
        self.d.setdefault(key, {})[user_key] = value

    def items(self, key):
        return self.d.get(key, {}).items()


class MemoryState:
    """The same state API as `KeyedStateBackend`, in dicts: no changelog, no durability."""

    def __init__(self):
        self._states: Dict[Tuple[str, str], Any] = {}

    def _get(self, kind, name, factory):
        s = self._states.get((kind, name))
        if s is None:
            s = self._states[(kind, name)] = factory()
        return s

    def value_state(self, name):
        return self._get("value", name, _MemValue)

    def list_state(self, name):
        return self._get("list", name, _MemList)

    def map_state(self, name):
        return self._get("map", name, _MemMap)


# ------------------------------------------------------------------ reference (plain pandas)

def reference(events) -> Tuple[Dict[Any, Dict[str, Any]], "Any"]:
    """Final state per user and every batch's expected output rows, from all events at once."""
    import pandas as pd

    e = events.sort_values(["batch", "ts", "event_id"], kind="stable", ignore_index=True)
    per = e.groupby(["user_id", "batch"], sort=True).agg(n=("event_id", "size"), s=("amount_cents", "sum"),
                                                          last_ts=("ts", "max")).reset_index()
    per["events"] = per.groupby("user_id")["n"].cumsum()
    per["amount_cents"] = per.groupby("user_id")["s"].cumsum()
    first = e.drop_duplicates(["user_id", "item_id"])
    new = first.groupby(["user_id", "batch"]).size().rename("new").reset_index()
    per = per.merge(new, on=["user_id", "batch"], how="left")
    per["new"] = per["new"].fillna(0).astype(np.int64)
    per["distinct_items"] = per.groupby("user_id")["new"].cumsum()
    e["pos"] = e.groupby("user_id").cumcount()
    lastpos = e.groupby(["user_id", "batch"])["pos"].max()
    seqs = {u: g.to_numpy() for u, g in e.groupby("user_id")["item_id"]}
    per["last_items"] = [seqs[u][max(0, p - LAST_N + 1): p + 1].tolist()
                         for (u, _b), p in zip(lastpos.index.tolist(), lastpos.tolist())]
    out = per[OUTPUT_COLUMNS].sort_values(["batch", "user_id"], ignore_index=True)
    final_rows = per.sort_values(["user_id", "batch"]).groupby("user_id").tail(1)
    firsts = {u: dict(zip(g["item_id"].tolist(), g["batch"].tolist())) for u, g in first.groupby("user_id")}
    state = {}
    for row in final_rows.itertuples(index=False):
        state[row.user_id] = {"events": int(row.events), "amount_cents": int(row.amount_cents),
                              "distinct_items": int(row.distinct_items), "last_items": list(row.last_items),
                              "items": firsts[row.user_id]}
    return state, out


def compare_state(actual: Dict[Any, Dict[str, Any]], expected: Dict[Any, Dict[str, Any]], limit: int = 5) -> List[str]:
    """Human-readable differences (empty list: equal)."""
    problems: List[str] = []
    missing = [u for u in expected if u not in actual]
    extra = [u for u in actual if u not in expected]
    if missing:
        problems.append(f"{len(missing)} users missing from the state, e.g. {missing[:limit]}")
    if extra:
        problems.append(f"{len(extra)} unexpected users in the state, e.g. {extra[:limit]}")
    bad = 0
    for user, want in expected.items():
        got = actual.get(user)
        if got is None:
            continue
        for k, v in want.items():
            g = got.get(k)
            if k == "items":
                g = {_norm(a): _norm(b) for a, b in (g or {}).items()}
                v = {_norm(a): _norm(b) for a, b in v.items()}
            elif k == "last_items":
                g = [_norm(x) for x in g or []]
                v = [_norm(x) for x in v]
            if g != v:
                bad += 1
                if bad <= limit:
                    problems.append(f"user {user!r}: {k} is {_short(g)}, expected {_short(v)}")
    if bad > limit:
        problems.append(f"... {bad - limit} more differences")
    return problems


def compare_output(actual, expected, limit: int = 5) -> List[str]:
    """Differences between the committed output rows and the reference (any order)."""
    problems: List[str] = []
    a = actual[OUTPUT_COLUMNS].sort_values(["batch", "user_id"], ignore_index=True)
    b = expected[OUTPUT_COLUMNS].sort_values(["batch", "user_id"], ignore_index=True)
    if len(a) != len(b):
        dup = int(actual.duplicated(["batch", "user_id"]).sum())
        problems.append(f"output has {len(a)} rows, expected {len(b)} ({dup} duplicated (batch, user) rows)")
        ka = set(zip(a["batch"].tolist(), a["user_id"].tolist()))
        kb = set(zip(b["batch"].tolist(), b["user_id"].tolist()))
        if kb - ka:
            problems.append(f"missing rows e.g. {sorted(kb - ka)[:limit]}")
        if ka - kb:
            problems.append(f"unexpected rows e.g. {sorted(ka - kb)[:limit]}")
        return problems
    bad = 0
    for col in OUTPUT_COLUMNS:
        if col == "last_items":
            x = [[_norm(v) for v in row] for row in a[col].tolist()]
            y = [[_norm(v) for v in row] for row in b[col].tolist()]
        else:
            x = [_norm(v) for v in a[col].tolist()]
            y = [_norm(v) for v in b[col].tolist()]
        for i, (p, q) in enumerate(zip(x, y)):
            if p != q:
                bad += 1
                if bad <= limit:
                    problems.append(f"batch {a['batch'].iat[i]} user {a['user_id'].iat[i]!r}: {col} is "
                                    f"{_short(p)}, expected {_short(q)}")
    if bad > limit:
        problems.append(f"... {bad - limit} more differences")
    return problems


def _norm(v):
    if isinstance(v, np.generic):
        return v.item()
    return v


def _short(v, n: int = 80) -> str:
    s = repr(v)
    return s if len(s) <= n else s[:n] + "..."
