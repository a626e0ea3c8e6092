"""``BoundedCache``: the one policy of every cache in the pool's hot paths."""

from __future__ import annotations

from typing import Generic, TypeVar

K = TypeVar("K")
V = TypeVar("V")

#: A decode loop uses a handful per slot; past this, the caller's layout is not repeating: start over.
CACHE_LIMIT = 256


class BoundedCache(dict[K, V], Generic[K, V]):
    """A dict that empties itself when a new key would take it past ``CACHE_LIMIT``."""

    def put(self, key: K, value: V) -> V:
        if len(self) >= CACHE_LIMIT:
            self.clear()
        self[key] = value
        return value
