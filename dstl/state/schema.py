"""Declared value schemas: a Spark StructType or DDL string <-> the tuples a state stores.

A `StatefulProcessor` declares each state's layout (`getValueState("count", "value long")`) and
reads and writes tuples of that layout. `ValueSchema` turns such a tuple into what the changelog
stores (a msgpack list of plain scalars) and back:

* numpy scalars become Python scalars (a processor often writes ``pdf["x"].sum()``);
* timestamps are stored as microseconds since the epoch, dates as days, decimals as strings;
  they read back as `datetime` (naive, UTC, as PySpark returns them), `date` and `Decimal`;
* nested structs are lists, arrays lists, maps lists of ``[key, value]`` pairs.

A map state's *user key* must be a msgpack scalar in the backend: a one-field key schema stores the
field itself, a wider one the msgpack bytes of its encoded list.

`to_record()` is the JSON-friendly description recorded with every checkpoint (the job's
``state_schemas`` property), so tools can show a state's value columns.

Only pure Python here: pyspark is needed only to parse a DDL string or a StructType.
"""
from __future__ import annotations

import datetime as _dt
import decimal
import json
import re
from typing import Any, Callable, Dict, List, Optional, Sequence, Tuple

import msgpack
import numpy as np

_EPOCH = _dt.datetime(1970, 1, 1)
_EPOCH_DATE = _dt.date(1970, 1, 1)

__all__ = ["ValueSchema", "StateSchema", "parse_schema"]


def _to_spark_type(schema: Any):
    """A StructType from a StructType, a DataType, a DDL string or the JSON record of one."""
    from pyspark.sql.types import DataType, StructField, StructType

    if isinstance(schema, StructType):
        return schema
    if isinstance(schema, DataType):  # a bare type: one field named "value", as Spark does
        return StructType([StructField("value", schema)])
    if isinstance(schema, dict):
        return StructType.fromJson(schema)
    if isinstance(schema, str):
        text = schema.strip()
        if not text:
            raise ValueError("a state schema must not be empty")
        try:  # pure Python: Spark's own parser needs a SparkContext, which a worker has not
            parsed = parse_ddl(text)
        except ValueError as exc:
            raise ValueError(f"state schema {schema!r} is not a valid DDL string: {exc}") from None
        if isinstance(parsed, StructType):
            return parsed
        return StructType([StructField("value", parsed)])
    raise TypeError(f"a state schema is a StructType or a DDL string, got {type(schema).__name__}")


_SIMPLE = {
    "string": "StringType", "varchar": "StringType", "char": "StringType", "long": "LongType",
    "bigint": "LongType", "int": "IntegerType", "integer": "IntegerType", "short": "ShortType",
    "smallint": "ShortType", "byte": "ByteType", "tinyint": "ByteType", "double": "DoubleType",
    "float": "FloatType", "real": "FloatType", "boolean": "BooleanType", "bool": "BooleanType",
    "binary": "BinaryType", "timestamp": "TimestampType", "timestamp_ltz": "TimestampType",
    "timestamp_ntz": "TimestampNTZType", "date": "DateType",
}
_TOKEN = re.compile(r"\s*(?:(`(?:[^`]|``)*`)|([A-Za-z_][A-Za-z0-9_]*)|(\d+)|([<>(),:]))")


def parse_ddl(text: str):
    """Spark DDL ("a long, b struct<x: int, y: array<string>>" or a single type) -> StructType
    or DataType, without a SparkContext."""
    from pyspark.sql import types as T

    toks: List[str] = []
    pos = 0
    while pos < len(text):
        m = _TOKEN.match(text, pos)
        if not m or m.end() == pos:
            if text[pos:].strip() == "":
                break
            raise ValueError(f"unexpected {text[pos:pos + 10]!r}")
        pos = m.end()
        tok = next(g for g in m.groups() if g is not None)
        toks.append(tok)
    i = 0

    def peek() -> Optional[str]:
        return toks[i] if i < len(toks) else None

    def take(expected: Optional[str] = None) -> str:
        nonlocal i
        if i >= len(toks):
            raise ValueError("unexpected end")
        t = toks[i]
        if expected is not None and t.lower() != expected:
            raise ValueError(f"expected {expected!r}, got {t!r}")
        i += 1
        return t

    def name() -> str:
        t = take()
        return t[1:-1].replace("``", "`") if t.startswith("`") else t

    def dtype():
        t = take().lower()
        if t in _SIMPLE:
            if t in ("varchar", "char") and peek() == "(":
                take("("), take(), take(")")
            return getattr(T, _SIMPLE[t])()
        if t in ("decimal", "dec", "numeric"):
            if peek() == "(":
                take("(")
                p = int(take())
                sc = 0
                if peek() == ",":
                    take(",")
                    sc = int(take())
                take(")")
                return T.DecimalType(p, sc)
            return T.DecimalType()
        if t == "array":
            take("<")
            e = dtype()
            take(">")
            return T.ArrayType(e)
        if t == "map":
            take("<")
            k = dtype()
            take(",")
            v = dtype()
            take(">")
            return T.MapType(k, v)
        if t == "struct":
            take("<")
            fields = []
            while peek() != ">":
                fields.append(field())
                if peek() == ",":
                    take(",")
            take(">")
            return T.StructType(fields)
        raise ValueError(f"unknown type {t!r}")

    def field():
        n = name()
        if peek() == ":":
            take(":")
        return T.StructField(n, dtype(), True)

    # a single type ("long", "array<int>") or a field list ("a long, b string")
    if len(toks) >= 1 and toks[0].lower() in set(_SIMPLE) | {"decimal", "dec", "numeric", "array", "map", "struct"} \
            and (len(toks) == 1 or toks[1] in ("<", "(")):
        single = dtype()
        if i == len(toks):
            return single
        i = 0
    fields = []
    while i < len(toks):
        fields.append(field())
        if i < len(toks):
            take(",")
    if not fields:
        raise ValueError("no fields")
    return T.StructType(fields)


def _codec(dt) -> Tuple[Callable[[Any], Any], Callable[[Any], Any]]:
    """(encode, decode) for one Spark DataType."""
    from pyspark.sql import types as T

    if isinstance(dt, T.StructType):
        # a nested struct comes back as a Row, as Spark's state clients return it
        inner = ValueSchema(dt)
        make_row = T.Row(*inner.names)
        return (lambda v: None if v is None else inner.encode(v),
                lambda w: None if w is None else make_row(*inner.decode(w)))
    if isinstance(dt, T.ArrayType):
        enc, dec = _codec(dt.elementType)
        return (lambda v: None if v is None else [enc(x) for x in v],
                lambda w: None if w is None else [dec(x) for x in w])
    if isinstance(dt, T.MapType):
        ke, kd = _codec(dt.keyType)
        ve, vd = _codec(dt.valueType)
        return (lambda v: None if v is None else [[ke(k), ve(x)] for k, x in dict(v).items()],
                lambda w: None if w is None else {kd(k): vd(x) for k, x in w})
    if isinstance(dt, (T.TimestampType, T.TimestampNTZType)):
        return _enc_ts, _dec_ts
    if isinstance(dt, T.DateType):
        return _enc_date, _dec_date
    if isinstance(dt, T.DecimalType):
        return (lambda v: None if v is None else str(v),
                lambda w: None if w is None else decimal.Decimal(w))
    if isinstance(dt, (T.ByteType, T.ShortType, T.IntegerType, T.LongType)):
        return _enc_int, _identity
    if isinstance(dt, (T.FloatType, T.DoubleType)):
        return _enc_float, _identity
    if isinstance(dt, T.BooleanType):
        return _enc_bool, _identity
    if isinstance(dt, T.StringType):
        return _enc_str, _identity
    if isinstance(dt, T.BinaryType):
        return _enc_bytes, _identity
    raise TypeError(f"state schemas do not support the type {dt.simpleString()}")


def _identity(w: Any) -> Any:
    return w


def _scalar(v: Any) -> Any:
    return v.item() if isinstance(v, np.generic) else v


def _enc_int(v: Any) -> Any:
    v = _scalar(v)
    if v is None:
        return None
    if isinstance(v, bool) or not isinstance(v, int):
        if isinstance(v, float) and v.is_integer():
            return int(v)
        raise TypeError(f"expected an integer, got {type(v).__name__} {v!r}")
    return v


def _enc_float(v: Any) -> Any:
    v = _scalar(v)
    if v is None:
        return None
    if isinstance(v, bool) or not isinstance(v, (int, float)):
        raise TypeError(f"expected a number, got {type(v).__name__} {v!r}")
    return float(v)


def _enc_bool(v: Any) -> Any:
    v = _scalar(v)
    if v is None or isinstance(v, bool):
        return v
    raise TypeError(f"expected a bool, got {type(v).__name__} {v!r}")


def _enc_str(v: Any) -> Any:
    v = _scalar(v)
    if v is None or isinstance(v, str):
        return v
    raise TypeError(f"expected a str, got {type(v).__name__} {v!r}")


def _enc_bytes(v: Any) -> Any:
    v = _scalar(v)
    if v is None:
        return None
    if isinstance(v, (bytes, bytearray, memoryview)):
        return bytes(v)
    raise TypeError(f"expected bytes, got {type(v).__name__} {v!r}")


def _enc_ts(v: Any) -> Any:
    if v is None:
        return None
    if isinstance(v, np.datetime64):
        return int(v.astype("datetime64[us]").astype(np.int64))
    if hasattr(v, "to_pydatetime"):  # pandas Timestamp
        v = v.to_pydatetime()
    if isinstance(v, _dt.datetime):
        if v.tzinfo is not None:
            v = v.astimezone(_dt.timezone.utc).replace(tzinfo=None)
        d = v - _EPOCH
        return (d.days * 86400 + d.seconds) * 1_000_000 + d.microseconds
    raise TypeError(f"expected a datetime, got {type(v).__name__} {v!r}")


def _dec_ts(w: Any) -> Any:
    return None if w is None else _EPOCH + _dt.timedelta(microseconds=w)


def _enc_date(v: Any) -> Any:
    if v is None:
        return None
    if isinstance(v, _dt.datetime):
        v = v.date()
    if isinstance(v, _dt.date):
        return (v - _EPOCH_DATE).days
    raise TypeError(f"expected a date, got {type(v).__name__} {v!r}")


def _dec_date(w: Any) -> Any:
    return None if w is None else _EPOCH_DATE + _dt.timedelta(days=w)


class ValueSchema:
    """One declared layout: encode a tuple to its stored list and decode it back to a tuple."""

    def __init__(self, schema: Any):
        self.struct = _to_spark_type(schema)
        self.names: List[str] = [f.name for f in self.struct.fields]
        codecs = [_codec(f.dataType) for f in self.struct.fields]
        self._enc = [c[0] for c in codecs]
        self._dec = [c[1] for c in codecs]
        self._n = len(codecs)
        from pyspark.sql import types as T

        # a one-field scalar key is stored as itself; anything wider as msgpack bytes
        self._scalar_key = self._n == 1 and not isinstance(
            self.struct.fields[0].dataType, (T.StructType, T.ArrayType, T.MapType))

    def encode(self, value: Any) -> list:
        """A tuple (or list, or Row) of the declared fields -> the stored list."""
        if value is None:
            raise TypeError(f"a state value must be a tuple of ({', '.join(self.names)}), got None")
        if isinstance(value, dict):
            value = tuple(value.get(n) for n in self.names)
        elif not isinstance(value, (tuple, list)):
            if self._n == 1:  # a bare scalar for a one-field schema: forgiving, as a user expects
                value = (value,)
            else:
                raise TypeError(f"a state value must be a tuple of ({', '.join(self.names)}), "
                                f"got {type(value).__name__}")
        if len(value) != self._n:
            raise ValueError(f"a state value must have {self._n} field(s) ({', '.join(self.names)}), "
                             f"got {len(value)}: {tuple(value)!r:.120}")
        out = []
        for name, enc, v in zip(self.names, self._enc, value):
            try:
                out.append(enc(v))
            except TypeError as exc:
                raise TypeError(f"field {name!r}: {exc}") from None
        return out

    def decode(self, stored: Sequence[Any]) -> tuple:
        return tuple(dec(w) for dec, w in zip(self._dec, stored))

    # map user keys must be msgpack scalars in the backend
    def encode_key(self, value: Any) -> Any:
        enc = self.encode(value)
        return enc[0] if self._scalar_key else msgpack.packb(enc, use_bin_type=True)

    def decode_key(self, stored: Any) -> tuple:
        return self.decode([stored] if self._scalar_key else msgpack.unpackb(stored, raw=False))

    def ddl(self) -> str:
        return ", ".join(f"{f.name} {f.dataType.simpleString()}" for f in self.struct.fields)

    def to_record(self) -> Dict[str, Any]:
        return json.loads(self.struct.json())

    def __eq__(self, other: Any) -> bool:
        return isinstance(other, ValueSchema) and self.struct == other.struct

    def __repr__(self) -> str:
        return f"ValueSchema({self.ddl()!r})"


def parse_schema(schema: Any) -> ValueSchema:
    """A ValueSchema from a StructType, a DDL string or a recorded schema."""
    return schema if isinstance(schema, ValueSchema) else ValueSchema(schema)


class StateSchema:
    """What a job records about one declared state: kind, value (and user key) schema, TTL."""

    def __init__(self, name: str, kind: str, value: Any, user_key: Any = None,
                 ttl_ms: Optional[int] = None):
        if kind not in ("value", "list", "map"):
            raise ValueError(f"state kind must be value, list or map, got {kind!r}")
        if kind == "map" and user_key is None:
            raise ValueError(f"map state {name!r} needs a user key schema")
        if ttl_ms is not None and (isinstance(ttl_ms, bool) or not isinstance(ttl_ms, (int, np.integer))
                                   or int(ttl_ms) <= 0):
            raise ValueError(f"state {name!r}: ttlDurationMs must be a positive int or None, got {ttl_ms!r}")
        self.name = name
        self.kind = kind
        self.value = parse_schema(value)
        self.user_key = parse_schema(user_key) if user_key is not None else None
        self.ttl_ms = None if ttl_ms is None else int(ttl_ms)

    def to_record(self) -> Dict[str, Any]:
        rec: Dict[str, Any] = {"kind": self.kind, "value": self.value.to_record(),
                               "value_ddl": self.value.ddl(), "ttl_ms": self.ttl_ms}
        if self.user_key is not None:
            rec["user_key"] = self.user_key.to_record()
            rec["user_key_ddl"] = self.user_key.ddl()
        return rec

    @classmethod
    def from_record(cls, name: str, rec: Dict[str, Any]) -> "StateSchema":
        return cls(name, rec["kind"], rec["value"], rec.get("user_key"), rec.get("ttl_ms"))

    def __repr__(self) -> str:
        extra = f", user_key={self.user_key.ddl()!r}" if self.user_key else ""
        return f"StateSchema({self.name!r}, {self.kind}, {self.value.ddl()!r}{extra}, ttl_ms={self.ttl_ms})"
