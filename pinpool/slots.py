"""What one ring slot looks like from the host and the device: typed views, built once.

A ``SlotLayout`` is the part of the ring a ``Stage`` writes through. The ring builds one
per slot at construction, so a put is a dictionary lookup and a slice, never an
allocation. ``BoundedCache`` is the one cache policy the ring uses for views it makes
on demand: a decode loop repeats the same layout every step, so hits are the rule, and a
caller whose layout keeps changing starts a fresh cache instead of growing without end.
"""

from __future__ import annotations

from typing import Any, Generic, TypeVar

import numpy as np
import torch

from pinpool.encode import NUMPY_DTYPE

K = TypeVar("K")
V = TypeVar("V")

#: Entries per cache. A decode loop uses a handful per slot; past this, the caller's
#: layout is not repeating and the cache starts over (bounded memory, one rule).
CACHE_LIMIT = 256


class BoundedCache(dict[K, V], Generic[K, V]):
    """A dict that empties itself when a new key would take it past ``CACHE_LIMIT``."""

    def put(self, key: K, value: V) -> V:
        if len(self) >= CACHE_LIMIT:
            self.clear()
        self[key] = value
        return value


class SlotLayout:
    """One slot's pinned host region and device region, as views per dtype.

    ``host`` / ``device``: dtype -> the whole region viewed as that dtype (numpy on the
    host, so a put writes without torch's dispatch; bfloat16 has no numpy dtype and
    stays a torch view). ``host_bytes`` is the whole slab as a writable memoryview and
    ``host_base`` this slot's first byte in it, for ``struct`` packing of int lists.
    """

    __slots__ = (
        "alignment",
        "device",
        "device_raw",
        "device_views",
        "exchanges",
        "host",
        "host_base",
        "host_bytes",
        "host_raw",
        "landings",
        "nbytes",
    )

    def __init__(
        self, host_raw: torch.Tensor, device_raw: torch.Tensor, host_bytes: memoryview, host_base: int, alignment: int
    ) -> None:
        self.host_raw = host_raw
        self.device_raw = device_raw
        self.host_bytes = host_bytes
        self.host_base = host_base
        #: The slot's size and the alignment of each claim in it (the pool's settings), kept
        #: here so that a stage opening on this layout reads them without a call.
        self.nbytes: int = host_raw.numel()
        self.alignment = alignment
        raw_np = host_raw.numpy()
        self.host: dict[torch.dtype, Any] = {d: raw_np.view(n) for d, n in NUMPY_DTYPE.items()}
        self.host[torch.bfloat16] = host_raw.view(torch.bfloat16)
        self.device: dict[torch.dtype, torch.Tensor] = {d: device_raw.view(d) for d in self.host}
        #: (dtype, first element, numel) -> device view: the same memory every lap.
        self.device_views: BoundedCache[tuple[torch.dtype, int, int], torch.Tensor] = BoundedCache()
        #: ``Stage.land``'s plans for this slot, by (cursor, tail, capacity, numel, dtype).
        self.landings: BoundedCache[tuple[Any, ...], Any] = BoundedCache()
        #: ``Exchange``'s plans for this slot, by its fields' (type, dtype, length), land, land dtype.
        self.exchanges: BoundedCache[tuple[Any, ...], Any] = BoundedCache()

    def device_view(self, dtype: torch.dtype, first: int, numel: int) -> torch.Tensor:
        key = (dtype, first, numel)
        view = self.device_views.get(key)
        if view is None:
            view = self.device_views.put(key, self.device[dtype][first : first + numel])
        return view

    def host_view(self, dtype: torch.dtype, first: int, numel: int) -> np.ndarray[Any, Any] | torch.Tensor:
        view: np.ndarray[Any, Any] | torch.Tensor = self.host[dtype][first : first + numel]
        return view
