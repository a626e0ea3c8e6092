"""``Stage``: one claim of one ring slot, from open to close, whatever its placement (placement.py).

Values go into the slot's pinned bytes as they arrive; their device views are handed back at once.
One lifecycle: ``OPEN`` (puts) -> ``FLUSHED`` (the copy issued) -> ``CLOSED`` (the fence recorded), or ``ABORTED``.
"""

from __future__ import annotations

import math
import struct
from typing import Any

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
from pinpool.layout import VIEW_LIFETIME, HostImage, Layout, align_up, landing_itemsize
from pinpool.layout_step import LayoutStep, no_landing, no_layout
from pinpool.placement import ABORTED, CLOSED, FLUSHED, IN_PLACE, OPEN, OWNED, RING, BlockSide, Placement, RingSide
from pinpool.readback import Landing, Readback
from pinpool.slot import SlotMemory, claim_tail, typed_view
from pinpool.transport import Stream

_ITEMSIZE = {d: d.itemsize for d in [*NUMPY_DTYPE, torch.bfloat16]}


class Stage:
    """An open claim of one slot: ``put`` / ``reserve`` values, then one copy (``flush`` or exit).

    Example::

        with pool.stage() as st:
            temps = st.put([0.7, 1.0], torch.float32)   # device view, lands with the copy
            host, dev = st.reserve(256, torch.int32)    # fill ``host`` in place before exit
        # exit: one copy of the used bytes on ``st.stream``, then the slot's fence

    With a layout, ``put(name, values)`` writes a field's live rows and ``views`` holds each field's view.
    """

    __slots__ = (
        "_block",
        "_cursor",
        "_landings",
        "_mem",
        "_ring",
        "_step",
        "capacity",
        "copy_issued",
        "dst",
        "generation",
        "landing_bytes",
        "placement",
        "slot",
        "state",
        "stream",
        "tail",
        "used_bytes",
    )

    def __init__(
        self,
        ring: RingSide[Stage],
        mem: SlotMemory,
        slot: int,
        generation: int,
        stream: Stream,
        placement: Placement,
        dst: torch.Tensor,
        block: BlockSide | None = None,
    ) -> None:
        self._ring, self._mem, self.slot, self.generation = ring, mem, slot, generation
        self.stream = stream  # of the copy, the fence and the read-backs, fixed at open
        self.placement = placement
        self.dst = dst  # the device memory the views are carved from and the copy lands in
        self._block = block
        # Landing bytes are claimed from the slot's end down, outside the copied bytes.
        self.tail = nbytes = mem.nbytes
        self.capacity = nbytes if placement is RING or placement is IN_PLACE else min(nbytes, dst.numel())
        self._cursor = self.used_bytes = 0
        self.landing_bytes = self.copy_issued = False
        self.state = OPEN
        self._landings: list[Landing] = []
        self._step: LayoutStep | None = None  # a layout's step, set by ``open_layout``

    @property
    def layout(self) -> Layout | None:
        return self._step.layout if self._step is not None else None

    @property
    def rows(self) -> int:
        """With a layout: the padded row count (0 without one)."""
        return self._step.rows if self._step is not None else 0

    @property
    def live(self) -> int:
        """With a layout: how many of the rows are real (0 without one)."""
        return self._step.live if self._step is not None else 0

    @property
    def views(self) -> dict[str, torch.Tensor]:
        """With a layout: name -> each field's device view of ``rows`` elements (empty without one)."""
        return self._step.placed.views if self._step is not None else {}

    def __enter__(self) -> Stage:
        return self

    def __exit__(self, exc_type: type[BaseException] | None, *_: object) -> None:
        self.close(ok=exc_type is None)

    def flush(self) -> None:
        """Issue the stage's one copy now (padding first), leaving it open for kernel launches."""
        if self.state is not OPEN:
            self._check_open()  # raises
        self._issue()

    def close(self, ok: bool = True) -> None:
        """Finish the stage: the copy if not issued yet (``ok``), then the slot's fence; or abort."""
        if self.state is CLOSED or self.state is ABORTED:
            return
        if ok and self.state is OPEN:
            if self._landings and self.placement is not IN_PLACE and any(h.size for h in self._landings):
                # The copy would carry live addresses that a kernel launched after close
                # could still store through, past the slot's fence: abort instead.
                self.close(ok=False)
                raise PoolStateError(
                    "a stage with landings needs flush() before close: the writer is launched between the two, "
                    "after the copy that carries its addresses; the stage was aborted and nothing was copied"
                )
            try:
                self._issue()  # raises, the stage aborted, when a layout field was not written
            except BaseException:
                self.close(ok=False)
                raise
        if ok and self._landings and self._block is not None:
            # The writer is the graph replay, maybe on a registered reader: the fence follows it.
            self._block.wait_for_readers(self.stream)
        self.state = CLOSED if ok else ABORTED
        self._ring._finish(self, ok)
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
    def owned(self) -> bool:
        return self.placement is OWNED

    @property
    def pool(self) -> RingSide[Stage]:
        """The pool this stage belongs to (a library building into a caller's stage checks it)."""
        return self._ring

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
        """Write ``values`` (a list, tuple or scalar with ``dtype``; a numpy array, CPU tensor or bytes) into
        the slot, converted exactly or refused before the stage advances; return their device view."""
        if self.state is not OPEN:
            self._check_open()
        if type(values) is str:  # a layout field's live rows: put("rows", [...])
            field, rows, step = values, dtype, self._step
            if step is None:
                raise no_layout(field)
            spec = step.placed.fields.get(field)  # (index, first byte in the slab, dtype)
            if spec is not None and type(rows) is list and len(rows) == step.live:
                i, at, field_dtype = spec
                packer = PACKERS.get((field_dtype, step.live)) or packer_for(field_dtype, step.live)
                try:  # packed aside: a refused put leaves the field's earlier values, as the general path does
                    packed = packer.pack(*rows) if packer is not None else None  # None: a dtype struct lacks
                except (struct.error, TypeError, OverflowError):
                    packed = None  # not exact as struct packs it: the general path converts or raises typed
                if packed is not None:
                    self._mem.host_bytes[at : at + len(packed)] = packed
                    step.written |= 1 << i
                    return None
            return step.put(field, rows)
        if type(values) is list and type(dtype) is torch.dtype:
            # A scheduler's per-request list: struct checks each element (ints in range,
            # floats that fit) and packs it straight into the slot.
            numel = len(values)
            packer = PACKERS.get((dtype, numel)) or packer_for(dtype, numel)
            start = self._cursor
            if packer is not None and (end := start + packer.size) <= self.capacity and end <= self.tail:
                mem = self._mem
                try:
                    packer.pack_into(mem.host_bytes, mem.host_base + start, *values)
                except (struct.error, TypeError, OverflowError):
                    pass  # not exact as struct packs it: the general path converts or raises typed
                else:
                    return self._advance(start, dtype, numel, packer.size)
        src, target, shape = as_source(values, dtype, name)
        numel = math.prod(shape)
        start, nbytes = self._cursor, numel * _ITEMSIZE[target]
        if start + nbytes > min(self.capacity, self.tail):
            if self._ring.settings.overflow.value != "spill" or self.placement is IN_PLACE:
                raise self._no_room(nbytes, name)
            device = self._ring._spill(self, src, target, numel, name)  # raises before queueing on bad values
            self.copy_issued = True
        else:
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
        """Claim ``numel`` elements: (numpy host view to fill before the copy, device view); never spills."""
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

    def land(self, numel: int, dtype: torch.dtype = torch.int64) -> tuple[torch.Tensor, Landing]:
        """Have a kernel store ``numel`` values into this slot's end: (int64 device addresses, handle). Launch
        the writer (``pinpool.landing.land``) after ``flush``, before close, on the stage's stream or a consumer."""
        if self.state is not OPEN:
            self._check_open()
        if not self._ring.can_land:
            self._ring._check_can_land()  # raises, saying why
        if not int_in_range(numel, 0):
            raise StagingValueError(f"'numel' must be an int >= 0 (got {numel!r})")
        mem, nbytes = self._mem, numel * landing_itemsize(dtype)  # a typed error for a dtype no landing carries
        before = self.tail, self._cursor, self.used_bytes, self.landing_bytes
        self.tail = claim_tail(self.tail, self._cursor, nbytes, mem.alignment, "landing")  # the values, below the tail
        self.landing_bytes = True
        column, values = mem.landing(self.tail, numel, dtype)
        handle = Landing(self._ring, self.slot, self.generation, mem.fence, values, False)
        self._landings.append(handle)
        try:
            at = self._cursor
            if at + len(column) <= min(self.capacity, self.tail):
                mem.host_bytes[mem.host_base + at : mem.host_base + at + len(column)] = column
                addresses = self._advance(at, torch.int64, numel, len(column))
            else:  # as a put that does not fit: spilled where the pool spills, refused otherwise
                addresses = self.put(np.frombuffer(column, np.int64), torch.int64, name="landing")
        except BaseException:
            self.tail, self._cursor, self.used_bytes, self.landing_bytes = before
            self._landings.pop()
            raise
        return addresses, handle

    def readback(self, src: torch.Tensor) -> Readback:
        """Copy device tensor ``src`` back into this slot under its fence (flushes first; launch readers before)."""
        if not self.is_open:
            self._check_open()
        offset = align_up(self._cursor, self._mem.alignment)
        views = self._mem.readback_views(src, offset, self._ring.device)  # typed errors first
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
        handle = self._ring._copy_back(self.slot, self.generation, self.stream, src, views)
        self._cursor = offset + nbytes
        self.copy_issued = True
        return handle

    def retain(self, *objs: Any) -> None:
        """Keep ``objs`` alive until this slot's fence has passed: it follows kernels launched before close."""
        if not self.is_open:
            self._check_open()
        self._mem.retained.extend(objs)

    def open_layout(self, layout: Layout, rows: int, live: int) -> None:
        """Claim ``layout`` for ``rows`` rows, ``live`` of them real, and its landings (the ring checked the counts)."""
        mem = self._mem
        block_views = self._block.views if self._block is not None else None
        keep = self.placement is not OWNED
        placed = mem.placed(layout, rows, self.dst, block_views, self.capacity, keep)
        self._step = LayoutStep(layout, rows, live, mem, placed)
        self.used_bytes, self._cursor = placed.nbytes, placed.cursor
        if placed.landed:
            self.tail, self.landing_bytes, n = placed.tail, True, live * 8  # int64 addresses
            for at, column, values in placed.landed:
                self._landings.append(Landing(self._ring, self.slot, self.generation, mem.fence, values[:live], False))
                mem.host_bytes[at : at + n] = column[:n]  # padding rows hold 0 (their pad): they store nothing
        if self.placement is IN_PLACE and live < rows:
            placed.pad(live)  # read in place from the moment they are handed out
            self._step.padded = True

    def host(self, name: str) -> np.ndarray[Any, Any]:
        """Field ``name``'s live rows in the pinned slot, to fill in place before the copy (counts as written)."""
        if self.state is not OPEN:
            self._check_open()
        if self._step is None:
            raise no_layout(name)
        return self._step.host(name)

    def put_image(self, image: HostImage) -> None:
        """Every field from a prebuilt host image (padding included): one memcpy."""
        if self.state is not OPEN:
            self._check_open()
        if self._step is None:
            raise StagingValueError(f"'image' needs a stage with a layout (got {image!r})")
        self._step.put_image(image)

    def landing(self, name: str) -> Landing:
        """The handle that reads landing field ``name``'s values after a successful close."""
        k = self._step.placed.landing_of.get(name) if self._step is not None else None
        if k is None:
            raise no_landing(self._step, name)
        return self._landings[k]

    def _advance(self, start: int, dtype: torch.dtype, numel: int, nbytes: int) -> torch.Tensor:
        """Commit a claim of ``nbytes`` at ``start``: its device view, and the cursor past it."""
        self.used_bytes = start + nbytes
        self._cursor = align_up(self.used_bytes, self._mem.alignment)
        if self.placement is OWNED:  # an owned buffer may be another one next time: made, never kept
            return typed_view(self.dst, dtype, start, numel)
        hit = self._mem.views.get((id(self.dst), dtype, start, numel))  # the lookup inline: one call less a put
        return hit[1] if hit is not None else self._mem.device_view(self.dst, dtype, start, numel)

    def _issue(self) -> None:
        """Padding, the block's ordering, the one copy: OPEN -> FLUSHED."""
        if self._step is not None:
            try:
                self._step.before_copy()  # raises when an input field was not written
            except PoolStateError:
                self.close(ok=False)
                raise
        if self._block is not None:
            self._block.before_copy(self.stream)
        if self.placement is not IN_PLACE:
            self._ring._issue_copy(self)
        self.state = FLUSHED
        if self._block is not None:
            self._block.after_copy(self.stream)

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
