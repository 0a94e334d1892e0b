"""The pipeline's stateful operator (per-user activity) and its plain-pandas reference.

State per user: event count and amount sum (ValueState), distinct items (MapState item -> the
last batch the user bought it in; its size is the distinct count), the last 10 items (ListState with
max_length 10). Each call receives all of
one subtask's events of one micro-batch, ordered by (ts, event_id), and emits one update row per user
it saw. Work per call is vectorised with pandas and the bulk state methods: one change per user for
each value state, one per distinct (user, item) pair, and at most 10 list appends per user.
"""
from __future__ import annotations

from typing import Any, Dict, List, Tuple

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
    """`fn(rows, state)` for `stateful_map_in_pandas`: update and emit per-user aggregates.

    Uses the bulk state methods (one vectorised encode + one writer append per state and call).
    """
    import pandas as pd

    count = state.value_state("count")
    amount = state.value_state("amount_cents")
    items = state.map_state("items")
    last = state.list_state("last_items", max_length=LAST_N)

    batch = int(rows["batch"].iat[0])
    grouped = rows.groupby("user_id", sort=True)
    sizes = grouped.size()
    users = sizes.index
    new_count = np.asarray(count.get_many(users, 0), dtype=np.int64) + sizes.to_numpy()
    count.update_many(users, new_count)
    new_amount = np.asarray(amount.get_many(users, 0), dtype=np.int64) + grouped["amount_cents"].sum().to_numpy()
    amount.update_many(users, new_amount)
    # item -> last batch the user bought it in: one unconditional put per distinct (user, item)
    pairs = rows.drop_duplicates(["user_id", "item_id"], keep="last")
    items.put_many(pairs["user_id"], pairs["item_id"], np.full(len(pairs), batch, dtype=np.int64))
    tail = rows.groupby("user_id", sort=False).tail(LAST_N)
    last.add_many(tail["user_id"], tail["item_id"])
    users_l = users.tolist()
    return pd.DataFrame({"batch": batch, "user_id": users, "events": new_count, "amount_cents": new_amount,
                         "distinct_items": [items.size(u) for u in users_l],
                         "last_items": [last.get(u) for u in users_l],
                         "last_ts": grouped["ts"].max().to_numpy()})


def read_state(backend) -> Dict[Any, Dict[str, Any]]:
    """Every user's state held by `backend`: {user: {events, amount_cents, distinct_items, last_items, items}}."""
    count = backend.value_state("count")
    amount = backend.value_state("amount_cents")
    items = backend.map_state("items")
    last = backend.list_state("last_items", max_length=LAST_N)
    out = {}
    for user, c in count.items():
        m = dict(items.items(user))
        out[user] = {"events": c, "amount_cents": amount.get(user, 0), "distinct_items": len(m),
                     "last_items": list(last.get(user) or []), "items": m}
    return out


# ------------------------------------------------------------------ reference (plain pandas)

def reference(events) -> Tuple[Dict[Any, Dict[str, Any]], "Any"]:
    """Final state per user and every batch's expected output rows, from all events at once."""

    e = events.sort_values(["batch", "ts", "event_id"], kind="stable", ignore_index=True)
    per = e.groupby(["user_id", "batch"], sort=True).agg(n=("event_id", "size"), s=("amount_cents", "sum"),
                                                          last_ts=("ts", "max")).reset_index()
    per["events"] = per.groupby("user_id")["n"].cumsum()
    per["amount_cents"] = per.groupby("user_id")["s"].cumsum()
    first = e.drop_duplicates(["user_id", "item_id"])
    latest = e.drop_duplicates(["user_id", "item_id"], keep="last")
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
    lasts = {u: dict(zip(g["item_id"].tolist(), g["batch"].tolist())) for u, g in latest.groupby("user_id")}
    state = {}
    for row in final_rows.itertuples(index=False):
        state[row.user_id] = {"events": int(row.events), "amount_cents": int(row.amount_cents),
                              "distinct_items": int(row.distinct_items), "last_items": list(row.last_items),
                              "items": lasts[row.user_id]}
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
