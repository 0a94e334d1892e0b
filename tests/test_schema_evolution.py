"""Schema evolution of state values: added fields null, removed dropped, int -> long and
float -> double widen; a rename or a narrowing is an error naming the state and field. Old values
convert whether they come from the log or from a materialization."""
from __future__ import annotations

import pytest

from dstl.changelog.storage import open_storage
from dstl.keygroups import key_group_ranges
from dstl.state import KeyedStateBackend, KeyedStateSnapshot
from dstl.state.evolution import SchemaEvolutionError, evolve_backend, plan_evolution


def struct(*fields):
    return {"type": "struct", "fields": [{"name": n, "type": t, "nullable": True, "metadata": {}}
                                         for n, t in fields]}


OLD = struct(("name", "string"), ("visits", "integer"), ("score", "float"), ("zip", "string"),
             ("where", struct(("lat", "float"), ("lon", "float"))))
NEW = struct(("name", "string"), ("visits", "long"), ("score", "double"),
             ("where", struct(("lat", "double"), ("lon", "double"), ("alt", "integer"))), ("active", "boolean"))


def test_allowed_changes_convert_stored_values():
    conv = plan_evolution("profile", OLD, NEW)
    assert conv(["ann", 3, 1.5, "10115", [52.5, 13.4]]) == ["ann", 3, 1.5, [52.5, 13.4, None], None]
    assert conv(None) is None
    assert plan_evolution("profile", OLD, OLD) is None


@pytest.mark.parametrize("new,message", [
    (struct(("name", "string"), ("visits", "short"), ("score", "float"), ("zip", "string"),
            ("where", struct(("lat", "float"), ("lon", "float")))), "field 'visits' is narrowed (integer -> short)"),
    (struct(("name", "string"), ("visits", "integer"), ("score", "float"), ("zip", "long"),
            ("where", struct(("lat", "float"), ("lon", "float")))), "field 'zip' changes type (string -> long)"),
    (struct(("full_name", "string"), ("visits", "integer"), ("score", "float"), ("zip", "string"),
            ("where", struct(("lat", "float"), ("lon", "float")))), "field 'name' is renamed to 'full_name'"),
    (struct(("name", "string"), ("visits", "integer"), ("score", "float"), ("zip", "string"),
            ("where", struct(("lat", "float"), ("lon", "integer")))), "field 'where.lon' changes type"),
])
def test_forbidden_changes_name_state_and_field(new, message):
    with pytest.raises(SchemaEvolutionError, match="state 'profile': " + message.replace("(", r"\(").replace(")", r"\)")):
        plan_evolution("profile", OLD, new)


def test_old_values_from_log_and_materialization_read_in_the_new_layout(tmp_path):
    kgr = key_group_ranges(128, 1)[0]
    with open_storage(str(tmp_path / "cl"), upload_mode="direct") as storage:
        b = KeyedStateBackend(storage, "op", kgr, 128)
        b.value_state("profile").update("ann", ["ann", 3, 1.5, "10115", [52.5, 13.4]])
        b.list_state("history").add("ann", ["ann", 1, 0.5, "x", None])
        b.materialize()                                            # ann: in the materialization
        b.value_state("profile").update("bob", ["bob", 7, 2.5, "80331", [48.1, 11.6]])  # bob: in the log
        b.map_state("by_day").put("bob", "mon", ["bob", 2, 1.0, "y", [1.0, 2.0]])
        snap = b.snapshot(1).result()
        b.confirm(1)
        b.close()
        assert snap.materialized and snap.changelog is not None
        r = KeyedStateBackend.restore(storage, "op", kgr, 128, [KeyedStateSnapshot.from_bytes(snap.to_bytes())])
        conv = plan_evolution("profile", OLD, NEW)
        for name in ("profile", "history", "by_day"):
            evolve_backend(r, name, conv)
        profile = r.value_state("profile")
        assert profile.get("ann") == ["ann", 3, 1.5, [52.5, 13.4, None], None]
        assert profile.get("bob") == ["bob", 7, 2.5, [48.1, 11.6, None], None]
        assert r.list_state("history").get("ann") == [["ann", 1, 0.5, None, None]]
        assert r.map_state("by_day").get("bob", "mon") == ["bob", 2, 1.0, [1.0, 2.0, None], None]
        r.materialize()                                            # later checkpoints hold the new layout
        snap2 = r.snapshot(2).result()
        r.confirm(2)
        r.close()
        again = KeyedStateBackend.restore(storage, "op", kgr, 128, [KeyedStateSnapshot.from_bytes(snap2.to_bytes())])
        assert again.value_state("profile").get("bob") == ["bob", 7, 2.5, [48.1, 11.6, None], None]
        again.close()


def _rec(kind, value, user_key=None, ttl_ms=None):
    rec = {"kind": kind, "value": value, "ttl_ms": ttl_ms}
    if user_key is not None:
        rec["user_key"], rec["user_key_ddl"] = user_key, "k"
    return rec


def test_plan_state_evolution_compares_a_jobs_states():
    from dstl.state.evolution import plan_state_evolution

    key = struct(("day", "string"))
    recorded = {"profile": _rec("value", OLD), "hits": _rec("map", struct(("c", "integer")), key),
                "gone": _rec("list", struct(("v", "string"))), "old_job": {"kind": "value"}}
    declared = {"profile": _rec("value", NEW), "hits": _rec("map", struct(("c", "long")), key),
                "new": _rec("value", struct(("x", "long"))), "old_job": _rec("value", struct(("v", "long")))}
    # profile converts; hits only widens integers (no conversion); states in one side only, or
    # without a usable record, are not compared
    assert plan_state_evolution(recorded, declared) == {"profile": {"old": OLD, "new": NEW}}
    assert plan_state_evolution(recorded, recorded) == {}
    assert plan_state_evolution({}, declared) == {}


@pytest.mark.parametrize("declared,message", [
    ({"s": _rec("list", struct(("v", "long")))}, "state 's' holds value state; it is now declared as list state"),
    ({"s": _rec("value", struct(("v", "long")), ttl_ms=1000)}, "state 's' was created without a TTL; its TTL cannot be added"),
    ({"s": _rec("value", struct(("v", "integer")))}, r"state 's': field 'v' is narrowed \(long -> integer\)"),
])
def test_plan_state_evolution_refuses_what_values_cannot_follow(declared, message):
    from dstl.state.evolution import plan_state_evolution

    with pytest.raises(SchemaEvolutionError, match=message):
        plan_state_evolution({"s": _rec("value", struct(("v", "long")))}, declared)
    with pytest.raises(SchemaEvolutionError, match="state 'm': the map's user key schema changes"):
        plan_state_evolution({"m": _rec("map", struct(("c", "long")), struct(("k", "string")))},
                             {"m": _rec("map", struct(("c", "long")), struct(("k", "long")))})
    with pytest.raises(SchemaEvolutionError, match="state 't' was created with a TTL; its TTL cannot be removed"):
        plan_state_evolution({"t": _rec("value", struct(("v", "long")), ttl_ms=5)}, {"t": _rec("value", struct(("v", "long")))})
