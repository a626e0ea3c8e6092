"""``Stage``: one claim of one ring slot, from open to close, whatever its placement.

Values are written into the slot's pinned host memory as they arrive, and the device
views they will land in are handed back at once. Where they land is the stage's
placement, fixed at open:

- ``RING``: the slot's device mirror (``pool.stage()``): views rotate with the slot;
- ``OWNED``: device memory the caller owns or the pool allocates (``owned=``);
- ``BLOCK``: a fixed device block a CUDA graph captures (``DeviceBlock.stage``);
- ``IN_PLACE``: the pinned slot itself, read over UVA (``zero_copy=True``): no copy.

One lifecycle: ``OPEN`` (puts) -> ``FLUSHED`` (the one copy issued; kernels may be
launched) -> ``CLOSED`` (the slot's fence recorded), or ``ABORTED``. The ring decides at
close what the fence must follow (``PinnedRingBuffer._finish``).
"""

from __future__ import annotations

import enum
import math
import struct
from collections.abc import Mapping
from types import TracebackType
from typing import Any, Protocol

import numpy as np
import torch

from pinpool.cache import BoundedCache
from pinpool.encode import NUMPY_DTYPE, PACKERS, as_source, check_dtype, int_in_range, packer_for, write
from pinpool.exceptions import CapacityError, PoolStateError, StagingTypeError, StagingValueError, StaleLeaseError
from pinpool.layout import (
    LANDING_ITEMSIZE,
    VIEW_LIFETIME,
    HostImage,
    Layout,
    align_up,
    landing_column,
    landing_itemsize,
)
from pinpool.readback import Landing, Readback, SlotReads
from pinpool.transport import Fence, Stream

_ITEMSIZE = {d: d.itemsize for d in [*NUMPY_DTYPE, torch.bfloat16]}
LAND_WITHOUT_FLUSH = (
    "a stage with landings needs flush() before close: the writer is launched between the two, after the "
    "copy that carries its addresses; the stage was aborted and nothing was copied"
)


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


class SlotMemory:
    """One slot's pinned bytes (as torch, numpy and the slab's memoryview) and the device memory it copies to."""

    __slots__ = (
        "address",
        "alias",
        "alignment",
        "device_raw",
        "fence",
        "host",
        "host_base",
        "host_bytes",
        "host_raw",
        "nbytes",
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
        self.address: int = host_raw.data_ptr()
        self.nbytes: int = host_raw.numel()
        raw_np = host_raw.numpy()
        self.host: dict[torch.dtype, Any] = {d: raw_np.view(n) for d, n in NUMPY_DTYPE.items()}
        #: A decode step repeats its puts and its layout at the same offsets of a slot: the
        #: views they make are kept here, keyed by what they cover.
        self.views: BoundedCache[tuple[Any, ...], Any] = BoundedCache()


class Placed:
    """A layout for ``rows`` rows placed in one slot and one destination: views and byte positions, made once.

    A decode step opens the same layout at the same size in the same slot lap after lap: the
    slot keeps this (``SlotMemory.views``), so a step's puts are a dict lookup and a pack.
    """

    __slots__ = ("cursor", "dst", "fields", "host_views", "landings", "layout", "nbytes", "views")

    def __init__(
        self, layout: Layout, rows: int, mem: SlotMemory, dst: torch.Tensor, views: Mapping[str, torch.Tensor] | None
    ) -> None:
        self.layout, self.dst = layout, dst  # held, so the ids in this entry's key stay theirs
        plan = layout.plan(rows)
        self.nbytes = plan.nbytes
        self.cursor = align_up(plan.nbytes, mem.alignment)
        self.host_views = layout.host_views(mem.host[torch.uint8], rows)
        #: A block's own views where the layout lands in one (the tensors a graph captured).
        self.views = dict(views) if views is not None else layout.device_views(dst, rows)
        at = [mem.host_base + off for off in plan.offsets]
        #: name -> (index, the field's first byte in the slab, dtype), input fields only.
        self.fields = {f.name: (i, at[i], f.dtype) for i, f in enumerate(layout.fields) if f.lands is None}
        #: (index, first byte in the slab, landed dtype) of each landing field.
        self.landings = tuple((i, at[i], layout.fields[i].lands) for i in layout.landings)


class RingSide(SlotReads, Protocol):
    """What a stage asks of its ring: private to the package (``PinnedRingBuffer`` is the one implementation)."""

    @property
    def settings(self) -> Any: ...

    @property
    def device(self) -> torch.device: ...

    def _issue_copy(self, st: Stage) -> None: ...

    def _finish(self, st: Stage, ok: bool) -> None: ...

    def _retain(self, slot: int, objs: tuple[Any, ...]) -> None: ...

    def _spill(self, st: Stage, src: Any, dtype: torch.dtype, numel: int, name: str) -> torch.Tensor: ...

    def _readback_views(self, mem: SlotMemory, src: torch.Tensor, offset: int) -> tuple[torch.Tensor, Any, int]: ...

    def _copy_back(self, st: Stage, host_t: torch.Tensor, host_np: Any, src: torch.Tensor, nbytes: int) -> Readback: ...

    def _check_can_land(self) -> None: ...

    can_land: bool


class BlockSide(Protocol):
    """What a ``BLOCK`` stage asks of its ``DeviceBlock`` around the copy."""

    def before_copy(self, stream: Stream) -> None: ...

    def after_copy(self, stream: Stream) -> None: ...

    def wait_for_readers(self, stream: Stream) -> None: ...

    def views(self, rows: int) -> Mapping[str, torch.Tensor]: ...


class Stage:
    """An open claim of one slot: ``put`` / ``reserve`` values, then one copy (``flush`` or exit).

    Example::

        with pool.stage() as st:
            temps = st.put([0.7, 1.0], torch.float32)   # device view, lands with the copy
            host, dev = st.reserve(256, torch.int32)    # fill ``host`` in place before exit
            host[:] = 7
        # exit: one copy of the used bytes on ``st.stream``, then the slot's fence

    With a layout (``pool.stage(layout, rows=...)`` or ``DeviceBlock.stage``), ``put(name,
    values)`` writes a field's live rows, ``views`` holds every field's device view and
    ``landing(name)`` reads a landing field's results after close.
    """

    __slots__ = (
        "_block",
        "_columns",
        "_cursor",
        "_landings",
        "_mem",
        "_padded",
        "_placed",
        "_ring",
        "_written",
        "capacity",
        "copy_issued",
        "dst",
        "generation",
        "landing_bytes",
        "layout",
        "live",
        "placement",
        "rows",
        "slot",
        "state",
        "stream",
        "tail",
        "used_bytes",
    )

    def __init__(
        self,
        ring: RingSide,
        mem: SlotMemory,
        slot: int,
        generation: int,
        stream: Stream,
        placement: Placement,
        dst: torch.Tensor,
        block: BlockSide | None = None,
    ) -> None:
        self._ring, self._mem, self.slot, self.generation = ring, mem, slot, generation
        #: The stream of this stage's copy, fence and read-backs, fixed at open.
        self.stream = stream
        self.placement = placement
        #: The device memory the views are carved from and the copy lands in.
        self.dst = dst
        self._block = block
        #: Landing bytes are claimed from the slot's end down, outside the copied bytes.
        self.tail = nbytes = mem.nbytes
        self.capacity = nbytes if placement is RING or placement is IN_PLACE else min(nbytes, dst.numel())
        self._cursor = self.used_bytes = 0
        self.landing_bytes = self.copy_issued = False
        self.state = OPEN
        self._landings: list[Landing] = []
        self.layout: Layout | None = None
        self.rows = self.live = 0
        # A layout's state (``_placed``, ``_written``, ``_padded``, ``_columns``) is set by
        # ``open_layout``: a plain stage never reads it.
        self._placed: Placed | None = None

    @property
    def views(self) -> dict[str, torch.Tensor]:
        """With a layout: name -> each field's device view of ``rows`` elements (empty without one)."""
        placed = self._placed
        return placed.views if placed is not None else {}

    # -- lifecycle ---------------------------------------------------------------------
    def __enter__(self) -> Stage:
        return self

    def __exit__(
        self, exc_type: type[BaseException] | None, exc: BaseException | None, tb: TracebackType | None
    ) -> None:
        self.close(ok=exc_type is None)

    def flush(self) -> None:
        """Issue the stage's one copy now (padding first), leaving it open for kernel launches."""
        if self.state is not OPEN:
            self._check_open()  # raises
        self._issue()

    def close(self, ok: bool = True) -> None:
        """Finish the stage: the copy if not issued yet (``ok``), then the slot's fence; or abort."""
        state = self.state
        if state is CLOSED or state is ABORTED:
            return
        if ok and state is OPEN:
            if self._landings and self.placement is not IN_PLACE and any(h.size for h in self._landings):
                # The copy would carry live addresses that a kernel launched after close
                # could still store through, past the slot's fence: abort instead.
                self.close(ok=False)
                raise PoolStateError(LAND_WITHOUT_FLUSH)
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
    def pool(self) -> RingSide:
        """The pool this stage belongs to (a library building into a caller's stage checks it)."""
        return self._ring

    @property
    def is_live(self) -> bool:
        """Whether the device views hold this stage's values for a kernel queued now.

        False before the copy is issued (the views still hold older bytes), once the slot was
        recycled (ring) and once the stage closed (in place: its fence covers only readers
        launched before close).
        """
        placement = self.placement
        if placement is IN_PLACE:
            return self.is_open and self._ring.slot_generation(self.slot) == self.generation
        if self.state is OPEN:
            return False
        return placement is not RING or self._ring.slot_generation(self.slot) == self.generation

    def check_live(self, what: str = "staged slice") -> None:
        if not self.is_live:
            if self.state is OPEN and self.placement is not IN_PLACE:
                raise StaleLeaseError(
                    f"{what} of stage {self.generation} (slot {self.slot}) was used before its copy was issued: "
                    "the device view still holds older bytes; flush() first, then launch its readers"
                )
            after = "its stage closed" if self.placement is IN_PLACE else "its slot was recycled"
            raise StaleLeaseError(
                f"{what} of stage {self.generation} (slot {self.slot}) was used after {after}; ring views live "
                f"{VIEW_LIFETIME}, zero-copy views until close; stage data that must live longer in an owned "
                "stage (owned=)"
            )

    # -- ad-hoc values -----------------------------------------------------------------
    def put(self, values: Any, dtype: Any = None, *, name: str = "values") -> Any:
        """Write ``values`` into the slot; return the device tensor they will land in.

        Accepts lists, tuples and scalars (``dtype`` required), numpy arrays, CPU tensors and
        bytes-like objects, converted exactly or refused with a typed error before the
        stage advances. With a layout, ``put("field", values)`` writes that field's live rows.
        """
        if self.state is not OPEN:
            self._check_open()
        if type(values) is str:
            self._put_field(values, dtype)
            return None
        if type(values) is list and type(dtype) is torch.dtype:
            # A scheduler's per-request list: struct checks each element (ints in range,
            # floats that fit) and packs it straight into the slot.
            numel = len(values)
            packer = PACKERS.get((dtype, numel)) or packer_for(dtype, numel)
            start = self._cursor
            if packer is not None:
                end = start + packer.size
                if end <= self.capacity and end <= self.tail:
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
            if self._ring.settings.overflow.value == "spill" and self.placement is not IN_PLACE:
                device = self._ring._spill(self, src, target, numel, name)  # raises before queueing on bad values
                self.copy_issued = True
                return device if len(shape) == 1 else device.view(shape)
            raise CapacityError(self._capacity_message(nbytes, name))
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
        """Claim ``numel`` elements: (numpy host view to fill in place, device view they land in).

        For callers that pack records themselves; numpy dtypes only. The host view is valid
        until the copy is issued. Never spills: ``CapacityError`` when it does not fit.
        """
        if self.state is not OPEN:
            self._check_open()
        target = check_dtype(dtype, name)
        if target not in NUMPY_DTYPE:
            raise StagingTypeError(f"'{name}' reserve() needs a numpy dtype (got {target}); use put() for it")
        if not int_in_range(numel, 0):
            raise StagingValueError(f"'{name}' numel must be an int >= 0 (got {numel!r})")
        start = align_up(self._cursor, _ITEMSIZE[target])
        nbytes = numel * _ITEMSIZE[target]
        if start + nbytes > min(self.capacity, self.tail):
            raise CapacityError(self._capacity_message(nbytes, name))
        first = start // _ITEMSIZE[target]
        host = self._mem.host[target][first : first + numel]
        return host, self._advance(start, target, numel, nbytes)

    def land(self, numel: int, dtype: torch.dtype = torch.int64) -> tuple[torch.Tensor, Landing]:
        """Have a kernel store ``numel`` values straight into this slot: (int64 device addresses, handle).

        The values' bytes are claimed at the slot's end (outside the copy), and each one's
        pinned host address is put in the copy: pass that view to the writer
        (``pinpool.landing.land``, or the sampler's ``land_to``), launch it after ``flush``
        and before close, on the stage's stream or a registered consumer. The handle reads
        the values after a successful close. Needs ``PoolSettings(zero_copy=True)``.
        """
        if self.state is not OPEN:
            self._check_open()
        if not self._ring.can_land:
            self._ring._check_can_land()  # raises, saying why
        if not int_in_range(numel, 0):
            raise StagingValueError(f"'numel' must be an int >= 0 (got {numel!r})")
        itemsize = landing_itemsize(dtype)
        tail, cursor, used, landing_bytes = self.tail, self._cursor, self.used_bytes, self.landing_bytes
        start = self._claim_tail(numel * itemsize, "landing")
        handle, column = self._new_landing(start, numel, dtype)
        try:
            at = self._cursor
            end = at + len(column)
            if end <= self.capacity and end <= self.tail:
                mem = self._mem
                mem.host_bytes[mem.host_base + at : mem.host_base + at + len(column)] = column
                addresses = self._advance(at, torch.int64, numel, len(column))
            else:  # as a put that does not fit: spilled where the pool spills, refused otherwise
                addresses = self.put(np.frombuffer(column, np.int64), torch.int64, name="landing")
        except BaseException:
            self.tail, self._cursor, self.used_bytes, self.landing_bytes = tail, cursor, used, landing_bytes
            self._landings.pop()
            raise
        return addresses, handle

    def readback(self, src: torch.Tensor) -> Readback:
        """Copy device tensor ``src`` back into this stage's slot, under the slot's fence; flushes first.

        One slot and one fence serve both directions: put, flush, launch the step, then read
        back its output. Launch every kernel that reads the stage before it; nothing can be
        put after it. Read the handle within ``VIEW_LIFETIME``.
        """
        if not self.is_open:
            self._check_open()
        offset = align_up(self._cursor, self._mem.alignment)
        host_t, host_np, nbytes = self._ring._readback_views(self._mem, src, offset)  # typed errors first
        if offset + nbytes > self.tail:
            raise CapacityError(
                f"'src' needs {nbytes} bytes but the slot has {max(self.tail - offset, 0)} left before its landings; "
                "raise PoolSettings.slot_bytes"
            )
        if self.state is OPEN:
            self.flush()
        if self._block is not None:
            self._block.wait_for_readers(self.stream)  # ``src`` is written by the replay, maybe on a reader
        handle = self._ring._copy_back(self, host_t, host_np, src, nbytes)
        self._cursor = offset + nbytes
        self.copy_issued = True
        return handle

    def retain(self, *objs: Any) -> None:
        """Keep ``objs`` alive until this slot's fence has passed: it follows kernels launched before close."""
        if not self.is_open:
            self._check_open()
        self._ring._retain(self.slot, objs)

    # -- layout ------------------------------------------------------------------------
    def open_layout(self, layout: Layout, rows: int, live: int) -> None:
        """Claim ``layout`` for ``rows`` rows, ``live`` of them real, and its landings (the ring checked the counts)."""
        mem, dst = self._mem, self.dst
        key = ("layout", id(layout), id(dst), rows)  # ids: the entry holds both, so neither id is reused
        placed = mem.views.get(key) if self.placement is not OWNED else None
        if placed is None:
            placed = Placed(layout, rows, mem, dst, self._block.views(rows) if self._block is not None else None)
            if placed.nbytes > self.capacity:
                raise CapacityError(
                    f"a layout of {rows} rows needs {placed.nbytes} bytes but the stage has {self.capacity}; "
                    "raise PoolSettings.slot_bytes or lower max_rows"
                )
            if self.placement is not OWNED:  # an owned buffer may be another one next time
                mem.views.put(key, placed)
        self.layout, self.rows, self.live, self._placed = layout, rows, live, placed
        self._written, self._padded, self._columns = 0, False, []
        self.used_bytes, self._cursor = placed.nbytes, placed.cursor
        if layout.landings:
            for i, at, dtype in placed.landings:
                start = self._claim_tail(live * LANDING_ITEMSIZE[dtype], layout.fields[i].name)
                column = self._new_landing(start, live, dtype)[1]
                mem.host_bytes[at : at + len(column)] = column
                self._columns.append((at, column))
        if self.placement is IN_PLACE and live < rows:
            # Read in place from the moment they are handed out: the padding rows are written now.
            for view, pad in zip(placed.host_views, layout.pads, strict=True):
                view[live:] = pad
            self._padded = True

    def host(self, name: str) -> np.ndarray[Any, Any]:
        """Field ``name``'s live rows in the pinned slot, to fill in place before the copy (counts as written)."""
        if self.state is not OPEN:
            self._check_open()
        i = self._input_field(name)
        self._written |= 1 << i
        assert self._placed is not None  # a layout's stage: ``_input_field`` raised otherwise
        return self._placed.host_views[i][: self.live]

    def put_image(self, image: HostImage) -> None:
        """Every field from a prebuilt host image (padding included): one memcpy."""
        if self.state is not OPEN:
            self._check_open()
        layout = self.layout
        if (
            not isinstance(image, HostImage)
            or image.layout is not layout
            or image.rows != self.rows
            or image.live != self.live
        ):
            raise StagingValueError(
                f"'image' must be this stage's layout.host_image({self.rows}, {self.live}) (got {image!r})"
            )
        assert layout is not None
        data = image.data  # a public attribute: checked, as a size mismatch would write past the layout
        if not isinstance(data, np.ndarray) or data.dtype != np.uint8 or data.shape != (layout.nbytes(self.rows),):
            raise StagingValueError(
                f"'image.data' must be uint8 of the layout's {layout.nbytes(self.rows)} bytes "
                f"(got {getattr(data, 'dtype', type(data).__name__)} {getattr(data, 'shape', '')})"
            )
        mem = self._mem
        mem.host_bytes[mem.host_base : mem.host_base + data.nbytes] = data  # type: ignore[call-overload]
        for at, column in self._columns:  # the image holds no addresses: this step's go back over it
            mem.host_bytes[at : at + len(column)] = column
        self._written, self._padded = layout.all_written, True

    def landing(self, name: str) -> Landing:
        """The handle that reads landing field ``name``'s values after a successful close."""
        layout = self.layout
        i = -1 if layout is None else layout.field(name)
        if layout is None or i not in layout.landings:
            raise StagingValueError(f"'name' must be a landing field of this stage's layout (got {name!r})")
        return self._landings[layout.landings.index(i)]

    # -- internals ---------------------------------------------------------------------
    def _advance(self, start: int, dtype: torch.dtype, numel: int, nbytes: int) -> torch.Tensor:
        """Commit a claim of ``nbytes`` at ``start``: its device view, and the cursor past it."""
        self.used_bytes = start + nbytes
        self._cursor = align_up(self.used_bytes, self._mem.alignment)
        if self.placement is OWNED:
            return self._owned_view(start, dtype, numel)
        hit = self._mem.views.get((id(self.dst), dtype, start, numel))
        return hit[1] if hit is not None else self._keep_view(start, dtype, numel)

    def _keep_view(self, start: int, dtype: torch.dtype, numel: int) -> torch.Tensor:
        """The device view of a claim, kept with the slot: the same claims repeat at the same bytes every lap.

        Keyed by the destination's id and held with it, so the id cannot be another tensor's.
        """
        view = self.dst.view(dtype)[start // dtype.itemsize :][:numel]
        self._mem.views.put((id(self.dst), dtype, start, numel), (self.dst, view))
        return view

    def _owned_view(self, start: int, dtype: torch.dtype, numel: int) -> torch.Tensor:
        """An owned buffer may be another one next time: its views are made, never kept."""
        usable = self.dst.numel() // dtype.itemsize * dtype.itemsize
        return self.dst[:usable].view(dtype)[start // dtype.itemsize :][:numel]

    def _claim_tail(self, nbytes: int, name: str) -> int:
        align = self._mem.alignment
        start = (self.tail - nbytes) // align * align
        if start < self._cursor:
            raise CapacityError(
                f"'{name}' needs {nbytes} bytes but the slot has {max(self.tail - self._cursor, 0)} left; "
                "raise PoolSettings.slot_bytes"
            )
        self.tail, self.landing_bytes = start, True
        return start

    def _new_landing(self, start: int, numel: int, dtype: torch.dtype) -> tuple[Landing, bytes]:
        """The handle of ``numel`` landed ``dtype`` values at ``start`` of the slot, and their address column.

        A decode step lands at the same bytes of a slot every lap: the column and the typed
        view are made once per (start, numel, dtype) and kept with the slot (no numpy call
        a step, where the first numpy calls after a step's launches run cold).
        """
        mem = self._mem
        key = ("landing", start, numel, dtype)
        hit = mem.views.get(key)
        if hit is None:
            values = mem.host[torch.uint8][start : start + numel * LANDING_ITEMSIZE[dtype]].view(NUMPY_DTYPE[dtype])
            hit = mem.views.put(key, ((landing_column(numel, dtype) + (mem.address + start)).tobytes(), values))
        handle = Landing(self._ring, self.slot, self.generation, mem.fence, hit[1])
        self._landings.append(handle)
        return handle, hit[0]

    def _issue(self) -> None:
        """Padding, the block's ordering, the one copy: OPEN -> FLUSHED."""
        layout = self.layout
        if layout is not None:
            if self.live and self._written != layout.all_written:
                written = self._written
                missing = [f.name for i, f in enumerate(layout.fields) if f.lands is None and not written >> i & 1]
                self.close(ok=False)
                raise PoolStateError(
                    f"every input field must be written each step (missing: {missing}); the slot still holds an "
                    "older step's values there, so the stage was aborted and nothing was copied"
                )
            live = self.live
            if live < self.rows and not self._padded:
                assert self._placed is not None
                for view, pad in zip(self._placed.host_views, layout.pads, strict=True):
                    view[live:] = pad
        block = self._block
        if block is not None:
            block.before_copy(self.stream)
        if self.placement is not IN_PLACE:
            self._ring._issue_copy(self)
        self.state = FLUSHED
        if block is not None:
            block.after_copy(self.stream)

    def _put_field(self, name: str, values: Any) -> None:
        placed = self._placed
        spec = placed.fields.get(name) if placed is not None else None
        if spec is None or placed is None:
            self._input_field(name)  # raises: no layout, an unknown field, or a landing
            return
        i, at, dtype = spec
        live = self.live
        if type(values) is list and len(values) == live:
            packer = PACKERS.get((dtype, live)) or packer_for(dtype, live)
            if packer is not None:
                try:
                    # Packed aside (pack_into may write part of the field before it raises): a
                    # refused put leaves the field's earlier values, as the general path does.
                    packed = packer.pack(*values)
                except (struct.error, TypeError, OverflowError):
                    pass  # the general path converts or raises typed
                else:
                    self._mem.host_bytes[at : at + len(packed)] = packed
                    self._written |= 1 << i
                    return
        src, _, shape = as_source(values, dtype, name)
        if math.prod(shape) != live:
            raise StagingValueError(f"'{name}' must hold {live} values, one per live row (got shape {shape})")
        if isinstance(src, np.ndarray):
            write(placed.host_views[i][:live], src, dtype, name)  # arrays are checked before they are copied
        else:  # a list is written, then checked: aside, so a refused one leaves the field as it was
            converted = np.empty(live, NUMPY_DTYPE[dtype])
            write(converted, src, dtype, name)
            placed.host_views[i][:live] = converted
        self._written |= 1 << i

    def _input_field(self, name: str) -> int:
        layout = self.layout
        if layout is None:
            raise StagingTypeError(f"put({name!r}, ...) names a field, but this stage has no layout")
        i = layout.field(name)
        if layout.fields[i].lands is not None:
            raise PoolStateError(f"field {name!r} is a landing: the stage writes its addresses itself")
        return i

    def _check_open(self) -> None:
        if not self.is_open:
            raise PoolStateError(f"this stage is {self.state.value}: open a new one with pool.stage()")
        if self.state is FLUSHED:
            raise PoolStateError("this stage was flushed: its copy is issued, so nothing more can be put")

    def _capacity_message(self, nbytes: int, name: str) -> str:
        limit = "owned buffer" if self.placement is OWNED and self.capacity < self._mem.nbytes else "slot"
        free = max(min(self.capacity, self.tail) - self._cursor, 0)
        return (
            f"'{name}' needs {nbytes} bytes but the {limit} has {free} of {self.capacity} left; raise "
            "PoolSettings.slot_bytes (PINPOOL_SLOT_BYTES) or pass overflow='spill'"
        )
