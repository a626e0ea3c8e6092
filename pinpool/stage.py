"""``Stage``: one open batch in one slot, and the lease on what it staged.

Values are written into the slot's pinned host region as they arrive; the matching
device views are handed back at once, and the data lands there with the stage's single
copy (issued by ``flush()`` or on exit), on the stream fixed when the stage opened.
Device views of a ring stage stay valid for ``num_slots - 1`` further claims of the ring
(``VIEW_LIFETIME``: stages, owned stages, read-backs, library calls' own stages; see
``PinnedRingBuffer.claims``); ``is_live`` / ``check_live`` say whether the slot has
been recycled since.
"""

from __future__ import annotations

import math
import struct
from types import TracebackType
from typing import Any, Protocol

import numpy as np
import torch

from pinpool.cache import BoundedCache
from pinpool.encode import NUMPY_DTYPE, PACKERS, as_source, check_dtype, int_in_range, packer_for, write, write_list
from pinpool.exceptions import CapacityError, PoolStateError, StagingTypeError, StagingValueError, StaleLeaseError
from pinpool.platform import PlatformReport
from pinpool.readback import Landing, Readback, SlotReads
from pinpool.settings import OverflowPolicy, PoolSettings
from pinpool.slots import VIEW_LIFETIME, SlotLayout, align_up
from pinpool.transport import Fence, Stream

_ITEMSIZE = {d: torch.empty((), dtype=d).element_size() for d in [*NUMPY_DTYPE, torch.bfloat16]}
_NUMPY_ITEMSIZE = {d: _ITEMSIZE[d] for d in NUMPY_DTYPE}
#: What a landing carries (``pinpool.landing.LANDING_DTYPES``), with each one's size.
LANDING_ITEMSIZE = {torch.int64: 8, torch.int32: 4, torch.float32: 4}
#: Each landed value's address carries its landing's dtype in its two low bits (free: the
#: values are at least 4-byte aligned), so a writer stores exactly that dtype, converted,
#: whatever it computed: an int64 token into an int32 landing never runs past it.
LANDING_TAG = {torch.int64: 0, torch.int32: 1, torch.float32: 2}
_OFFSETS: BoundedCache[tuple[int, int], np.ndarray[Any, Any]] = BoundedCache()


class SlotInterface(SlotReads, Protocol):
    """What a stage asks of its ring: the ring's slot interface (``PinnedRingBuffer`` is the one implementation).

    Typed here, beside its users (``Stage``, ``Exchange``, ``ZeroCopyStage``, ``StaticInputs``'
    landings), so that the stage modules never import the ring: the ring imports them.
    """

    @property
    def settings(self) -> PoolSettings: ...

    @property
    def platform(self) -> PlatformReport: ...

    @property
    def device(self) -> torch.device: ...

    @property
    def can_land(self) -> bool: ...

    def slot_fence(self, slot: int) -> Fence: ...

    def retain(self, slot: int, objs: tuple[Any, ...]) -> None: ...

    def spill(self, st: Stage, src: Any, dtype: torch.dtype, numel: int, name: str) -> torch.Tensor: ...

    def issue_copy(self, st: Stage) -> None: ...

    def finish_stage(self, st: Stage, ok: bool) -> None: ...

    def finish_zero_copy(self, st: Stage, ok: bool) -> None: ...

    def readback_views(self, slot: int, src: torch.Tensor, offset: int) -> tuple[torch.Tensor, Any, int]: ...

    def copy_back(
        self,
        slot: int,
        generation: int,
        src: torch.Tensor,
        offset: int,
        stream: Stream,
        views: tuple[torch.Tensor, Any, int] | None = None,
    ) -> Readback: ...


def landing_itemsize(pool: SlotInterface, dtype: torch.dtype) -> int:
    """The size of a landed ``dtype`` value, once the pool's kernels may write its slots; typed errors else."""
    if not pool.can_land:
        raise pool.platform.refusal(pool.device)  # PoolStateError / PlatformError, saying why
    itemsize = LANDING_ITEMSIZE.get(dtype)
    if itemsize is None:
        known = list(map(str, LANDING_ITEMSIZE))
        raise StagingTypeError(f"'dtype' of a landing must be one of {known} (got {dtype})")
    return itemsize


def landing_offsets(numel: int, dtype: torch.dtype) -> np.ndarray[Any, Any]:
    """int64 [numel]: each value's byte offset in a landing plus its dtype tag, cached (the same every step)."""
    offsets = _OFFSETS.get((numel, LANDING_TAG[dtype]))
    if offsets is None:
        column = np.arange(numel, dtype=np.int64) * LANDING_ITEMSIZE[dtype] + LANDING_TAG[dtype]
        offsets = _OFFSETS.put((numel, LANDING_TAG[dtype]), column)
    return offsets


#: Why a stage with landings that was never flushed is refused at close.
LAND_WITHOUT_FLUSH = (
    "land() needs flush() before close: the writer must be launched between the two, after the copy that "
    "carries its addresses; the stage was aborted and nothing was copied"
)
_NESTED = (list, tuple, np.ndarray)
#: torch dtype -> its numpy dtype object (compared by identity: numpy keeps one per builtin
#: native-order type, so a byte-swapped array takes the converting path).
_NUMPY_OF = {d: np.dtype(n) for d, n in NUMPY_DTYPE.items()}


class Stage:
    """An open stage: ``put`` / ``reserve`` values, then one copy on exit.

    Example::

        with pool.stage() as st:
            temps = st.put([0.7, 1.0], torch.float32)   # device view, lands with the copy
            host, dev = st.reserve(256, torch.int32)    # fill ``host`` in place before exit
            host[:] = 7
        # exit: one copy of the used bytes on ``st.stream``, then the slot's fence

    ``st.stream`` is fixed when the stage opens; the copy, the fence and read-backs use
    it wherever the stage is closed.
    """

    __slots__ = (
        "_align",
        "_capacity",
        "_cursor",
        "_landings",
        "_layout",
        "_open",
        "_pool",
        "_tail",
        "copy_issued",
        "flushed",
        "generation",
        "guarded_by",
        "landings",
        "owned_device",
        "owned_reused",
        "read_back",
        "slot",
        "spilled",
        "stream",
        "used_bytes",
    )

    def __init__(
        self,
        pool: SlotInterface,
        layout: SlotLayout,
        slot: int,
        generation: int,
        stream: Stream,
        owned_device: torch.Tensor | None,
    ) -> None:
        self._pool = pool
        self._layout = layout
        self.slot = slot
        self.generation = generation
        #: The stream this stage's copy, fence and read-backs go to, fixed at open.
        self.stream = stream
        #: Consumer-owned device memory the copy lands in instead of the ring (rule 4).
        self.owned_device = owned_device
        #: True when the caller passes this same ``owned=`` buffer stage after stage (``reuse_owned=True``).
        self.owned_reused = False
        slot_bytes = layout.nbytes
        self._capacity = slot_bytes if owned_device is None else min(slot_bytes, owned_device.numel())
        self._align = layout.alignment
        self._cursor = 0
        #: Bytes of the slot the stage's copy covers so far (puts, reservations, address columns).
        #: Kept by the stage, read by the ring: read-only to callers.
        self.used_bytes = 0
        # Landings (``land``) are claimed from the slot's end down, outside the
        # copied bytes; puts, reservations and read-backs stop where they start.
        self._tail = slot_bytes
        #: Landing handles of this stage (``land``), made readable by a successful close.
        self._landings: list[Landing] = []
        #: True once landing bytes are claimed (``land``): kernels store into this stage's slot,
        #: so its fence follows them (and every registered consumer). Read-only to callers.
        self.landings = False
        self._open = True
        self.flushed = False
        self.spilled = False
        self.read_back = False
        #: True once a copy of this stage is queued: its fence must then be recorded.
        self.copy_issued = False
        #: Streams besides the registered consumers whose work the slot's fence follows (a
        #: ``StaticInputs`` block's readers): debug mode does not refuse a close under them.
        self.guarded_by: tuple[Stream, ...] = ()

    # -- context manager ---------------------------------------------------------------
    def __enter__(self) -> Stage:
        return self

    def __exit__(
        self, exc_type: type[BaseException] | None, exc: BaseException | None, tb: TracebackType | None
    ) -> None:
        self.close(ok=exc_type is None)

    def close(self, ok: bool = True) -> None:
        """Finish a stage opened without ``with``: copy (if ``ok``) and record the fence."""
        if self._open:
            # A landing's addresses travel in the copy, and its writer runs after it: with the
            # copy issued only now, at close, no writer can have stored into the slot.
            flushed = self.flushed
            self._open = False
            if ok and not flushed and self._landings:
                # The copy would carry live addresses that a kernel launched after close
                # could still store through, past the slot's fence: abort instead.
                self._pool.finish_stage(self, False)
                raise PoolStateError(LAND_WITHOUT_FLUSH)
            self._pool.finish_stage(self, ok)
            if ok and flushed and self._landings:
                for handle in self._landings:  # arm_landings, inline: it runs every decode step
                    handle.armed = True

    def arm_landings(self) -> None:
        """After a successful close: the slot's fence follows the writing kernels, so the handles may read."""
        for handle in self._landings:
            handle.armed = True

    # -- staging -----------------------------------------------------------------------
    @property
    def pool(self) -> SlotInterface:
        """The pool this stage belongs to (a library building into a caller's stage checks it)."""
        return self._pool

    @property
    def is_open(self) -> bool:
        """True until the stage is closed (by ``with`` exit or ``close``)."""
        return self._open

    @property
    def owned(self) -> bool:
        return self.owned_device is not None

    def put(self, values: Any, dtype: torch.dtype | None = None, *, name: str = "values") -> torch.Tensor:
        """Write ``values`` into the slot and return the device tensor they will land in.

        Accepts lists/tuples/scalars (``dtype`` required), numpy arrays, CPU tensors and
        bytes-like objects. The value is converted exactly or a typed error is raised
        before the stage advances.
        """
        if not self._open or self.flushed:
            self._check_open()
        if type(values) is list and type(dtype) is torch.dtype:
            # Hot path (a scheduler's per-request list): claim and write inline, in as few
            # calls as possible (right after a step's launches each call runs cold).
            numel = len(values)
            packer = PACKERS.get((dtype, numel))
            if packer is None:
                packer = packer_for(dtype, numel)  # None for a dtype struct does not pack
            start = self._cursor
            if packer is not None and start + packer.size <= self._capacity and start + packer.size <= self._tail:
                layout = self._layout
                try:
                    # struct checks each element: ints in range, floats that fit (``packer_for``).
                    packer.pack_into(layout.host_bytes, layout.host_base + start, *values)
                except (struct.error, TypeError, OverflowError):
                    pass  # not exact as struct packs it, or nested: the paths below convert or raise typed
                else:
                    first = start // _NUMPY_ITEMSIZE[dtype]
                    device = layout.device_views.get((dtype, first, numel)) if self.owned_device is None else None
                    if device is None:
                        device = self._device_view(dtype, first, numel)
                    end = self.used_bytes = start + packer.size
                    self._cursor = align_up(end, self._align)
                    return device
        if type(values) is list and dtype in _NUMPY_ITEMSIZE and not (values and type(values[0]) in _NESTED):
            # A flat list struct would not pack (a dtype it has no code for, a value it
            # refused): numpy writes it, or raises the typed error.
            numel = len(values)
            itemsize = _NUMPY_ITEMSIZE[dtype]
            start = self._cursor
            end = start + numel * itemsize
            if end <= self._capacity and end <= self._tail:
                first = start // itemsize
                write_list(self._layout.host[dtype][first : first + numel], values, dtype, name)
                device = self._device_view(dtype, first, numel)
                self.used_bytes = end
                self._cursor = align_up(end, self._align)
                return device
            shape: tuple[int, ...] = (numel,)
            src, target = values, dtype
        elif (
            type(values) is np.ndarray
            and values.ndim == 1
            and type(dtype) is torch.dtype
            and values.dtype is _NUMPY_OF.get(dtype)
            and values.flags.c_contiguous
        ):
            # Hot path (a scheduler's own int64/float32 array, already the target dtype): a memcpy.
            numel = values.shape[0]
            itemsize = values.itemsize
            start = self._cursor
            end = start + numel * itemsize
            if end <= self._capacity and end <= self._tail:
                layout = self._layout
                base = layout.host_base + start
                layout.host_bytes[base : base + numel * itemsize] = values.view(np.uint8)  # type: ignore[call-overload]  # numpy arrays are buffers
                device = self._device_view(dtype, start // itemsize, numel)
                self.used_bytes = end
                self._cursor = align_up(end, self._align)
                return device
            src, target, shape = as_source(values, dtype, name)
            numel = math.prod(shape)
        else:
            src, target, shape = as_source(values, dtype, name)
            numel = math.prod(shape)
        host, device = self._claim(numel, target, name, src)
        if host is not None:
            write(host, src, target, name)
            self._commit_claim(numel, target)
        return device if len(shape) == 1 else device.view(shape)

    def reserve(
        self, numel: int, dtype: torch.dtype, *, name: str = "values"
    ) -> tuple[np.ndarray[Any, Any], torch.Tensor]:
        """Claim ``numel`` elements: (numpy host view to fill in place, device view they land in).

        For callers that pack records themselves; numpy dtypes only (``put`` takes
        bfloat16). The host view is valid only until the stage's copy is issued. A
        reservation never spills: it raises ``CapacityError`` when it does not fit.
        """
        self._check_open()
        target = check_dtype(dtype, name)
        if target not in _NUMPY_ITEMSIZE:
            raise StagingTypeError(f"'{name}' reserve() needs a numpy dtype (got {target}); use put() for it")
        if not int_in_range(numel, 0):
            raise StagingValueError(f"'{name}' numel must be an int >= 0 (got {numel!r})")
        host, device = self._claim(numel, target, name, None)
        assert isinstance(host, np.ndarray)
        self._commit_claim(numel, target)
        return host, device

    def reserve_host(self, nbytes: int, *, name: str = "values") -> np.ndarray[Any, Any]:
        """Claim ``nbytes`` bytes and return only their pinned host view (uint8).

        For a caller that knows where the bytes land on the device itself (an owned stage
        whose buffer it laid out, as ``StaticInputs`` does): no device view is built.
        Same rules as ``reserve``: never spills, valid until the copy is issued.
        """
        start = self.claim_bytes(nbytes, name=name)
        host: np.ndarray[Any, Any] = self._layout.host[torch.uint8][start : start + nbytes]
        return host

    def claim_bytes(self, nbytes: int, *, name: str = "values") -> int:
        """``reserve_host`` without building its view: the claimed bytes' offset in the slot.

        For a caller that keeps its own views of the slot (``StaticInputs``, by slot and size).
        """
        if not self._open or self.flushed:
            self._check_open()  # raises
        if not int_in_range(nbytes, 0):
            raise StagingValueError(f"'{name}' nbytes must be an int >= 0 (got {nbytes!r})")
        start = self._cursor
        if start + nbytes > min(self._capacity, self._tail):
            raise CapacityError(self._capacity_message(nbytes, name))
        end = self.used_bytes = start + nbytes
        self._cursor = align_up(end, self._align)
        return start

    def reserve_landing(self, nbytes: int, *, name: str = "landing") -> tuple[int, np.ndarray[Any, Any]]:
        """Claim ``nbytes`` of the slot's pinned memory for a kernel to write: (host address, uint8 view).

        The building block of ``land`` and ``StaticStage.land``, which also return the handle that reads them.
        The bytes lie past everything the stage copies (claimed from the slot's end), so
        the copy never covers them. Once claimed, the stage's close records the slot's
        fence after its stream and every registered consumer stream (``landings``), even
        with nothing copied or after a read-back, so the slot is not reused before the
        writer ran.
        """
        return self.slot_view(self.claim_landing(nbytes, name=name), nbytes)

    def slot_view(self, start: int, nbytes: int) -> tuple[int, np.ndarray[Any, Any]]:
        """(host address, uint8 view) of ``nbytes`` of this slot's pinned bytes at ``start``, claimed by this stage."""
        host: np.ndarray[Any, Any] = self._layout.host[torch.uint8][start : start + nbytes]
        return self._layout.host_raw.data_ptr() + start, host

    def claim_landing(self, nbytes: int, *, name: str = "landing") -> int:
        """``reserve_landing`` without building its views: the claimed bytes' offset in the slot."""
        if not self._open:
            self._check_open()  # raises: closed
        if not int_in_range(nbytes, 0):
            raise StagingValueError(f"'{name}' nbytes must be an int >= 0 (got {nbytes!r})")
        align = self._align
        start = (self._tail - nbytes) // align * align
        if start < self._cursor:
            raise CapacityError(
                f"'{name}' needs {nbytes} bytes but the slot has {max(self._tail - self._cursor, 0)} left "
                f"of {self._pool.settings.slot_bytes}; raise PoolSettings.slot_bytes"
            )
        self._tail = start
        self.landings = True
        return start

    def write_host(self, offset: int, data: bytes | np.ndarray[Any, Any]) -> None:
        """Copy ``data`` (bytes, or a contiguous uint8 array) into the slot's pinned bytes at ``offset``: a memcpy.

        For a caller that wrote those bytes' layout itself (``StaticStage.land``); the
        bytes must be ones this stage claimed and not yet copied.
        """
        if self.flushed or not self._open:
            self._check_open()  # raises: closed or flushed
        if isinstance(data, np.ndarray) and (data.dtype != np.uint8 or data.ndim != 1 or not data.flags.c_contiguous):
            raise StagingTypeError(
                f"'data' must be bytes or a contiguous 1-D uint8 array (got {data.dtype} {data.shape})"
            )
        nbytes = len(data)
        # The memoryview spans the whole slab: a write past this slot would land in another one.
        if not int_in_range(offset, 0, self._tail - nbytes):
            raise CapacityError(
                f"'data' ({nbytes} bytes at offset {offset!r}) must lie in this slot's first {self._tail} bytes"
            )
        layout = self._layout
        base = layout.host_base + offset
        layout.host_bytes[base : base + nbytes] = data  # type: ignore[assignment]  # numpy arrays are buffers

    def land(
        self, numel: int, dtype: torch.dtype = torch.int64, *, name: str = "landing"
    ) -> tuple[torch.Tensor, Landing]:
        """Have a kernel store ``numel`` values straight into this slot: (device addresses, handle).

        Reserves the values' bytes at the slot's end (outside the copy) and puts, in the
        stage's copy, the pinned host address of each one: pass the returned int64 device
        view to the kernel that writes them (``pinpool.landing.land``, or the sampler's
        ``land_to``). Call it before ``flush``; launch that kernel before close, on the
        stage's stream or a registered consumer stream (close fences after both). The
        handle reads the values after a successful close, within ``num_slots - 1`` further
        claims of the ring (``VIEW_LIFETIME``). Needs ``pool.can_land`` (``PoolSettings(zero_copy=True)``).
        """
        # A step repeats its layout: with the same cursor, tail and size, the landing and its
        # address column land at the same bytes of this slot. They are built once (numpy,
        # the checks) and kept with the slot's layout; a step then copies the column's bytes
        # into place, with no numpy call: right after a step's launches numpy's first calls
        # run cold, at many times their cost alone. A plan exists only
        # for arguments that passed every check below, on a pool whose kernels may land.
        layout = self._layout
        plan = None
        if (
            self._open
            and not self.flushed
            and self.owned_device is None
            and type(numel) is int
            and type(dtype) is torch.dtype
        ):
            plan = layout.landings.get((self._cursor, self._tail, self._capacity, numel, dtype))
        if plan is None:
            landing_itemsize(self._pool, dtype)  # raises where kernels may not write the slots, or for the dtype
            if not int_in_range(numel, 0):
                raise StagingValueError(f"'{name}' numel must be an int >= 0 (got {numel!r})")
            self._check_open()
            key = (self._cursor, self._tail, self._capacity, numel, dtype)
            try:
                plan = self._plan_landing(numel, dtype, name)
            except CapacityError:
                if self._pool.settings.overflow is not OverflowPolicy.SPILL:
                    raise
                return self._land_spilled(numel, dtype, name)
            if self.owned_device is None:  # an owned buffer may be another one next time
                layout.landings.put(key, plan)
        tail, end, offset, column, addresses, values, fence = plan
        base = layout.host_base + offset
        layout.host_bytes[base : base + len(column)] = column
        self._tail, self.landings, self.used_bytes = tail, True, end
        self._cursor = align_up(end, self._align)
        handle = Landing(self._pool, self.slot, self.generation, fence, values)
        self._landings.append(handle)
        return addresses, handle

    def landing_handle(self, values: np.ndarray[Any, Any]) -> Landing:
        """The handle that reads ``values`` (a landing's typed host view) after this slot's fence."""
        pool = self._pool
        return Landing(pool, self.slot, self.generation, pool.slot_fence(self.slot), values)

    def _land_spilled(self, numel: int, dtype: torch.dtype, name: str) -> tuple[torch.Tensor, Landing]:
        """``land`` when the address column does not fit and the pool spills (``overflow='spill'``):
        the landing at the slot's end as always, its addresses through a spilled put (never cached)."""
        tail, landing = self._tail, self.landings
        address, raw = self.reserve_landing(numel * LANDING_ITEMSIZE[dtype], name=name)
        try:
            addresses = self.put(landing_offsets(numel, dtype) + address, torch.int64, name=name)
        except BaseException:
            self._tail, self.landings = tail, landing  # nothing taken
            raise
        handle = self.landing_handle(raw.view(NUMPY_DTYPE[dtype]))
        self._landings.append(handle)
        return addresses, handle

    def _plan_landing(
        self, numel: int, dtype: torch.dtype, name: str
    ) -> tuple[int, int, int, bytes, torch.Tensor, np.ndarray[Any, Any], Fence]:
        """Where a landing of ``numel`` ``dtype`` goes from the stage's current cursor and tail, checked:
        (new tail, new end of the copied bytes, the address column's byte offset in the slot, its
        bytes, its device view, the landing's typed host view, the slot's fence). Leaves the stage
        as it was."""
        itemsize = LANDING_ITEMSIZE[dtype]
        tail, landing, cursor, end = self._tail, self.landings, self._cursor, self.used_bytes
        try:
            address, raw = self.reserve_landing(numel * itemsize, name=name)
            host, addresses = self.reserve(numel, torch.int64, name=name)  # never spills: raises when it does not fit
            offset = host.__array_interface__["data"][0] - self._layout.host[torch.uint8].__array_interface__["data"][0]
            column = landing_offsets(numel, dtype) + address
            values = raw.view(NUMPY_DTYPE[dtype])
            fence = self._pool.slot_fence(self.slot)  # one object per slot, for the pool's life
            return self._tail, self.used_bytes, offset, column.tobytes(), addresses, values, fence
        finally:
            # Planned only: ``land`` applies the plan.
            self._tail, self.landings, self._cursor, self.used_bytes = tail, landing, cursor, end

    def retain(self, *objs: Any) -> None:
        """Keep ``objs`` alive until this slot's fence has passed (rule 5).

        The fence is recorded on exit, after any kernel launched between ``flush()``
        and exit, so a tensor whose address was staged outlives that kernel.
        """
        self._check_open()
        self._pool.retain(self.slot, objs)

    def flush(self) -> None:
        """Issue the stage's one copy now, leaving the stage open for kernel launches."""
        if not self._open or self.flushed:
            self._check_open()  # raises
        self._pool.issue_copy(self)
        self.flushed = True

    def readback(self, src: torch.Tensor) -> Readback:
        """Copy the device tensor ``src`` back into this stage's slot, under the slot's fence.

        For a step that uploads its metadata and reads back its result: put, flush, launch
        the step's kernels, then ``readback`` their output. One slot and one fence serve
        both directions instead of two. The fence is recorded here, after this copy, so
        call it last: kernels that read the stage's data or its retained tensors must be
        launched before it, and nothing can be put or retained after it. Several
        read-backs may follow each other. Read the handle within ``num_slots - 1`` further
        claims of the ring (``VIEW_LIFETIME``), like ``pool.readback``.
        """
        return self.readback_planned(src, self.readback_plan(src))

    def readback_plan(self, src: torch.Tensor) -> tuple[int, tuple[torch.Tensor, Any, int]]:
        """Where ``readback(src)`` would copy in this slot, checked: (offset, the pinned views).

        Raises the typed errors of a read-back it cannot do and changes nothing, so a
        caller that must flush its own way first (``StaticStage``) can check before it.
        """
        if not self._open:
            self._check_open()
        offset = align_up(self._cursor, self._align)
        views = self._pool.readback_views(self.slot, src, offset)  # typed errors for a src it cannot copy
        if offset + views[2] > self._tail:
            raise CapacityError(
                f"'src' needs {views[2]} bytes but the slot has {self._tail - offset} left "
                "before its landings; raise PoolSettings.slot_bytes"
            )
        return offset, views

    def readback_planned(self, src: torch.Tensor, plan: tuple[int, tuple[torch.Tensor, Any, int]]) -> Readback:
        """``readback`` with ``readback_plan(src)`` already taken: flush if needed, then the copy and the fence."""
        offset, views = plan
        if not self.flushed:
            self.flush()
        # The fence is recorded after this copy (and so after the stage's upload and every
        # kernel launched before): the stage's exit need not record it again.
        handle = self._pool.copy_back(self.slot, self.generation, src, offset, self.stream, views)
        self._cursor = offset + views[2]
        self.read_back = self.copy_issued = True
        return handle

    # -- lease -------------------------------------------------------------------------
    @property
    def is_live(self) -> bool:
        """False once the slot has been recycled: ring views then hold other data."""
        return self.owned or self._pool.slot_generation(self.slot) == self.generation

    def check_live(self, what: str = "staged slice") -> None:
        if not self.is_live:
            raise StaleLeaseError(
                f"{what} of stage {self.generation} (slot {self.slot}) was used after the slot was "
                f"recycled by claim {self._pool.slot_generation(self.slot)}; use an owned stage "
                f"(pool.stage(owned_bytes=...)) for data that must outlive {VIEW_LIFETIME}"
            )

    # -- internals ---------------------------------------------------------------------
    def _check_open(self) -> None:
        if not self._open:
            raise PoolStateError("this stage is closed: open a new one with pool.stage()")
        if self.flushed:
            raise PoolStateError("this stage was flushed: its copy is issued, so nothing more can be put")

    def _claim(
        self, numel: int, dtype: torch.dtype, name: str, src: Any
    ) -> tuple[np.ndarray[Any, Any] | torch.Tensor | None, torch.Tensor]:
        itemsize = _ITEMSIZE[dtype]
        start = self._cursor
        if start + numel * itemsize > min(self._capacity, self._tail):
            if self._pool.settings.overflow is OverflowPolicy.SPILL and src is not None:
                device = self._pool.spill(self, src, dtype, numel, name)  # raises before queueing on bad values
                self.spilled = self.copy_issued = True
                return None, device
            raise CapacityError(self._capacity_message(numel * itemsize, name))
        first = start // itemsize
        return self._layout.host_view(dtype, first, numel), self._device_view(dtype, first, numel)

    def _device_view(self, dtype: torch.dtype, first: int, numel: int) -> torch.Tensor:
        owned = self.owned_device
        if owned is None:
            return self._layout.device_view(dtype, first, numel)
        itemsize = _ITEMSIZE[dtype]
        usable = owned.numel() // itemsize * itemsize
        return owned[:usable].view(dtype)[first : first + numel]

    def _commit_claim(self, numel: int, dtype: torch.dtype) -> None:
        self.used_bytes = self._cursor + numel * _ITEMSIZE[dtype]
        self._cursor = align_up(self.used_bytes, self._align)

    def _capacity_message(self, nbytes: int, name: str) -> str:
        limit = "owned buffer" if self.owned and self._capacity < self._pool.settings.slot_bytes else "slot"
        free = max(min(self._capacity, self._tail) - self._cursor, 0)  # landings take the slot's end
        return (
            f"'{name}' needs {nbytes} bytes but the {limit} has {free} of "
            f"{self._capacity} left; raise PoolSettings.slot_bytes (PINPOOL_SLOT_BYTES) or pass "
            "overflow='spill'"
        )
