"""One ring slot: its memory and state (``SlotMemory``), and a layout placed in it (``Placed``).

``SlotMemory`` is the one home of everything per slot: the pinned bytes, their device mirror
and UVA alias, the slot's fence, the generation of the claim holding it, its last device
user's stream with the hand-off fence, the objects kept alive until its fence, and the one
cache of what a step makes at the same bytes lap after lap. ``claim_tail`` says where landed
values go (from the slot's end down); ``typed_view`` carves a typed view out of uint8 memory.
"""

from __future__ import annotations

from collections.abc import Callable, Mapping
from typing import Any

import numpy as np
import torch

from pinpool.cache import BoundedCache
from pinpool.encode import NUMPY_DTYPE, write
from pinpool.exceptions import CapacityError, DeviceMismatchError, PoolStateError
from pinpool.layout import LANDING_ITEMSIZE, Layout, align_up, landing_column
from pinpool.platform import PlatformReport
from pinpool.settings import PoolSettings
from pinpool.transport import Fence, Stream, Transport

#: A ``DeviceBlock``'s ``views``: the fixed views a layout placed in the block lands in.
BlockViews = Callable[[int], Mapping[str, torch.Tensor]] | None


class SlotMemory:
    """One slot's pinned bytes (as torch, numpy and the slab's memoryview), its device memory, its state."""

    __slots__ = (
        "address",
        "alias",
        "alignment",
        "device_raw",
        "fence",
        "generation",
        "handoff",
        "host",
        "host_base",
        "host_bytes",
        "host_raw",
        "last_user",
        "nbytes",
        "retained",
        "views",
    )

    def __init__(
        self,
        host_raw: torch.Tensor,
        device_raw: torch.Tensor,
        host_bytes: memoryview,
        host_base: int,
        alignment: int,
        fence: Fence,
        last_user: Stream,
        handoff: Fence,
    ) -> None:
        self.host_raw = host_raw
        self.device_raw = device_raw
        #: The device-readable alias of the pinned bytes (UVA), once the platform check passed.
        self.alias: torch.Tensor | None = None
        self.host_bytes = host_bytes
        self.host_base = host_base
        self.alignment = alignment
        #: The slot's fence, recorded when a claim of it closes: one per slot, for the pool's life.
        self.fence = fence
        #: The claim holding the slot now (a view or handle is live while its generation matches).
        self.generation = 0
        #: The stream of the slot's last device user, and a fence to record there when a claim
        #: on another stream must wait for it (rule 2).
        self.last_user = last_user
        self.handoff = handoff
        #: Objects kept alive until the slot's fence has passed (rule 5).
        self.retained: list[Any] = []
        self.address: int = host_raw.data_ptr()
        self.nbytes: int = host_raw.numel()
        raw_np = host_raw.numpy()
        self.host: dict[torch.dtype, Any] = {d: raw_np.view(n) for d, n in NUMPY_DTYPE.items()}
        #: A decode step repeats its puts, its layout and its landings at the same bytes of a
        #: slot lap after lap: what they make is kept here, keyed by what it covers (one cache).
        self.views: BoundedCache[tuple[Any, ...], Any] = BoundedCache()

    def device_view(self, dst: torch.Tensor, dtype: torch.dtype, start: int, numel: int) -> torch.Tensor:
        """``numel`` ``dtype`` values of ``dst`` from byte ``start``, kept (keyed by ``id(dst)``, held with it)."""
        hit = self.views.get((id(dst), dtype, start, numel))
        if hit is None:
            hit = self.views.put((id(dst), dtype, start, numel), (dst, typed_view(dst, dtype, start, numel)))
        view: torch.Tensor = hit[1]
        return view

    def landing(self, start: int, numel: int, dtype: torch.dtype) -> tuple[bytes, np.ndarray[Any, Any]]:
        """(the address column, the typed host view) of ``numel`` landed values at byte ``start``, kept."""
        key = ("landing", start, numel, dtype)
        hit = self.views.get(key)
        if hit is None:
            values = self.host[torch.uint8][start : start + numel * LANDING_ITEMSIZE[dtype]].view(NUMPY_DTYPE[dtype])
            hit = self.views.put(key, ((landing_column(numel, dtype) + (self.address + start)).tobytes(), values))
        column_and_values: tuple[bytes, np.ndarray[Any, Any]] = hit
        return column_and_values

    def spill(
        self, transport: Transport, stream: Stream, src: Any, dtype: torch.dtype, numel: int, name: str
    ) -> torch.Tensor:
        """``src`` landed through a pinned buffer of its own and a second copy on ``stream`` (``overflow='spill'``)."""
        nbytes = numel * dtype.itemsize
        host = transport.alloc_host(nbytes)
        write(host.numpy().view(NUMPY_DTYPE[dtype]) if dtype in NUMPY_DTYPE else host.view(dtype), src, dtype, name)
        device = transport.alloc_device(nbytes, stream)  # from the pool of the stream that writes it
        transport.copy(device, host, stream)
        self.retained.append(host)  # the slot's fence, recorded at close, covers this copy
        return device.view(dtype)

    def copy_views(self, dst: torch.Tensor, nbytes: int, keep: bool) -> tuple[torch.Tensor, torch.Tensor]:
        """(device, pinned) views of a stage's one copy of ``nbytes``; kept unless ``dst`` may differ next time."""
        key = ("copy", id(dst), nbytes)  # held with ``dst``, so the id cannot be another tensor's
        pair = self.views.get(key) if keep else None
        if pair is None:
            pair = (dst, dst[:nbytes], self.host_raw[:nbytes])
            if keep:
                self.views.put(key, pair)
        return pair[1], pair[2]

    def placed(
        self, layout: Layout, rows: int, dst: torch.Tensor, block: BlockViews, capacity: int, keep: bool
    ) -> Placed:
        """``layout`` for ``rows`` rows placed at ``dst`` (or a ``block``'s views), kept if ``keep``."""
        key = ("layout", id(layout), id(dst), rows)  # ids: the entry holds both, so neither id is reused
        placed: Placed | None = self.views.get(key) if keep else None
        if placed is None:
            placed = Placed(layout, rows, self, dst, block(rows) if block is not None else None, capacity)
            if keep:
                self.views.put(key, placed)
        return placed

    def readback_views(self, src: torch.Tensor, offset: int, device: torch.device) -> tuple[torch.Tensor, Any, int]:
        """(pinned torch view, numpy view, bytes) a read-back of ``src`` at ``offset`` copies into; typed errors.

        Kept per (dtype, shape, offset): a decode step reads back the same shape every lap.
        """
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
    """(the pinned slab, the device mirror, each slot's memory over both with its fences and its UVA alias
    where the zero-copy check passed, that check's report): made once."""
    slot_bytes, num_slots = settings.slot_bytes, settings.num_slots
    host_slab = transport.alloc_host(slot_bytes * num_slots)
    device_mirror = transport.alloc_device(slot_bytes * num_slots)
    host_bytes = host_slab.numpy().data  # the whole slab as a writable memoryview
    # The mirror came from the caching allocator on the stream current now, which may still
    # have work queued on memory the block held before: that stream is every slot's first
    # "previous user", so a first stage on another stream waits for it.
    first_user = transport.resolve_stream(None)
    slots = []
    for start in range(0, slot_bytes * num_slots, slot_bytes):
        host, device = host_slab[start : start + slot_bytes], device_mirror[start : start + slot_bytes]
        fence, handoff = transport.new_fence(), transport.new_fence()
        slots.append(SlotMemory(host, device, host_bytes, start, settings.alignment, fence, first_user, handoff))
    platform = PlatformReport.unchecked()
    if settings.zero_copy:
        platform, alias = transport.check_zero_copy(host_slab)
        if alias is not None and platform.zero_copy_ok:
            for mem in slots:
                mem.alias = alias[mem.host_base : mem.host_base + mem.nbytes]
    return host_slab, device_mirror, slots, platform


def claim_tail(tail: int, cursor: int, nbytes: int, alignment: int, name: str) -> int:
    """Where ``nbytes`` claimed below ``tail`` start: landed values fill a slot from its end down, outside the
    copied bytes (which end at ``cursor``)."""
    start = (tail - nbytes) // alignment * alignment
    if start < cursor:
        raise CapacityError(
            f"'{name}' needs {nbytes} bytes but the slot has {max(tail - cursor, 0)} left; "
            "raise PoolSettings.slot_bytes"
        )
    return start


def typed_view(raw: torch.Tensor, dtype: torch.dtype, start: int, numel: int) -> torch.Tensor:
    """``numel`` ``dtype`` values of uint8 ``raw`` from byte ``start`` (a multiple of the dtype's size)."""
    return raw[start : start + numel * dtype.itemsize].view(dtype)


class Placed:
    """A layout for ``rows`` rows placed in one slot and one destination: views, byte positions and landing
    columns, made once.

    A decode step opens the same layout at the same size in the same slot lap after lap: the
    slot keeps this (``SlotMemory.views``), so a step's puts are a dict lookup and a pack. Nothing
    here depends on how many rows are live: a landing's values are claimed for every row.
    """

    __slots__ = ("cursor", "dst", "fields", "host_views", "landed", "landing_of", "layout", "nbytes", "tail", "views")

    def __init__(
        self,
        layout: Layout,
        rows: int,
        mem: SlotMemory,
        dst: torch.Tensor,
        views: Mapping[str, torch.Tensor] | None,
        capacity: int,
    ) -> None:
        self.layout, self.dst = layout, dst  # held, so the ids in this entry's key stay theirs
        plan = layout.plan(rows)
        if plan.nbytes > capacity:
            raise CapacityError(
                f"a layout of {rows} rows needs {plan.nbytes} bytes but the stage has {capacity}; "
                "raise PoolSettings.slot_bytes or lower max_rows"
            )
        self.nbytes = plan.nbytes
        self.cursor = align_up(plan.nbytes, mem.alignment)
        self.host_views = layout.host_views(mem.host[torch.uint8], rows, plan)
        #: A block's own views where the layout lands in one (the tensors a graph captured).
        self.views = dict(views) if views is not None else layout.device_views(dst, rows, plan)
        at = [mem.host_base + off for off in plan.offsets]
        #: name -> (index, the field's first byte in the slab, dtype), input fields only.
        self.fields = {f.name: (i, at[i], f.dtype) for i, f in enumerate(layout.fields) if f.lands is None}
        #: Per landing field: (its first byte in the slab, its address column, the landed values' host view),
        #: for every row; a step writes and reads its live ones.
        landed = []
        self.tail = mem.nbytes
        for i in layout.landings:
            name, dtype = layout.fields[i].name, layout.fields[i].lands
            assert dtype is not None
            self.tail = claim_tail(self.tail, self.cursor, rows * LANDING_ITEMSIZE[dtype], mem.alignment, name)
            column, values = mem.landing(self.tail, rows, dtype)
            landed.append((at[i], memoryview(column), values))
        self.landed: tuple[tuple[int, memoryview, np.ndarray[Any, Any]], ...] = tuple(landed)
        #: landing field name -> its place among the stage's landings.
        self.landing_of = {layout.fields[i].name: k for k, i in enumerate(layout.landings)}

    def pad(self, live: int) -> None:
        """Write every field's padding rows (``live`` onwards) in the slot."""
        for view, pad in zip(self.host_views, self.layout.pads, strict=True):
            view[live:] = pad
