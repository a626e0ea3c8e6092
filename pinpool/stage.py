"""``Stage``: one claim of one ring slot, ``OPEN`` (puts) -> ``FLUSHED`` (copy issued) -> ``CLOSED`` (fence
recorded) or ``ABORTED``, whatever its ``Placement``: the slot's device mirror (``RING``), device memory the caller
owns (``OWNED``), a ``DeviceBlock`` a CUDA graph captures (``BLOCK``), or the pinned slot itself (``IN_PLACE``)."""

from __future__ import annotations

import enum
import math
import struct
from collections.abc import Mapping, Sequence
from types import MappingProxyType
from typing import Any, Protocol

import numpy as np
import torch

from pinpool.encode import NUMPY_DTYPE, PACKERS, as_source, check_dtype, int_in_range, packer_for, write
from pinpool.exceptions import (
    CAPACITY_FIX,
    CapacityError,
    PoolStateError,
    StagingTypeError,
    StagingValueError,
    StaleLeaseError,
)
from pinpool.layout import VIEW_LIFETIME, HostImage, Layout, align_up
from pinpool.placed import Placed
from pinpool.readback import Landing, Readback, SlotReads
from pinpool.slot import SlotMemory, typed_view
from pinpool.transport import Stream

_ITEMSIZE = {d: d.itemsize for d in [*NUMPY_DTYPE, torch.bfloat16]}
_NO_VIEWS: Mapping[str, torch.Tensor] = MappingProxyType({})  # a stage without a layout's ``views``


class Placement(enum.Enum):
    RING = "ring"
    OWNED = "owned"
    BLOCK = "block"
    IN_PLACE = "in place"


class State(enum.Enum):
    OPEN = "open"
    FLUSHED = "flushed"
    CLOSED = "closed"
    ABORTED = "aborted"


OPEN, FLUSHED, CLOSED, ABORTED = State.OPEN, State.FLUSHED, State.CLOSED, State.ABORTED
RING, OWNED, BLOCK, IN_PLACE = Placement.RING, Placement.OWNED, Placement.BLOCK, Placement.IN_PLACE


class BlockSide(Protocol):
    """What a ``BLOCK`` stage asks of its ``DeviceBlock`` around the copy."""

    def before_copy(self, stream: Stream) -> None: ...
    def after_copy(self, stream: Stream) -> None: ...
    def wait_for_readers(self, stream: Stream) -> None: ...
    def views(self, rows: int) -> Mapping[str, torch.Tensor]: ...


class RingSide(SlotReads, Protocol):
    """What a stage asks of its ring (its ``PinnedRingBuffer``)."""

    @property
    def device(self) -> torch.device: ...

    def _issue_copy(self, st: Stage) -> None: ...
    def _finish(self, st: Stage, ok: bool) -> None: ...
    def _copy_back(
        self, slot: int, stream: Stream, src: torch.Tensor, views: tuple[torch.Tensor, Any, int]
    ) -> Readback: ...


class Stage:
    """An open claim of one slot: ``put`` / ``reserve`` values (with a layout, ``put(field, rows)``), then one
    copy (``flush`` or exit). With a layout: ``layout``, ``rows`` (padded), ``live`` (real) and ``views`` (name ->
    device view of ``rows`` elements); without one, None, 0, 0 and an empty dict."""

    def __init__(
        self, pool: RingSide, mem: SlotMemory, stream: Stream, placement: Placement, dst: torch.Tensor
    ) -> None:
        self.pool, self._mem, self.slot, self.generation = pool, mem, mem.index, mem.generation
        self.stream = stream  # of the copy, the fence and the read-backs, fixed at open
        self.placement, self.owned = placement, placement is OWNED
        self.dst, self._dst_id = dst, id(dst)  # the device memory the views are carved from and the copy lands in
        self._block: BlockSide | None = None
        self.tail = nbytes = mem.nbytes  # landed values are claimed from the slot's end down
        self.capacity = nbytes if placement is RING or placement is IN_PLACE else min(nbytes, dst.numel())
        self._cursor = self.used_bytes = self.rows = self.live = self._written = 0
        self.landing_bytes = self.copy_issued = self._padded = False
        self.state = OPEN
        self._landings: Sequence[Landing] = ()
        self._placed: Placed | None = None  # with a layout, set by ``open_layout``
        self.layout: Layout | None = None
        self.views: Mapping[str, torch.Tensor] = _NO_VIEWS

    def __enter__(self) -> Stage:
        return self

    def __exit__(self, exc_type: type[BaseException] | None, *_: object) -> None:
        self.close(ok=exc_type is None)

    def flush(self) -> None:
        """Issue the stage's one copy now (padding first), leaving it open for kernel launches: OPEN -> FLUSHED."""
        if self.state is not OPEN:
            self._check_open()  # raises
        placed = self._placed
        if placed is not None:
            if self.live and self._written != placed.all_written:
                error = placed.unwritten(self._written)
                self.close(ok=False)
                raise error
            if self.live < placed.rows and not self._padded:
                placed.pad(self.live)
                self._padded = True
        if self._block is not None:
            self._block.before_copy(self.stream)
        if self.placement is not IN_PLACE:
            self.pool._issue_copy(self)
        self.state = FLUSHED
        if self._block is not None:
            self._block.after_copy(self.stream)

    def close(self, ok: bool = True) -> None:
        """Finish the stage: the copy if not issued yet (``ok``), then the slot's fence; or abort."""
        if self.state is CLOSED or self.state is ABORTED:
            return
        if ok and self.state is OPEN:
            if self._landings and self.placement is not IN_PLACE and self.live:
                # The copy would carry live addresses that a kernel launched after close
                # could still store through, past the slot's fence: abort instead.
                self.close(ok=False)
                raise PoolStateError(
                    "a stage with landings needs flush() before close: the writer is launched between the two, "
                    "after the copy that carries its addresses; the stage was aborted and nothing was copied"
                )
            try:
                self.flush()  # raises, the stage aborted, when a layout field was not written
            except BaseException:
                self.close(ok=False)
                raise
        if ok and self._landings and self._block is not None:
            # The writer is the graph replay, maybe on a registered reader: the fence follows it.
            self._block.wait_for_readers(self.stream)
        self.state = CLOSED if ok else ABORTED
        self.pool._finish(self, ok)
        if ok:
            for handle in self._landings:
                handle.armed = True

    @property
    def is_open(self) -> bool:
        """True until the stage is closed (by ``with`` exit or ``close``)."""
        return self.state is OPEN or self.state is FLUSHED

    @property
    def flushed(self) -> bool:
        return self.state is not OPEN

    @property
    def is_live(self) -> bool:
        """Whether a kernel queued now reads this stage's values: after the copy, before recycling or close."""
        if self.placement is IN_PLACE:
            return self.is_open and self._mem.generation == self.generation
        if self.state is OPEN:
            return False
        return self.placement is not RING or self._mem.generation == self.generation

    def check_live(self, what: str = "staged slice") -> None:
        if self.is_live:
            return
        where = f"{what} of stage {self.generation} (slot {self.slot}) was used"
        if self.state is OPEN and self.placement is not IN_PLACE:
            raise StaleLeaseError(
                f"{where} before its copy was issued: the device view still holds older bytes; flush() first, "
                "then launch its readers"
            )
        after = "its stage closed" if self.placement is IN_PLACE else "its slot was recycled"
        raise StaleLeaseError(
            f"{where} after {after}; ring views live {VIEW_LIFETIME}, zero-copy views until close; stage data "
            "that must live longer in an owned stage (owned=)"
        )

    def put(self, values: Any, dtype: Any = None, *, name: str = "values") -> Any:
        """Write ``values`` (a list, tuple or scalar with ``dtype``; a numpy array, CPU tensor or bytes), converted
        exactly or refused before the stage advances; their device view (None for a layout field's rows)."""
        if self.state is not OPEN:
            self._check_open()
        if type(values) is str:  # a layout field's live rows: put("rows", [...])
            placed, rows, live = self._placed, dtype, self.live
            if placed is None:
                raise _no_layout(values)
            spec = placed.fields.get(values)  # (index, first byte in the slab, dtype, the packer of every row)
            if spec is not None and type(rows) is list and len(rows) == live:
                i, at, field_dtype, packer = spec
                if live != placed.rows:  # padding rows: a packer of the live ones
                    packer = PACKERS.get((field_dtype, live)) or packer_for(field_dtype, live)
                try:  # packed aside: a refused put leaves the field's earlier values, as the general path does
                    packed = packer.pack(*rows) if packer is not None else None  # None: a dtype struct lacks
                except (struct.error, TypeError, OverflowError):
                    packed = None  # not exact as struct packs it: the general path converts or raises typed
                if packed is not None:
                    self._mem.host_bytes[at : at + len(packed)] = packed
                    self._written |= 1 << i
                    return None
            self._written |= 1 << placed.put(values, rows, live)
            return None
        if type(values) is list and type(dtype) is torch.dtype:
            # A scheduler's per-request list: struct checks each element (ints in range, floats
            # that fit) and packs it straight into the slot.
            numel = len(values)
            packer = PACKERS.get((dtype, numel)) or packer_for(dtype, numel)
            start = self._cursor
            if packer is not None and (end := start + packer.size) <= self.capacity and end <= self.tail:
                mem = self._mem
                try:
                    packer.pack_into(mem.host_bytes, mem.host_base + start, *values)
                except (struct.error, TypeError, OverflowError):
                    pass  # not exact as struct packs it: the general path converts or raises typed
                else:  # ``_advance`` inline: one call less a put (each runs cold, after a step's launches)
                    self.used_bytes = end
                    self._cursor = (end + mem.alignment - 1) & -mem.alignment
                    hit = None if self.owned else mem.views.get((self._dst_id, dtype, start, numel))
                    return hit[1] if hit is not None else self._advance(start, dtype, numel, packer.size)
        src, target, shape = as_source(values, dtype, name)
        numel = math.prod(shape)
        start, nbytes = self._cursor, numel * _ITEMSIZE[target]
        if start + nbytes > min(self.capacity, self.tail):
            raise self._no_room(nbytes, name)
        if target is torch.bfloat16:
            host: Any = self._mem.host_raw[start : start + nbytes].view(torch.bfloat16)
        else:
            first = start // _ITEMSIZE[target]
            host = self._mem.host[target][first : first + numel]
        write(host, src, target, name)
        device = self._advance(start, target, numel, nbytes)
        return device if len(shape) == 1 else device.view(shape)

    def reserve(
        self, numel: int, dtype: torch.dtype, *, name: str = "values"
    ) -> tuple[np.ndarray[Any, Any], torch.Tensor]:
        """Claim ``numel`` elements: (numpy host view to fill before the copy, device view)."""
        if self.state is not OPEN:
            self._check_open()
        target = check_dtype(dtype, name)
        if target not in NUMPY_DTYPE:
            raise StagingTypeError(f"'{name}' reserve() needs a numpy dtype (got {target}); use put() for it")
        if not int_in_range(numel, 0):
            raise StagingValueError(f"'{name}' numel must be an int >= 0 (got {numel!r})")
        itemsize = _ITEMSIZE[target]
        start, nbytes = align_up(self._cursor, itemsize), numel * itemsize
        if start + nbytes > min(self.capacity, self.tail):
            raise self._no_room(nbytes, name)
        host = self._mem.host[target][start // itemsize : start // itemsize + numel]
        return host, self._advance(start, target, numel, nbytes)

    def readback(self, src: torch.Tensor) -> Readback:
        """Copy device tensor ``src`` back into this slot under its fence (flushes first; launch readers before)."""
        if not self.is_open:
            self._check_open()
        offset = align_up(self._cursor, self._mem.alignment)
        views = self._mem.readback_views(src, offset, self.pool.device)  # typed errors first
        nbytes = views[2]
        if offset + nbytes > self.tail:
            raise CapacityError(
                f"'src' needs {nbytes} bytes but the slot has {max(self.tail - offset, 0)} left before its landings; "
                "raise PoolSettings.slot_bytes"
            )
        if self.state is OPEN:
            self.flush()
        if self._block is not None:
            self._block.wait_for_readers(self.stream)  # ``src`` is written by the replay, maybe on a reader
        handle = self.pool._copy_back(self.slot, self.stream, src, views)
        self._cursor = offset + nbytes
        self.copy_issued = True
        return handle

    def retain(self, *objs: Any) -> None:
        """Keep ``objs`` alive until this slot's fence has passed: it follows kernels launched before close."""
        if not self.is_open:
            self._check_open()
        self._mem.retained.extend(objs)

    def open_layout(self, layout: Layout, rows: int, live: int, block: BlockSide | None) -> None:
        """Claim ``layout`` at ``rows`` rows, ``live`` of them real, and its landings, in ``block`` if any."""
        mem, keep = self._mem, not self.owned  # an owned buffer may differ next time
        key = ("layout", id(layout), self._dst_id, rows)  # ids: the entry holds both, so neither is reused
        placed: Placed | None = mem.views.get(key) if keep else None
        if placed is None:
            views = block.views(rows) if block is not None else None
            placed = Placed(layout, rows, mem, self.dst, views, self.capacity)
            if keep:
                mem.views.put(key, placed)
        self._placed, self._block, self.layout, self.rows, self.live = placed, block, layout, rows, live
        self.views = placed.views
        self.used_bytes, self._cursor = placed.nbytes, placed.cursor
        if placed.landed:
            self.tail, self.landing_bytes = placed.tail, True
            n, landings = live * 8, []  # each landing's live addresses; padding rows hold 0: they store nothing
            for addresses, column, values in placed.landed:
                if live == rows:  # an eager step pads nothing: whole views, no slicing (each slice costs, cold)
                    addresses[:] = column
                    landings.append(Landing(self.pool, mem, values, False))
                else:
                    addresses[:n] = column[:n]
                    landings.append(Landing(self.pool, mem, values[:live], False))
            self._landings = landings
        if self.placement is IN_PLACE and live < rows:
            placed.pad(live)  # read in place from the moment they are handed out
            self._padded = True

    def host(self, name: str) -> np.ndarray[Any, Any]:
        """Field ``name``'s live rows in the pinned slot, to fill in place before the copy (counts as written)."""
        if self.state is not OPEN:
            self._check_open()
        if self._placed is None:
            raise _no_layout(name)
        i = self._placed.input_field(name)
        self._written |= 1 << i
        return self._placed.host_views[i][: self.live]

    def put_image(self, image: HostImage) -> None:
        """Every field from a prebuilt host image (padding included): one memcpy."""
        if self.state is not OPEN:
            self._check_open()
        if self._placed is None:
            raise StagingValueError(f"'image' needs a stage with a layout (got {image!r})")
        self._placed.put_image(image, self.live, self._mem)
        self._written, self._padded = self._placed.all_written, True

    def landing(self, name: str) -> Landing:
        """The handle that reads landing field ``name``'s values after a successful close."""
        placed = self._placed
        k = placed.landing_of.get(name) if placed is not None else None
        if k is None:
            if placed is not None:
                placed.layout.field(name)  # an undeclared name: its own typed error
            raise StagingValueError(f"'name' must be a landing field of this stage's layout (got {name!r})")
        return self._landings[k]

    def _advance(self, start: int, dtype: torch.dtype, numel: int, nbytes: int) -> torch.Tensor:
        """Commit a claim of ``nbytes`` at ``start``: its device view, and the cursor past it."""
        self.used_bytes = end = start + nbytes
        self._cursor = (end + self._mem.alignment - 1) & -self._mem.alignment  # ``align_up`` (a power of two), inline
        if self.owned:  # an owned buffer may be another one next time: made, never kept
            return typed_view(self.dst, dtype, start, numel)
        hit = self._mem.views.get((self._dst_id, dtype, start, numel))  # the lookup inline: one call less a put
        return hit[1] if hit is not None else self._mem.device_view(self.dst, dtype, start, numel)

    def _check_open(self) -> None:
        if not self.is_open:
            raise PoolStateError(f"this stage is {self.state.value}: open a new one with pool.stage()")
        if self.state is FLUSHED:
            raise PoolStateError("this stage was flushed: its copy is issued, so nothing more can be put")

    def _no_room(self, nbytes: int, name: str) -> CapacityError:
        limit = "owned buffer" if self.placement is OWNED and self.capacity < self._mem.nbytes else "slot"
        free = max(min(self.capacity, self.tail) - self._cursor, 0)
        return CapacityError(
            f"'{name}' needs {nbytes} bytes but the {limit} has {free} of {self.capacity} left; {CAPACITY_FIX}"
        )


def _no_layout(name: str) -> StagingTypeError:
    return StagingTypeError(f"put({name!r}, ...) names a field, but this stage has no layout")
