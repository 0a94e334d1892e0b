"""`Counting`, the StatefulProcessor of the in-process stream tests (value, list and map state)."""
from __future__ import annotations

import pandas as pd
from pyspark.sql.streaming.stateful_processor import StatefulProcessor

OUT = "user string, n long, items long, buckets long, evens long"


class Counting(StatefulProcessor):
    """Per user: a count (value), every value seen (list) and a count per parity (map)."""

    def init(self, handle):
        self.count = handle.getValueState("count", "n long")
        self.seen = handle.getListState("seen", "v long")
        self.parity = handle.getMapState("parity", "p string", "c long")

    def handleInputRows(self, key, rows, timerValues):
        n = self.count.get()[0] if self.count.exists() else 0
        for pdf in rows:
            n += len(pdf)
            self.seen.appendList([(v,) for v in pdf["v"].tolist()])
            for v in pdf["v"].tolist():
                p = ("even",) if v % 2 == 0 else ("odd",)
                old = self.parity.getValue(p)
                self.parity.updateValue(p, ((old[0] if old else 0) + 1,))
        self.count.update((n,))
        evens = self.parity.getValue(("even",))
        yield pd.DataFrame({"user": [key[0]], "n": [n], "items": [len(list(self.seen.get()))],
                            "buckets": [len(list(self.parity.keys()))], "evens": [evens[0] if evens else 0]})

    def close(self):
        pass

