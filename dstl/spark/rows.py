"""Rows in, Rows out: the data side of PySpark 4.1+'s Row-based `transformWithState`.

A processor written for ``groupBy(...).transformWithState(...)`` gets, per key, an iterator of
`pyspark.sql.Row` (every input column, named as in the DataFrame) and yields `Row`s, which Spark
matches to the output schema *by field name*. This module gives it exactly that on dstl, per
subtask and micro-batch, without a pandas object per key:

* `InputRows`: the subtask's rows (one pandas frame per subtask, as the task receives them) turned
  into Python values column by column (vectorised: ``tolist``), then into `Row`s of one shared
  class, grouped by key (keys sorted). Values are what Spark's Row mode hands out (pyarrow's
  ``as_py``): ints, floats, str, bool, `datetime` (timestamps aware, in the session time zone),
  `date`, `Decimal`, bytes, lists, dicts; a null is None (a NaN in a float column too: pandas
  cannot tell it from a null);
* `OutputRows`: every Row the handlers yield, gathered and turned into ONE Arrow record batch per
  subtask at the end (columns by name, as Spark does: a missing field is null, an extra one is
  ignored).

Only pure Python, pandas (per subtask) and pyarrow here; the state side is dstl.spark.processor.
"""
from __future__ import annotations

import datetime as _dt
import functools
import itertools
from typing import Any, Dict, Iterator, List, Optional, Sequence, Tuple
from zoneinfo import ZoneInfo

import numpy as np
import pandas as pd
import pyarrow as pa
import pyarrow.compute as pc
from pandas.api.types import infer_dtype

__all__ = ["InputRows", "OutputRows", "row_class"]


@functools.lru_cache(maxsize=64)
def row_class(names: Tuple[str, ...]) -> type:
    """A `Row` subclass whose field names are `names` (a class attribute): building a Row is then
    one tuple copy, and `row.user`, `row["user"]`, `asDict()` and pickling behave as for any Row.
    `row.user` is a direct item lookup instead of Row's search of its field list; a name Row
    already answers itself (`count`, `index`, `asDict`, dunders) is left to Row, as in Spark."""
    from pyspark.sql import Row  # PySpark

    def getter(i: int):
        return property(lambda row: tuple.__getitem__(row, i))  # Row.__getitem__ is Python, slower

    attrs: Dict[str, Any] = {"__fields__": list(names), "__module__": Row.__module__, "__slots__": ()}
    for i, name in enumerate(names):
        if name.isidentifier() and not name.startswith("__") and not hasattr(Row, name) and name not in attrs:
            attrs[name] = getter(i)
    return type("Row", (Row,), attrs)


# ------------------------------------------------------------------ input: pandas -> Python values

def _column_values(series, dtype, tz: Optional[str]) -> List[Any]:
    """One column as the Python values Spark's Row mode hands out for `dtype` (a Spark DataType;
    None: what the pandas column holds)."""
    from pyspark.sql import types as T  # PySpark

    arr = series.to_numpy()
    kind = arr.dtype.kind
    if isinstance(dtype, (T.ByteType, T.ShortType, T.IntegerType, T.LongType)) and kind == "f":
        # an integer column with nulls arrives as float with NaN
        null = np.isnan(arr)
        vals = arr.tolist()
        return [None if n else int(v) for v, n in zip(vals, null.tolist())]
    if kind in "iub":
        return arr.tolist()
    if kind == "f":
        null = np.isnan(arr)
        vals = arr.tolist()
        if null.any():
            for i in np.flatnonzero(null).tolist():
                vals[i] = None
        return vals
    if kind == "M":  # timestamps: Spark hands pandas naive values in the session time zone
        return _timestamps(series, isinstance(dtype, T.TimestampType) and tz or None)
    if dtype is not None and isinstance(dtype, (T.ArrayType, T.MapType, T.StructType)):
        # nested values (numpy arrays, dicts) -> what pyarrow's as_py gives: lists, dicts, pairs
        from pyspark.sql.pandas.types import to_arrow_type  # PySpark

        try:
            return pa.array(series, type=to_arrow_type(dtype), from_pandas=True).to_pylist()
        except (pa.ArrowInvalid, pa.ArrowTypeError, TypeError, ValueError):
            pass
    vals = arr.tolist()
    if kind == "O":  # strings, dates, decimals, bytes: None stays None, a stray NaN becomes None
        null = series.isna().to_numpy()
        if null.any():
            for i in np.flatnonzero(null).tolist():
                vals[i] = None
    return vals


def _timestamps(series, tz: Optional[str]) -> List[Any]:
    """Naive datetime64 values -> `datetime`s: aware in `tz` (Spark's TimestampType: the values are
    local times of the session time zone), naive without `tz` (TimestampNTZType). Localised by
    pyarrow in one vectorised call; pandas' own tz_localize with a ZoneInfo is 20x slower."""
    null = series.isna().to_numpy()
    if tz:
        aware = pc.assume_timezone(pa.array(series), timezone=tz, ambiguous="earliest", nonexistent="earliest")
        us = aware.cast(pa.timestamp("us", tz)).cast(pa.int64()).fill_null(0).to_numpy()
        zone, at = ZoneInfo(tz), _dt.datetime.fromtimestamp
        # exact: |us| < 2**53, and fromtimestamp rounds the float to the nearest microsecond
        vals = _per_distinct(us, lambda u: at(u / 1e6, zone))
    else:
        raw = series.to_numpy().astype("datetime64[us]").astype(np.int64)
        raw[null] = 0
        epoch, delta = _dt.datetime(1970, 1, 1), _dt.timedelta
        vals = _per_distinct(raw, lambda u: epoch + delta(microseconds=u))
    if null.any():
        for i in np.flatnonzero(null).tolist():
            vals[i] = None
    return vals


def _per_distinct(us, make) -> List[Any]:
    """`make(u)` for every int in `us`, called once per distinct value when values repeat (at most
    half are distinct), the result shared by the rows that carry it (datetimes are immutable): event
    times repeat a lot within a batch, and building the datetime is most of the cost."""
    uniq, inverse = np.unique(us, return_inverse=True)
    if 2 * len(uniq) > len(us):  # mostly distinct: the gather would cost more than it saves
        return [make(u) for u in us.tolist()]
    distinct = [make(u) for u in uniq.tolist()]
    return list(map(distinct.__getitem__, inverse.reshape(-1).tolist()))


def _key_order(keys) -> Tuple[Any, List[int]]:
    """(the row order that sorts `keys` stably, None when they already are; the start of each
    distinct key's run in that order, plus the end). Keys are hashed into codes in sorted order
    (pandas.factorize) and the int codes sorted, several times faster than sorting an object array
    of strings; keys factorize cannot order as numpy does (nulls, mixed types) take numpy's sort."""
    n = len(keys)
    codes = None
    if keys.dtype.kind in "iub" or (keys.dtype.kind == "O" and _all_str(keys)):
        codes, uniq = pd.factorize(keys, sort=True)
        if len(codes) and codes.min() < 0:
            codes = None
    if codes is None:
        order = np.argsort(keys, kind="stable")
        skeys = keys[order]
        cuts = (np.flatnonzero(skeys[1:] != skeys[:-1]) + 1).tolist() if n > 1 else []
        bounds = [0] + cuts + [n]
    else:
        order = np.argsort(codes, kind="stable")
        bounds = [0] + np.cumsum(np.bincount(codes, minlength=len(uniq))).tolist()
    if n < 2 or (order[1:] > order[:-1]).all():
        return None, bounds
    return order, bounds


def _all_str(values) -> bool:
    return infer_dtype(values, skipna=False) == "string"


class InputRows:
    """One subtask's rows as per-key lists of Rows (see the module docstring).

    `schema`: the Spark StructType of the rows (None: the pandas dtypes decide); `tz`: the session
    time zone, for timestamps."""

    def __init__(self, pdf, key_col: str, schema: Any = None, tz: Optional[str] = None, drop_key: bool = False):
        self.key_col = key_col
        n = len(pdf)
        if not n:
            self._keys: List[Any] = []
            self._rows: List[Any] = []
            self._bounds: List[int] = [0]
            return
        # the frame put in key order first (keys grouped by int codes, see _key_order; a take of the
        # frame is cheaper than gathering the Rows), then one tuple copy per Row, column-wise values
        order, bounds = _key_order(pdf[key_col].to_numpy())
        if order is not None:
            pdf = pdf.take(order)
        types = {f.name: f.dataType for f in schema.fields} if schema is not None else {}
        names = [str(c) for c in pdf.columns]
        if drop_key:  # the packed key of several key columns: grouped by, not part of the Rows
            kvals = pdf[key_col].tolist()
            keep = [i for i, c in enumerate(names) if c != key_col]
            names = [names[i] for i in keep]
            cols = [_column_values(pdf.iloc[:, i], types.get(str(pdf.columns[i])), tz) for i in keep]
        else:
            cols = [_column_values(pdf.iloc[:, i], types.get(c), tz) for i, c in enumerate(names)]
        cls = row_class(tuple(names))
        rows = list(map(tuple.__new__, itertools.repeat(cls, n), zip(*cols)))
        if not drop_key:
            kvals = cols[names.index(key_col)]
        self._keys = [kvals[i] for i in bounds[:-1]]
        self._rows = rows
        self._bounds = bounds

    def __len__(self) -> int:
        return len(self._rows)

    def groups(self) -> Iterator[Tuple[Any, List[Any]]]:
        """(key value, that key's Rows in arrival order) per distinct key, keys sorted."""
        rows, b = self._rows, self._bounds
        for i, k in enumerate(self._keys):
            yield k, rows[b[i]:b[i + 1]]


# ------------------------------------------------------------------ output: Rows -> one Arrow batch

def _plain(v: Any) -> Any:
    """Nested Rows as dicts (Spark converts output Rows with asDict(recursive=True))."""
    from pyspark.sql import Row  # PySpark

    if isinstance(v, Row):
        return v.asDict(True) if hasattr(v, "__fields__") else tuple(_plain(x) for x in v)
    if isinstance(v, list):
        return [_plain(x) for x in v]
    if isinstance(v, dict):
        return {k: _plain(x) for k, x in v.items()}
    return v


class OutputRows:
    """The Rows one subtask's handlers yield, as one Arrow record batch of `arrow_schema`."""

    def __init__(self, arrow_schema):
        from pyspark.sql import Row  # PySpark

        self._row = Row
        self.schema = arrow_schema
        self.names: List[str] = list(arrow_schema.names)
        self._names_t = tuple(self.names)
        self.rows: List[Any] = []

    def __len__(self) -> int:
        return len(self.rows)

    def extend(self, result: Any, where: str) -> None:
        """Gather what a handler returned (an iterator of Rows, or None)."""
        if result is None:
            return
        row, append = self._row, self.rows.append
        for item in result:
            if isinstance(item, row):
                append(item)
            elif item is None:
                continue
            else:
                raise TypeError(_wrong_item(item, where))

    def _columns(self) -> List[Sequence[Any]]:
        names, names_t, rows = self.names, self._names_t, self.rows
        fast = True
        for r in rows:
            f = r.__dict__.get("__fields__") or getattr(r, "__fields__", None)
            if f is None or not (f == names if type(f) is list else tuple(f) == names_t):
                fast = False
                break
        if fast:
            return list(zip(*rows)) if rows else [[] for _ in names]
        # by name, as Spark does: a field the schema lacks is ignored, a missing one is null
        dicts = []
        for r in rows:
            fields = getattr(r, "__fields__", None)
            if fields is None:  # a Row built positionally, Row(1, 2): Spark cannot name its fields
                raise TypeError(f"an output Row needs field names (Row(user=..., n=...)); got {r!r:.120}")
            dicts.append(dict(zip(fields, r)))
        return [[d.get(n) for d in dicts] for n in names]

    def to_batch(self):
        """One `pyarrow.RecordBatch` of every gathered Row (None when there is none)."""
        if not self.rows:
            return None
        cols = self._columns()
        arrays = []
        for field, col in zip(self.schema, cols):
            if pa.types.is_nested(field.type):
                col = [_plain(v) for v in col]
            try:
                arrays.append(pa.array(col, type=field.type))
            except (pa.ArrowInvalid, pa.ArrowTypeError, TypeError, ValueError, OverflowError) as exc:
                bad = next((v for v in col if not _fits(v, field.type)), None)
                raise TypeError(f"output field {field.name!r} ({field.type}): cannot take the value "
                                f"{bad!r:.80} ({exc})") from None
        return pa.RecordBatch.from_arrays(arrays, schema=self.schema)


def _fits(v: Any, arrow_type) -> bool:
    try:
        pa.array([v], type=arrow_type)
        return True
    except Exception:  # noqa: BLE001 - looking for the value to name in the error
        return False


def _wrong_item(item: Any, where: str) -> str:
    kind = type(item).__name__
    if type(item).__module__.startswith("pandas"):
        return (f"{where} yielded a pandas {kind}, but this StatefulStream runs the Row API "
                f"(api='row', as transformWithState); a processor written for "
                f"transformWithStateInPandas needs api='pandas'")
    return f"{where} must yield pyspark.sql.Row objects (api='row'), got {kind}: {item!r:.80}"

