"""``SlotMemory``: everything per slot, in one place: its pinned bytes, device mirror and UVA alias, its fence,
the claim holding it, its last device user, what is kept alive until its fence, and the one view cache.
"""

from __future__ import annotations

from typing import Any

import torch

from pinpool.cache import BoundedCache
from pinpool.encode import NUMPY_DTYPE
from pinpool.exceptions import CapacityError, DeviceMismatchError, PoolStateError
from pinpool.platform import PlatformReport
from pinpool.settings import PoolSettings
from pinpool.transport import Fence, Stream, Transport


class SlotMemory:
    """One slot: pinned bytes (as torch ``host_raw``, numpy ``host``, the slab's memoryview ``host_bytes``), device
    memory (``device_raw``, ``alias``), ``fence`` (recorded when a claim closes), the claim's ``generation`` (a view
    is live while it matches), ``last_user`` with its ``handoff`` fence (rule 2) and ``retained`` (rule 5)."""

    def __init__(
        self,
        host_raw: torch.Tensor,
        device_raw: torch.Tensor,
        host_bytes: memoryview,
        host_base: int,
        alignment: int,
        fences: tuple[Fence, Fence],
        last_user: Stream,
    ) -> None:
        self.index = host_base // host_raw.numel()  # the slot's place in the ring
        self.host_raw, self.device_raw, self.host_bytes, self.host_base = host_raw, device_raw, host_bytes, host_base
        self.alias: torch.Tensor | None = None  # the pinned bytes' device address (UVA), once the platform check passed
        self.alignment, (self.fence, self.handoff), self.last_user = alignment, fences, last_user
        self.generation = 0
        self.retained: list[Any] = []
        self.address: int = host_raw.data_ptr()
        self.nbytes: int = host_raw.numel()
        raw_np = host_raw.numpy()
        self.host: dict[torch.dtype, Any] = {d: raw_np.view(n) for d, n in NUMPY_DTYPE.items()}
        #: A decode step repeats its puts, layout and read-backs at the same bytes lap after lap: what they
        #: make is kept here, keyed by what it covers (the one cache of slot views).
        self.views: BoundedCache[tuple[Any, ...], Any] = BoundedCache()

    def device_view(self, dst: torch.Tensor, dtype: torch.dtype, start: int, numel: int) -> torch.Tensor:
        """``numel`` ``dtype`` values of ``dst`` from byte ``start``, kept (keyed by ``id(dst)``, held with it)."""
        hit = self.views.get((id(dst), dtype, start, numel))
        if hit is None:
            hit = self.views.put((id(dst), dtype, start, numel), (dst, typed_view(dst, dtype, start, numel)))
        view: torch.Tensor = hit[1]
        return view

    def readback_views(self, src: torch.Tensor, offset: int, device: torch.device) -> tuple[torch.Tensor, Any, int]:
        """(pinned torch view, numpy view, bytes) a read-back of ``src`` at ``offset`` copies into; typed errors."""
        key = ("readback", src.dtype, src.shape, offset) if type(src) is torch.Tensor else None
        hit = self.views.get(key) if key is not None else None
        if hit is not None and src.device == device and src.is_contiguous():
            views: tuple[torch.Tensor, Any, int] = hit
            return views
        if not isinstance(src, torch.Tensor):
            raise PoolStateError(f"'src' must be a torch.Tensor (got {type(src).__name__})")
        if src.device != device:
            raise DeviceMismatchError(f"'src' must be on the pool's device {device} (got {src.device})")
        if src.dtype not in NUMPY_DTYPE or not src.is_contiguous():
            raise PoolStateError(f"'src' must be contiguous with a numpy dtype (got {src.dtype})")
        nbytes = src.nbytes
        if offset + nbytes > self.nbytes:
            raise CapacityError(
                f"'src' needs {nbytes} bytes but the slot has {self.nbytes - offset} of {self.nbytes} left; "
                "raise PoolSettings.slot_bytes"
            )
        first = offset // src.element_size()
        host_np = self.host[src.dtype][first : first + src.numel()].reshape(src.shape)
        host_t = self.host_raw[offset : offset + nbytes].view(src.dtype).view(src.shape)
        views = (host_t, host_np, nbytes)
        return views if key is None else self.views.put(key, views)


def allocate_slots(
    transport: Transport, settings: PoolSettings
) -> tuple[torch.Tensor, torch.Tensor, list[SlotMemory], PlatformReport]:
    """(pinned slab, device mirror, each slot's memory, the zero-copy check's report): made once."""
    slot_bytes, num_slots = settings.slot_bytes, settings.num_slots
    host_slab = transport.alloc_host(slot_bytes * num_slots)
    device_mirror = transport.alloc_device(slot_bytes * num_slots)
    host_bytes = host_slab.numpy().data  # the whole slab as a writable memoryview
    # The mirror came from the allocator on the current stream, which may still have work queued on that
    # memory: it is every slot's first "previous user", so a first stage on another stream waits for it.
    first_user = transport.resolve_stream(None)
    slots = []
    for start in range(0, slot_bytes * num_slots, slot_bytes):
        host, device = host_slab[start : start + slot_bytes], device_mirror[start : start + slot_bytes]
        fences = transport.new_fence(), transport.new_fence()
        slots.append(SlotMemory(host, device, host_bytes, start, settings.alignment, fences, first_user))
    platform = PlatformReport.unchecked()
    if settings.zero_copy:
        platform, alias = transport.check_zero_copy(host_slab)
        if alias is not None and platform.zero_copy_ok:
            for mem in slots:
                mem.alias = alias[mem.host_base : mem.host_base + mem.nbytes]
    return host_slab, device_mirror, slots, platform


def typed_view(raw: torch.Tensor, dtype: torch.dtype, start: int, numel: int) -> torch.Tensor:
    """``numel`` ``dtype`` values of uint8 ``raw`` from byte ``start`` (a multiple of the dtype's size)."""
    return raw[start : start + numel * dtype.itemsize].view(dtype)
