"""More StatefulProcessors for tests/test_conformance.py, one for each processor of Spark's own
transformWithState test helper that tests/conform_processors.py does not answer (list and map
state operations, long lists, large values, nested values, composite outputs, top-k, word counts,
every state method, non-nullable fields, session timers, running counts with an initial state, a
watermark without event-time mode, pandas chunking, schema evolution). Written here, for both flavours
(`use_pandas`), never copied.

`Multiplex` runs several of them in one query, so one stream (two streaming queries per flavour)
answers many processors: the key's prefix (`"list/0"`) picks the part, each part's states are
named with its prefix, and its output rows are widened to the group's output schema (the columns a
part does not write are null).
"""
from __future__ import annotations

import datetime as dt
import json
import sys
from typing import Any, Dict, Iterator, List, NamedTuple, Optional

from pyspark import cloudpickle
from pyspark.sql import Row
from pyspark.sql.streaming import StatefulProcessor
from pyspark.sql.types import (ArrayType, BooleanType, FloatType, IntegerType, LongType, MapType,
                               StringType, StructField, StructType, TimestampType)

from conform_processors import _emit, _rows

cloudpickle.register_pickle_by_value(sys.modules[__name__])


# ------------------------------------------------------------------ several processors, one query

class _PartHandle:
    """A part's view of the handle: its states carry its prefix; timers are per key already."""

    def __init__(self, handle, prefix: str):
        self._h, self._p = handle, prefix

    def _n(self, name: str) -> str:
        return f"{self._p}_{name}"

    def getValueState(self, name, schema, ttlDurationMs=None):
        return self._h.getValueState(self._n(name), schema, ttlDurationMs)

    def getListState(self, name, schema, ttlDurationMs=None):
        return self._h.getListState(self._n(name), schema, ttlDurationMs)

    def getMapState(self, name, userKeySchema, valueSchema, ttlDurationMs=None):
        return self._h.getMapState(self._n(name), userKeySchema, valueSchema, ttlDurationMs)

    def deleteIfExists(self, name):
        self._h.deleteIfExists(self._n(name))

    def registerTimer(self, ts):
        self._h.registerTimer(ts)

    def deleteTimer(self, ts):
        self._h.deleteTimer(ts)

    def listTimers(self):
        return self._h.listTimers()


class Multiplex(StatefulProcessor):
    """Each key `"<part>/<id>"` goes to `parts[<part>]`; outputs take the group's `columns`."""

    def __init__(self, parts: Dict[str, StatefulProcessor], output: str, use_pandas: bool):
        self.parts, self.use_pandas = parts, use_pandas
        self.columns = [c.strip().split()[0] for c in _top_level(output)]

    def init(self, handle) -> None:
        for name, part in self.parts.items():
            part.init(_PartHandle(handle, name))

    def _part(self, key):
        return self.parts[str(key[0]).split("/")[0]]

    def _widen(self, result) -> Iterator:
        if result is None:
            return
        for item in result:
            if self.use_pandas:
                import pandas as pd

                n = len(item)
                yield pd.DataFrame({c: (item[c] if c in item.columns else pd.Series([None] * n, dtype=object))
                                    for c in self.columns})
            else:
                d = item.asDict()
                yield Row(**{c: d.get(c) for c in self.columns})

    def handleInputRows(self, key, rows, timerValues) -> Iterator:
        return self._widen(self._part(key).handleInputRows(key, rows, timerValues))

    def handleExpiredTimer(self, key, timerValues, expiredTimerInfo) -> Iterator:
        return self._widen(self._part(key).handleExpiredTimer(key, timerValues, expiredTimerInfo))

    def handleInitialState(self, key, initialState, timerValues) -> None:
        self._part(key).handleInitialState(key, initialState, timerValues)

    def close(self) -> None:
        for part in self.parts.values():
            part.close()


def _top_level(ddl: str) -> List[str]:
    parts, depth, cur = [], 0, ""
    for ch in ddl:
        depth += ch in "<(" or 0
        depth -= ch in ">)" or 0
        if ch == "," and depth == 0:
            parts.append(cur)
            cur = ""
        else:
            cur += ch
    return [p for p in parts + [cur] if p.strip()]


class _Base(StatefulProcessor):
    def __init__(self, use_pandas: bool):
        self.use_pandas = use_pandas

    def handleExpiredTimer(self, key, timerValues, expiredTimerInfo) -> Iterator:
        return iter([])

    def close(self) -> None:
        pass


def _ends(key, digit: str) -> bool:
    return str(key[0]).endswith(digit)


# ------------------------------------------------------------------ the parts

class MissingValue(_Base):
    """(InvalidSimpleStatefulProcessor) A value state never written: exists() is False, get() is
    None, clear() does nothing."""

    def init(self, handle) -> None:
        self.never = handle.getValueState("never", StructType([StructField("value", IntegerType())]))

    def handleInputRows(self, key, rows, timerValues) -> Iterator:
        n = len(_rows(rows, self.use_pandas))
        seen = f"exists={self.never.exists()} get={self.never.get()!r}"
        self.never.clear()
        return _emit([{"id": key[0], "n": n, "detail": seen + f" after-clear={self.never.exists()}"}],
                     self.use_pandas)


class NotNullFields(_Base):
    """(BasicProcessorNotNullable) A value state whose fields are declared non-nullable. Spark
    accepts it with its default state encoding (its Avro encoding refuses it, a failure path)."""

    def init(self, handle) -> None:
        self.s = handle.getValueState("s", StructType([StructField("id", IntegerType(), False),
                                                       StructField("name", StringType(), False)]))

    def handleInputRows(self, key, rows, timerValues) -> Iterator:
        n = len(_rows(rows, self.use_pandas)) + (self.s.get()[0] if self.s.exists() else 0)
        self.s.update((n, f"name-{n}"))
        return _emit([{"id": key[0], "n": n, "detail": repr(tuple(self.s.get()))}], self.use_pandas)


class ListOps(_Base):
    """(ListStateProcessor; with `ttl_ms`, ListStateLargeTTLProcessor) put, appendValue and
    appendList on two lists per input row, three iterators read interleaved, and a list of
    timestamps written and read back."""

    def __init__(self, use_pandas: bool, ttl_ms: Optional[int] = None):
        super().__init__(use_pandas)
        self.ttl_ms = ttl_ms

    def init(self, handle) -> None:
        ints = StructType([StructField("temperature", IntegerType())])
        self.one = handle.getListState("one", ints, self.ttl_ms)
        self.two = handle.getListState("two", ints, self.ttl_ms)
        self.times = handle.getListState("times", StructType([StructField("time", TimestampType())]))

    def handleInputRows(self, key, rows, timerValues) -> Iterator:
        rows = _rows(rows, self.use_pandas)
        before = len(list(self.one.get())) if self.one.exists() else 0
        stamps = []
        for r in rows:
            self.one.put([(7,), (8,)])
            self.two.put([(70,), (80,)])
            self.one.appendValue((int(r.temperature),))
            self.two.appendValue((-int(r.temperature),))
            self.one.appendList([(1,), (2,)])
            self.two.appendList([(10,), (20,)])
            stamps.append((dt.datetime(2026, 1, 1) + dt.timedelta(seconds=int(r.temperature)),))
        a, b = self.one.get(), self.two.get()
        seq = [next(a)[0], next(b)[0], next(a)[0]]
        c = self.one.get()
        seq += [next(c)[0], next(b)[0], next(c)[0], next(a)[0]]
        seq += [v[0] for v in a] + ["|"] + [v[0] for v in b] + ["|"] + [v[0] for v in c]
        if stamps:
            self.times.put(stamps)
        back = [t[0].isoformat() for t in self.times.get()]
        return _emit([{"id": key[0], "n": before, "detail": f"{seq} {back}"}], self.use_pandas)


class LongList(_Base):
    """(ListStateLargeListProcessor) 100 elements with a null field at first (put for keys ending
    in 0, appendList otherwise), then 90 more each batch; the size kept in a value state."""

    def init(self, handle) -> None:
        self.items = handle.getListState("items", StructType([StructField("value", IntegerType()),
                                                              StructField("valueNull", IntegerType())]))
        self.size = handle.getValueState("size", StructType([StructField("size", IntegerType())]))

    def handleInputRows(self, key, rows, timerValues) -> Iterator:
        _rows(rows, self.use_pandas)
        have = list(self.items.get())
        if not have:
            assert self.size.get() is None
            new = [(i, None) for i in range(100)]
            total = 100
        else:
            total = self.size.get()[0]
            assert have == [(i, None) for i in range(total)], have[:3]
            new = [(i, None) for i in range(total + 90)] if _ends(key, "0") else \
                [(i, None) for i in range(total, total + 90)]
            total += 90
        if _ends(key, "0"):
            self.items.put(new)
        else:
            self.items.appendList(new)
        self.size.update((total,))
        prev = ",".join(str(v[0]) for v in have)
        now = ",".join(str(v[0]) for v in self.items.get())
        return _emit([{"id": key[0], "n": total, "detail": f"{prev}->{now}"}], self.use_pandas)


class MapOps(_Base):
    """(MapStateProcessor; with `ttl_ms`, MapStateLargeTTLProcessor) updateValue, containsKey,
    getValue, keys, values, iterator, removeKey, exists and clear; cleared once a key's count
    passes 3, so values also carry over batches."""

    def __init__(self, use_pandas: bool, ttl_ms: Optional[int] = None):
        super().__init__(use_pandas)
        self.ttl_ms = ttl_ms

    def init(self, handle) -> None:
        if self.ttl_ms is None:
            self.m = handle.getMapState("counts", "name string", "count int")
        else:
            self.m = handle.getMapState("counts", StructType([StructField("name", StringType())]),
                                        StructType([StructField("count", IntegerType())]), self.ttl_ms)
            self.unused = handle.getListState("unused", StructType([StructField("name", StringType())]))

    def handleInputRows(self, key, rows, timerValues) -> Iterator:
        n = len(_rows(rows, self.use_pandas))
        fresh = not self.m.exists()
        k1, k2 = ("key1",), ("key2",)
        v1 = n + (self.m.getValue(k1)[0] if self.m.containsKey(k1) else 0)
        v2 = n + (self.m.getValue(k2)[0] if self.m.containsKey(k2) else 0)
        self.m.updateValue(k1, (v1,))
        self.m.updateValue(k2, (v2,))
        # iteration order: Spark's is its binary key encoding's (same-length strings: sorted), dstl's
        # insertion order; the same for a map filled in sorted order (docs/streaming.md)
        order = list if fresh else sorted
        seen = [order(self.m.keys()), order(self.m.values()), order(self.m.iterator())]
        self.m.removeKey(k1)
        seen += [self.m.containsKey(k1), self.m.exists(), self.m.getValue(k1)]
        if v2 > 3:
            self.m.clear()
            seen += ["cleared", self.m.exists(), list(self.m.keys())]
        self.m.updateValue(k1, (v1,))
        return _emit([{"id": key[0], "n": v1, "detail": repr(seen)}], self.use_pandas)


class LargeValues(_Base):
    """(LargeValueStatefulProcessor) 512 KiB strings in value, list and map state."""

    def init(self, handle) -> None:
        one = StructType([StructField("value", StringType())])
        self.v = handle.getValueState("v", one)
        self.l = handle.getListState("l", one)
        self.m = handle.getMapState("m", "key string", "value string")

    def handleInputRows(self, key, rows, timerValues) -> Iterator:
        n = len(_rows(rows, self.use_pandas))
        big = str(n % 10) * (512 * 1024)
        self.v.update((big,))
        self.l.put([(big,), (big + "b",), (big + "c",)])
        self.m.updateValue(("big",), (big,))
        got = ",".join([self.v.get()[0]] + [x[0] for x in self.l.get()] + [self.m.getValue(("big",))[0]])
        return _emit([{"id": key[0], "n": len(got), "detail": got}], self.use_pandas)


class TopK(_Base):
    """(TopKProcessor) The two highest scores per key in a list state, one output row each."""

    def init(self, handle) -> None:
        self.top = handle.getListState("top", StructType([StructField("score", LongType())]))

    def handleInputRows(self, key, rows, timerValues) -> Iterator:
        scores = [t[0] for t in self.top.get()] + [int(r.temperature) for r in _rows(rows, self.use_pandas)]
        best = sorted(scores, reverse=True)[:2]
        self.top.put([(s,) for s in best])
        return _emit([{"id": key[0], "n": s, "detail": f"rank{i}"} for i, s in enumerate(best)], self.use_pandas)


class WordCounts(_Base):
    """(WordFrequencyProcessor) A map state word -> count, one output row per input row."""

    def init(self, handle) -> None:
        self.freq = handle.getMapState("freq", "word string", "count long")

    def handleInputRows(self, key, rows, timerValues) -> Iterator:
        out = []
        for r in _rows(rows, self.use_pandas):
            w = (r.word,)
            c = (self.freq.getValue(w)[0] if self.freq.containsKey(w) else 0) + 1
            self.freq.updateValue(w, (c,))
            out.append({"id": key[0], "n": c, "detail": r.word})
        return _emit(out, self.use_pandas)


class Commands(_Base):
    """(AllMethodsTestProcessor) Each input row is a command on value, list or map state; one
    output row per command with what it saw."""

    def init(self, handle) -> None:
        self.v = handle.getValueState("v", StructType([StructField("value", IntegerType())]))
        self.l = handle.getListState("l", StructType([StructField("value", StringType())]))
        self.m = handle.getMapState("m", "key string", "value long")

    def _run(self, cmd: str) -> str:
        if cmd == "value-exists":
            return str(self.v.exists())
        if cmd == "value-set":
            self.v.update((42,))
        elif cmd == "value-get":
            return repr(self.v.get())
        elif cmd == "value-clear":
            self.v.clear()
        elif cmd == "list-exists":
            return str(self.l.exists())
        elif cmd == "list-append":
            self.l.appendValue(("a",))
            self.l.appendValue(("b",))
        elif cmd == "list-append-array":
            self.l.appendList([("c",), ("d",)])
        elif cmd == "list-get":
            return ",".join(x[0] for x in self.l.get())
        elif cmd == "list-clear":
            self.l.clear()
        elif cmd == "map-exists":
            return str(self.m.exists())
        elif cmd == "map-add":
            for i, k in enumerate("xyz"):
                self.m.updateValue((k,), (i + 1,))
        elif cmd == "map-keys":
            return ",".join(sorted(k[0] for k in self.m.keys()))
        elif cmd == "map-values":
            return ",".join(sorted(str(v[0]) for v in self.m.values()))
        elif cmd == "map-iterator":
            return ",".join(sorted(f"{k[0]}={v[0]}" for k, v in self.m.iterator()))
        elif cmd == "map-remove":
            self.m.removeKey(("y",))
        elif cmd == "map-clear":
            self.m.clear()
        else:
            raise AssertionError(f"unknown command {cmd}")
        return "done"

    def handleInputRows(self, key, rows, timerValues) -> Iterator:
        out = [{"id": key[0], "n": i, "detail": f"{r.cmd}:{self._run(r.cmd)}"}
               for i, r in enumerate(_rows(rows, self.use_pandas))]
        return _emit(out, self.use_pandas)


class _Road(NamedTuple):
    road_id: int
    city: str


NESTED = StructType([
    StructField("ids", ArrayType(IntegerType())),
    StructField("tags", ArrayType(ArrayType(StringType()))),
    StructField("meta", ArrayType(StructType([StructField("key", StringType()), StructField("value", StringType())]))),
    StructField("roads", ArrayType(StructType([StructField("road_id", IntegerType()),
                                               StructField("city", StringType())]))),
])
NESTED_MAP = StructType([
    StructField("id", IntegerType()),
    StructField("attributes", MapType(StringType(), ArrayType(IntegerType()))),
    StructField("confs", MapType(StringType(), MapType(StringType(), IntegerType()))),
])


class NestedShapes(_Base):
    """(StatefulProcessorCompositeType) Arrays of arrays, arrays of structs written as dicts and
    named tuples, maps of arrays and maps of maps in value, list and map state; what comes back
    (lists, Rows, dicts) is changed in place and written again."""

    TAGS = [["t1", "t2"], ["t3"]]
    META = [{"key": "env", "value": "prod"}, {"key": "zone", "value": "eu"}]
    ROADS = [_Road(1, "Oslo"), _Road(4, "Bergen")]

    def init(self, handle) -> None:
        self.obj = handle.getValueState("obj", NESTED)
        self.objs = handle.getListState("objs", NESTED)
        self.by_name = handle.getMapState("by_name", "name string", NESTED_MAP)

    def handleInputRows(self, key, rows, timerValues) -> Iterator:
        total = sum(int(r.temperature) for r in _rows(rows, self.use_pandas))
        if self.obj.exists():
            ids, tags, meta, roads = self.obj.get()
            assert tags == self.TAGS and meta == [Row(**m) for m in self.META], (tags, meta)
            assert roads == [Row(road_id=r.road_id, city=r.city) for r in self.ROADS], roads
            ids = [i + total for i in ids]
        else:
            ids = [0]
        self.obj.update((ids, self.TAGS, self.META, self.ROADS))
        again = []
        for ids_l, tags, meta, roads in self.objs.get():
            ids_l.append(total)
            again.append((ids_l, tags, [m.asDict() for m in meta], roads))
        self.objs.put(again or [(ids, self.TAGS, self.META, self.ROADS)])
        name = (str(key[0]),)
        if self.by_name.containsKey(name):
            i, attrs, confs = self.by_name.getValue(name)
            attrs[name[0]] = [total]
            confs.setdefault("e1", {})[name[0]] = total
            self.by_name.updateValue(name, (i + 1, attrs, confs))
        else:
            self.by_name.updateValue(name, (0, {"k1": [1], "k2": [10, None]}, {"e1": {"e2": 5}}))
        i, attrs, confs = self.by_name.getValue(name)
        listed = [x for o in self.objs.get() for x in o[0]]
        detail = json.dumps([ids, listed, i, attrs, confs], sort_keys=True)
        return _emit([{"id": key[0], "n": total, "detail": detail}], self.use_pandas)


INNER = "struct<intValue:int,doubleValue:double,arrayValue:array<string>,mapValue:map<string,string>>"


class CompositeOutput(_Base):
    """(CompositeOutputProcessor) A count in value state; output columns of arrays and maps of
    primitives and of structs, built from the count."""

    def init(self, handle) -> None:
        self.count = handle.getValueState("count", StructType([StructField("value", IntegerType())]))

    def handleInputRows(self, key, rows, timerValues) -> Iterator:
        n = (self.count.get()[0] if self.count.exists() else 0) + len(_rows(rows, self.use_pandas))
        self.count.update((n,))

        def inner(i, scale):
            d = {"intValue": i * scale, "doubleValue": i * 1.5 * scale,
                 "arrayValue": [f"e{i}_{j}" for j in range(i + 1)],
                 "mapValue": {f"m{i}_{j}": f"v{i}_{j}" for j in range(i + 1)}}
            return d if self.use_pandas else Row(**d)

        return _emit([{"id": key[0], "n": n, "detail": f"key_{key[0]}_count_{n}",
                       "listOfPrimitive": [f"item_{i}" for i in range(n)],
                       "mapOfPrimitive": {f"key{i}": f"value{i}" for i in range(n)},
                       "listOfComposite": [inner(i, 1) for i in range(n)],
                       "mapOfComposite": {f"nested{i}": inner(i, 10) for i in range(n)}}], self.use_pandas)


STATE_API_OUTPUT = (f"id string, n long, detail string, listOfPrimitive array<string>, "
                    f"mapOfPrimitive map<string,string>, listOfComposite array<{INNER}>, "
                    f"mapOfComposite map<string,{INNER}>")


def state_api(use_pandas: bool) -> Multiplex:
    p = use_pandas
    return Multiplex({"missing": MissingValue(p), "list": ListOps(p), "longlist": LongList(p), "map": MapOps(p),
                      "large": LargeValues(p), "topk": TopK(p), "words": WordCounts(p), "cmds": Commands(p),
                      "nested": NestedShapes(p), "out": CompositeOutput(p), "notnull": NotNullFields(p)},
                     STATE_API_OUTPUT, p)


# ------------------------------------------------------------------ processing time: TTL, sessions, initial state

class SessionTimeout(_Base):
    """(SessionTimeoutProcessor) Each input moves the key's processing-time timer to 1 s after
    the batch; a timer that fires ends the session."""

    TIMEOUT_MS = 1000

    def init(self, handle) -> None:
        self.handle = handle
        self.last = handle.getValueState("last", StructType([StructField("lastSeen", LongType())]))

    def handleInputRows(self, key, rows, timerValues) -> Iterator:
        now = timerValues.getCurrentProcessingTimeInMs()
        if self.last.exists():
            self.handle.deleteTimer(self.last.get()[0] + self.TIMEOUT_MS)
        self.last.update((now,))
        self.handle.registerTimer(now + self.TIMEOUT_MS)
        return _emit([{"id": key[0], "n": int(r.temperature), "detail": "received"}
                      for r in _rows(rows, self.use_pandas)], self.use_pandas)

    def handleExpiredTimer(self, key, timerValues, expiredTimerInfo) -> Iterator:
        self.last.clear()
        return _emit([{"id": key[0], "n": None, "detail": "session-expired"}], self.use_pandas)


class RunningCount(_Base):
    """(RunningCountStatefulProcessor) A count per key, seeded by the initial state."""

    def init(self, handle) -> None:
        self.count = handle.getValueState("count", StructType([StructField("value", IntegerType())]))

    def handleInitialState(self, key, initialState, timerValues) -> None:
        first = initialState.at[0, "initial_count"] if self.use_pandas else initialState.initial_count
        self.count.update((int(first),))

    def handleInputRows(self, key, rows, timerValues) -> Iterator:
        n = (self.count.get()[0] if self.count.exists() else 0) + len(_rows(rows, self.use_pandas))
        self.count.update((n,))
        return _emit([{"id": key[0], "n": n, "detail": "count"}], self.use_pandas)


PROC_TIME_OUTPUT = "id string, n long, detail string"


def proc_time(use_pandas: bool) -> Multiplex:
    p = use_pandas
    return Multiplex({"listttl": ListOps(p, ttl_ms=30_000), "mapttl": MapOps(p, ttl_ms=31_536_000_000),
                      "session": SessionTimeout(p), "running": RunningCount(p)}, PROC_TIME_OUTPUT, p)


# ------------------------------------------------------------------ watermarks

class MinEventTime(_Base):
    """(MinEventTimeStatefulProcessor) The smallest event time (seconds) per key; outside EventTime
    mode a watermark on the input drops nothing."""

    OUTPUT = "id string, timestamp string"

    def init(self, handle) -> None:
        self.low = handle.getValueState("low", StructType([StructField("value", StringType())]))

    def handleInputRows(self, key, rows, timerValues) -> Iterator:
        seconds = [int(r.eventTime.timestamp()) for r in _rows(rows, self.use_pandas)]
        low = min(seconds + ([int(self.low.get()[0])] if self.low.exists() else []))
        self.low.update((str(low),))
        return _emit([{"id": key[0], "timestamp": str(low)}], self.use_pandas)


class EventTimeSession(_Base):
    """(EventTimeSessionProcessor) Per input row, the key's event-time timer moves to 5 s after the
    row's event time; it fires once the watermark passes it."""

    OUTPUT = "id string, result string"

    def init(self, handle) -> None:
        self.handle = handle
        self.last = handle.getValueState("last", StructType([StructField("lastEventTime", LongType())]))

    def handleInputRows(self, key, rows, timerValues) -> Iterator:
        out = []
        for r in _rows(rows, self.use_pandas):
            ms = int(r.eventTime.timestamp() * 1000)
            if self.last.exists():
                self.handle.deleteTimer(self.last.get()[0] + 5000)
            self.last.update((ms,))
            self.handle.registerTimer(ms + 5000)
            out.append({"id": key[0], "result": f"received@{ms}"})
        return _emit(out, self.use_pandas)

    def handleExpiredTimer(self, key, timerValues, expiredTimerInfo) -> Iterator:
        self.last.clear()
        return _emit([{"id": key[0], "result": f"expired@watermark={timerValues.getCurrentWatermarkInMs()}"}],
                     self.use_pandas)


# ------------------------------------------------------------------ pandas chunks

class ChunkCount(_Base):
    """(ChunkCountProcessor; with `seeded`, ChunkCountWithInitialStateProcessor) How many
    DataFrames the key's rows came in (pandas flavour)."""

    def __init__(self, use_pandas: bool, seeded: bool = False):
        super().__init__(use_pandas)
        self.seeded = seeded

    def init(self, handle) -> None:
        if self.seeded:
            self.v = handle.getValueState("v", StructType([StructField("value", IntegerType())]))

    def handleInitialState(self, key, initialState, timerValues) -> None:
        self.v.update((int(initialState.at[0, "initVal"]),))

    def handleInputRows(self, key, rows, timerValues) -> Iterator:
        chunks = sum(1 for _ in rows)
        seed = self.v.get()[0] if self.seeded and self.v.exists() else None
        return _emit([{"id": key[0], "n": chunks, "detail": str(seed)}], self.use_pandas)


def chunks(use_pandas: bool) -> Multiplex:
    return Multiplex({"plain": ChunkCount(use_pandas), "init": ChunkCount(use_pandas, seeded=True)},
                     PROC_TIME_OUTPUT, use_pandas)


# ------------------------------------------------------------------ schema evolution (one stage per batch)

def _evolving(fields, update):
    schema = StructType(fields)
    ddl = "id string, value struct<" + ",".join(f"{f.name}:{f.dataType.simpleString()}" for f in fields) + ">"

    class Evolving(_Base):
        OUTPUT = ddl

        def init(self, handle) -> None:
            self.state = handle.getValueState("state", schema)

        def handleInputRows(self, key, rows, timerValues) -> Iterator:
            _rows(rows, self.use_pandas)
            old = self.state.get() if self.state.exists() else None
            new = update(int(key[0]), old)
            self.state.update(tuple(new[f.name] for f in fields))
            value = dict(old.asDict() if hasattr(old, "asDict") else zip([f.name for f in fields], old)) \
                if old is not None else None
            value = new if value is None else {f.name: value.get(f.name) for f in fields}
            return _emit([{"id": key[0], "value": value if self.use_pandas else Row(**value)}], self.use_pandas)

    Evolving.__name__ = Evolving.__qualname__ = "Evolving_" + "_".join(f.name for f in fields)
    return Evolving


_ID, _NAME = StructField("id", IntegerType()), StructField("name", StringType())
_COUNT, _ACTIVE, _SCORE = StructField("count", IntegerType()), StructField("active", BooleanType()), \
    StructField("score", FloatType())


def _basic(k, old):
    return {"id": k, "name": f"name-{k}"}


def _added(k, old):
    if old is None:
        return {"id": k, "name": f"name-{k}", "count": 100, "active": True, "score": 99.5}
    return {"id": old[0], "name": old[1] + "0", "count": old[2], "active": old[3], "score": old[4]}


def _removed(k, old):
    return {"id": k, "name": old[1] if old is not None else f"name-{k}"}


def _reordered(k, old):
    if old is None:
        return {"name": f"name-{k}", "id": k, "score": 99.5, "count": 100, "active": True}
    return {"name": old[0] + "!", "id": old[1], "score": old[2], "count": old[3], "active": old[4]}


def _upcast(k, old):
    return {"id": k + (old[0] + 1 if old is not None else 0), "name": f"name-{k}"}


#: (BasicProcessor, AddFieldsProcessor, RemoveFieldsProcessor, ReorderedFieldsProcessor,
#: UpcastProcessor) one state's schema evolving over five runs of the same job
EVOLUTION = [
    _evolving([_ID, _NAME], _basic),
    _evolving([_ID, _NAME, _COUNT, _ACTIVE, _SCORE], _added),
    _evolving([_ID, _NAME], _removed),
    _evolving([_NAME, _ID, _SCORE, _COUNT, _ACTIVE], _reordered),
    _evolving([StructField("id", LongType()), _NAME], _upcast),
]
