"""Schema evolution of state values: read values written under an older declared schema.

A declared value schema (a Spark struct, recorded as its JSON form in the checkpoint's
`state_schemas` property) stores a value as the list of its fields in order. When a job declares a
different schema for a state than the one recorded, `plan_evolution(name, old, new)` compares the two
field by field and returns a converter from old stored lists to new ones:

* a field only in the new schema is added as null;
* a field only in the old schema is dropped;
* a field in both keeps its value; its type may widen (byte -> short -> int -> long, float -> double,
  and recursively inside structs);
* a field renamed (another name, same type, at the same position) or narrowed (long -> int,
  double -> float, or any other type change) is an error naming the state and the field.

`evolve_backend(backend, name, converter)` converts every value of a restored backend's state in
memory: values come from the log and from materializations alike, since both are replayed into the
same table. Materialize afterwards, so later checkpoints hold only values of the new layout.

`plan_state_evolution(recorded, declared)` does the comparison for a whole job (StatefulStream, on
resume): the `state_schemas` records of the checkpoint it resumes from against the ones the
processor declares now. It also refuses what no value converter can follow: a state that changes
kind, a map state whose user key schema changes, a TTL added or removed.
"""
from __future__ import annotations

from typing import Any, Callable, Dict, List, Optional

from dstl.errors import DstlError

__all__ = ["SchemaEvolutionError", "plan_evolution", "plan_state_evolution", "evolve_backend"]

_WIDER = {  # type -> the types it may widen to (besides itself)
    "byte": {"short", "integer", "long"}, "short": {"integer", "long"}, "integer": {"long"},
    "float": {"double"},
}


class SchemaEvolutionError(DstlError, ValueError):
    """A declared schema change that old values cannot follow (a rename or a narrowing)."""


def _fields(record: Dict[str, Any]) -> List[Dict[str, Any]]:
    if not isinstance(record, dict) or record.get("type") != "struct":
        raise SchemaEvolutionError(f"not a struct schema record: {record!r:.200}")
    return list(record.get("fields", []))


def _type_name(t: Any) -> str:
    if isinstance(t, str):
        return t
    return t.get("type", "?") if isinstance(t, dict) else repr(t)


def _convert_type(state: str, path: str, old: Any, new: Any) -> Optional[Callable[[Any], Any]]:
    """A converter of one stored field (None = keep as is); raises on a forbidden change."""
    if old == new:
        return None
    o, n = _type_name(old), _type_name(new)
    if o == "struct" and n == "struct":
        inner = _plan(state, old, new, path + ".")
        return None if inner is None else (lambda v: None if v is None else inner(v))
    if o == n and o in ("array", "map"):
        raise SchemaEvolutionError(f"state {state!r}: field {path!r} changes its element type "
                                   f"({_short(old)} -> {_short(new)}); only widening of scalars and structs is allowed")
    if n in _WIDER.get(o, ()):
        if n == "double":
            return lambda v: None if v is None else float(v)
        return None  # integers are stored as msgpack ints of any width
    what = "is narrowed" if o in _WIDER.get(n, ()) else "changes type"
    raise SchemaEvolutionError(f"state {state!r}: field {path!r} {what} ({o} -> {n}); "
                               "only int -> long and float -> double widen")


def _short(t: Any) -> str:
    return t if isinstance(t, str) else _type_name(t)


def _plan(state: str, old: Dict[str, Any], new: Dict[str, Any], prefix: str = "") -> Optional[Callable]:
    of, nf = _fields(old), _fields(new)
    old_index = {f["name"]: i for i, f in enumerate(of)}
    new_names = {f["name"] for f in nf}
    for i, f in enumerate(nf):  # a field in the same place under another name, same type: a rename
        if f["name"] not in old_index and i < len(of) and of[i]["name"] not in new_names \
                and of[i]["type"] == f["type"]:
            raise SchemaEvolutionError(f"state {state!r}: field {prefix}{of[i]['name']!r} is renamed to "
                                       f"{prefix}{f['name']!r}; renaming a field loses its values "
                                       "(add a new field and drop the old one in two steps)")
    steps = []  # per new field: (old index or None, converter or None)
    for f in nf:
        i = old_index.get(f["name"])
        conv = None if i is None else _convert_type(state, prefix + f["name"], of[i]["type"], f["type"])
        steps.append((i, conv))
    if [i for i, _ in steps] == list(range(len(of))) and all(c is None for _, c in steps):
        return None  # identical layout

    def convert(stored: Any) -> Any:
        if stored is None:
            return None
        out = []
        for i, conv in steps:
            v = None if i is None or i >= len(stored) else stored[i]
            out.append(v if conv is None else conv(v))
        return out

    return convert


def plan_evolution(state: str, old: Dict[str, Any], new: Dict[str, Any]) -> Optional[Callable[[Any], Any]]:
    """A converter from values stored under `old` to the layout of `new` (struct schema records, the
    JSON form of a StructType); None when nothing changes. Raises SchemaEvolutionError."""
    return _plan(state, old, new)


def plan_state_evolution(recorded: Dict[str, Any], declared: Dict[str, Any]) -> Dict[str, Dict[str, Any]]:
    """The value-schema changes of a job's states: `recorded` and `declared` map state names to
    StateSchema records (`kind`, `value`, optionally `user_key`, `ttl_ms`). Returns
    ``{name: {"old": value record, "new": value record}}`` for every state whose stored values must be
    converted; raises SchemaEvolutionError (naming the state, and the field where there is one) for
    any change that old values cannot follow. States only in one of the two are not compared: a new
    state starts empty, an undeclared one keeps its values and record."""
    out: Dict[str, Dict[str, Any]] = {}
    for name in sorted(set(recorded) & set(declared)):
        old, new = recorded[name], declared[name]
        if not isinstance(old, dict) or not isinstance(old.get("value"), dict):
            continue  # nothing usable recorded (an older job): nothing to compare against
        if old.get("kind") != new.get("kind"):
            raise SchemaEvolutionError(f"state {name!r} holds {old.get('kind')} state; it is now declared as "
                                       f"{new.get('kind')} state (use another state name)")
        if old.get("user_key") is not None and old.get("user_key") != new.get("user_key"):
            raise SchemaEvolutionError(f"state {name!r}: the map's user key schema changes "
                                       f"({old.get('user_key_ddl', '?')} -> {new.get('user_key_ddl', '?')}); "
                                       "stored entries are found by their encoded user key, so it cannot change")
        if (old.get("ttl_ms") is None) != (new.get("ttl_ms") is None):
            have = "without" if old.get("ttl_ms") is None else "with"
            raise SchemaEvolutionError(f"state {name!r} was created {have} a TTL; its TTL cannot be "
                                       f"{'added' if have == 'without' else 'removed'} (use another state name)")
        if plan_evolution(name, old["value"], new["value"]) is not None:
            out[name] = {"old": old["value"], "new": new["value"]}
    return out


def evolve_backend(backend, name: str, convert: Callable[[Any], Any]) -> int:
    """Convert every value of state `name` held by a restored backend; returns how many changed.

    TTL states keep their [value, expires_at_ms] pairs; list elements and map entry values are
    converted one by one.
    """
    st = backend.get_state(name)
    ttl = bool(st.meta.options.get("ttl"))

    def one(v):
        return [convert(v[0]), v[1]] if ttl else convert(v)

    n = 0
    for per_state in backend._table.values():
        entries = per_state.get(name)
        if not entries:
            continue
        for key, value in list(entries.items()):
            entries[key] = st._evolve_entry(value, one)
            n += 1
    backend._since_changes += n  # the next materialization must write the new layout
    return n
