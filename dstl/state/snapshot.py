"""What a checkpoint keeps of one keyed-state backend: materialized handles + the changelog since then."""
from __future__ import annotations

from typing import Any, Dict, List, Optional, Sequence

import msgpack

from dstl.types import KeyGroupRange


class KeyedStateSnapshot:
    """What a checkpoint keeps of one backend: materialized handles + the changelog since then.

    `materialized` is replayed first, in order, then `changelog` (None if nothing was logged).
    """

    __slots__ = ("key_group_range", "materialized", "changelog", "max_parallelism", "checkpoint_id")
    _VERSION = 1

    def __init__(self, key_group_range: KeyGroupRange, materialized: Sequence[Any], changelog: Any = None,
                 max_parallelism: Optional[int] = None, checkpoint_id: Optional[int] = None):
        if not isinstance(key_group_range, KeyGroupRange):
            raise ValueError(f"key_group_range must be a KeyGroupRange, got {type(key_group_range).__name__}")
        self.key_group_range = key_group_range
        self.materialized = list(materialized)
        self.changelog = changelog
        self.max_parallelism = max_parallelism
        self.checkpoint_id = checkpoint_id

    def handles(self) -> List[Any]:
        """Every handle in replay order."""
        return self.materialized + ([self.changelog] if self.changelog is not None else [])

    def files(self) -> List[str]:
        """Distinct files this snapshot needs (for retention / gc)."""
        seen: Dict[str, None] = {}
        for h in self.handles():
            for f in h.files():
                seen.setdefault(f, None)
        return list(seen)

    def to_bytes(self) -> bytes:
        return msgpack.packb({
            "v": self._VERSION, "kgr": [self.key_group_range.start, self.key_group_range.end],
            "max_parallelism": self.max_parallelism, "checkpoint_id": self.checkpoint_id,
            "materialized": [h.to_bytes() for h in self.materialized],
            "changelog": self.changelog.to_bytes() if self.changelog is not None else None,
        }, use_bin_type=True)

    @classmethod
    def from_bytes(cls, data: bytes) -> "KeyedStateSnapshot":
        from dstl.changelog.handles import ChangelogStateHandleStreamImpl as H

        try:
            d = msgpack.unpackb(data, raw=False, strict_map_key=False)
        except Exception as exc:
            raise ValueError(f"keyed state snapshot: not valid msgpack ({exc})") from exc
        if not isinstance(d, dict) or d.get("v") != cls._VERSION:
            raise ValueError(f"keyed state snapshot: unsupported content {str(d)[:80]!r}")
        try:
            start, end = d["kgr"]
            return cls(KeyGroupRange(start, end), [H.from_bytes(b) for b in d["materialized"]],
                       H.from_bytes(d["changelog"]) if d["changelog"] is not None else None,
                       d.get("max_parallelism"), d.get("checkpoint_id"))
        except (KeyError, TypeError) as exc:
            raise ValueError(f"keyed state snapshot: malformed ({exc!r})") from exc

    def __eq__(self, other) -> bool:
        return isinstance(other, KeyedStateSnapshot) and self.to_bytes() == other.to_bytes()

    def __repr__(self) -> str:
        return (f"KeyedStateSnapshot({self.key_group_range}, materialized={len(self.materialized)}, "
                f"changelog={'yes' if self.changelog is not None else 'no'}, "
                f"checkpoint_id={self.checkpoint_id})")
