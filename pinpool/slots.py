"""What one ring slot looks like from the host and the device: typed views, built once.

A ``SlotLayout`` is the part of the ring a ``Stage`` writes through. The ring builds one
per slot at construction, so a put is a dictionary lookup and a slice, never an
allocation; the views it makes on demand are kept under the one cache policy
(``pinpool.cache.BoundedCache``).
"""

from __future__ import annotations

from typing import Any

import numpy as np
import torch

from pinpool.cache import BoundedCache
from pinpool.encode import NUMPY_DTYPE

#: How long a ring view lives (a stage's device views, a read-back's or a landing's values),
#: said once: every docstring says these words and every error message interpolates them.
#: Claims take the slots in turn, so a view's slot comes round again on the ``num_slots``-th
#: claim after its own and the claims between leave it alone. Every claim counts
#: (``PinnedRingBuffer.claims``): stages, owned stages, read-backs, and the stages that
#: library calls make inside.
VIEW_LIFETIME = "num_slots - 1 further claims of the ring"


def align_up(nbytes: int, align: int) -> int:
    """The first multiple of ``align`` at or past ``nbytes``: where the next claim in a slot (or a field) starts."""
    return (nbytes + align - 1) // align * align


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
