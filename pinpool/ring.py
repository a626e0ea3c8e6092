"""``PinnedRingBuffer``: persistent pinned host slots, their device mirror, and the rules of reuse.

The ring owns every slot's state: its fence, its last user's stream, its generation and
what it keeps alive. ``Stage`` and ``Readback`` reach it only through the methods under
"the slot interface" below. A value's path: ``Stage.put`` writes the slot's pinned
region (stage.py), ``issue_copy`` lands the used bytes with one copy on the stage's
stream, ``finish_stage`` records the slot's fence there, and the next ``_claim`` of the
slot waits on that fence before the host writes the region again.

The rules are the README's, numbered the same: 1 host reuse waits on the fence; 2 the
device region is rewritten only after its readers, on any stream; 3 one copy per stage;
4 owned stages for data that outlives the ring; 5 ``retain``; 6 read-backs; 7 the host
path; 8 every CUDA call under the pool's device (the transport's job).

Zero-copy stages (zero_copy.py) share the slots and rule 1; their fence is recorded at
close after the readers, and they never touch the device mirror (``finish_zero_copy``).
"""

from __future__ import annotations

import threading
import time
import weakref
from collections.abc import Callable, Sequence
from typing import Any

import attrs
import numpy as np
import torch

from pinpool.cache import BoundedCache
from pinpool.encode import NUMPY_DTYPE, int_in_range, write
from pinpool.exceptions import (
    CapacityError,
    DeviceMismatchError,
    PoolStateError,
    SettingsTypeError,
    ThreadOwnershipError,
)
from pinpool.exchange import Exchange, Field
from pinpool.log import get_logger
from pinpool.platform import PlatformReport
from pinpool.readback import Readback
from pinpool.settings import PoolSettings
from pinpool.slots import SlotLayout, align_up
from pinpool.stage import Stage
from pinpool.stats import Counters, PoolStats
from pinpool.transport import Fence, Stream, Transport, transport_for, wait_for_streams
from pinpool.zero_copy import ZeroCopyStage, refuse_unregistered_reader

_log = get_logger("pinpool")


def _never_capturing(stream: Stream) -> bool:
    return False


def _dead_ref() -> torch.Tensor | None:
    """A stand-in for a weak reference whose object is gone (no buffer reused yet)."""
    return None


_OwnedRange = tuple[torch.Tensor, torch.Tensor, torch.Tensor, int]
#: Why a stage or read-back is refused while a CUDA graph capture would take it.
CAPTURE_REFUSAL = (
    "a stream this stage would touch is capturing a CUDA graph (its 'stream', or the current "
    "stream): the stage's copy and fence (or a zero-copy stage's reads) would be baked into the "
    "graph at this slot's address, every replay reading or writing the slot after the ring has "
    "reused it, and its fence query breaks a default-mode capture; stage before the capture or "
    "between replays, and give the graph StaticInputs views (fixed addresses)"
)
_POISON_BYTE = 0xFF  # NaN in every float dtype, -1 in every signed int dtype


class PinnedRingBuffer:
    """A ring of ``num_slots`` reusable staging slots for one device.

    Example::

        pool = PinnedRingBuffer(PoolSettings(device="cuda:0", num_slots=4))
        with pool.stage() as st:            # stream fixed now: the current one
            temps = st.put([0.7, 1.0], torch.float32)
        # one copy landed both values; ``temps`` stays valid for 3 more claims

    One pool per worker process and device; it is not thread-safe (``debug=True``
    enforces that it is only used from the thread that created it).
    """

    def __init__(self, settings: PoolSettings | None = None, *, transport: Transport | None = None) -> None:
        """Allocate the pinned slab, the device mirror and one fence per slot: all the memory it will use.

        ``transport``: how copies and fences are made (default: CUDA through torch, or
        plain host memory on CPU); tests pass ``pinpool.testing.LaggingGpu``.
        """
        if settings is not None and not isinstance(settings, PoolSettings):
            raise SettingsTypeError(
                f"'settings' must be a PoolSettings or None (got {settings!r}); e.g. PoolSettings(device='cpu')"
            )
        self.settings = settings if settings is not None else PoolSettings()
        self._transport = transport if transport is not None else transport_for(self.settings.device)
        #: Whether a graph capture would take a stage on a stream (a caller's own transport may
        #: not say: then never).
        self._capturing: Callable[[Stream], bool] = getattr(self._transport, "capturing", _never_capturing)
        #: The stage's stream and the capture question in one call where the transport has
        #: one (``resolve_for_stage``: two C calls on CUDA in the common case), else apart.
        self._resolve_for_stage: Callable[[Stream | None], tuple[Stream, bool]] = getattr(
            self._transport, "resolve_for_stage", self._resolve_then_ask
        )
        if self._transport.device != self.settings.device:
            raise DeviceMismatchError(
                f"'transport' must serve the settings' device {self.settings.device} (got {self._transport.device})"
            )
        slot_bytes, num_slots = self.settings.slot_bytes, self.settings.num_slots
        self._num_slots = num_slots
        # The settings are frozen: the per-stage paths read these copies instead of going
        # through the settings object each time.
        self._slot_bytes = slot_bytes
        self._alignment = self.settings.alignment
        self._debug = self.settings.debug
        self.host_slab = self._transport.alloc_host(slot_bytes * num_slots)
        self.device_mirror = self._transport.alloc_device(slot_bytes * num_slots)
        host_bytes = self.host_slab.numpy().data  # the whole slab as a writable memoryview
        self._layouts = [
            SlotLayout(
                self.host_slab[i * slot_bytes : (i + 1) * slot_bytes],
                self.device_mirror[i * slot_bytes : (i + 1) * slot_bytes],
                host_bytes,
                i * slot_bytes,
                self._alignment,
            )
            for i in range(num_slots)
        ]
        # Per slot: the fence recorded after its last copy (rule 1), the stream of its last
        # user and a hand-off fence for a change of stream (rule 2), its generation, and
        # what must outlive its next fence (rule 5).
        self._fences: list[Fence] = [self._transport.new_fence() for _ in range(num_slots)]
        # The mirror came from the caching allocator on the stream current now, which may
        # still have work queued on memory the block held before: that stream is every
        # slot's first "previous user", so a first stage on another stream waits for it.
        self._last_stream: list[Stream] = [self._transport.resolve_stream(None)] * num_slots
        self._handoff: list[Fence] = [self._transport.new_fence() for _ in range(num_slots)]
        self._slot_generation = [0] * num_slots
        self._retained: list[list[Any]] = [[] for _ in range(num_slots)]
        self._copy_ranges: list[BoundedCache[int, tuple[torch.Tensor, torch.Tensor]]] = [
            BoundedCache() for _ in range(num_slots)
        ]
        #: Per slot: (buffer id, bytes) -> (buffer, its slice, the slot's slice, the buffer's address).
        self._owned_ranges: list[BoundedCache[tuple[int, int], _OwnedRange]] = [
            BoundedCache() for _ in range(num_slots)
        ]
        self._readback_views: list[BoundedCache[tuple[Any, ...], tuple[torch.Tensor, Any, int]]] = [
            BoundedCache() for _ in range(num_slots)
        ]
        self._consumers: list[tuple[Stream, list[Fence]]] = []
        #: Streams teardown waits for besides the slots' last users and the consumers.
        self._teardown_streams: list[Stream] = []
        #: The start-up platform check and, when it passed, each slot's layout whose device
        #: views alias its pinned host region (UVA): built once, like the copy layouts.
        self.platform = PlatformReport.unchecked()
        self._zero_copy_layouts: list[SlotLayout] | None = None
        if self.settings.zero_copy:
            self.platform, alias = self._transport.check_zero_copy(self.host_slab)
            if alias is not None and self.platform.zero_copy_ok:
                self._zero_copy_layouts = [
                    SlotLayout(
                        layout.host_raw,
                        alias[i * slot_bytes : (i + 1) * slot_bytes],
                        host_bytes,
                        i * slot_bytes,
                        self._alignment,
                    )
                    for i, layout in enumerate(self._layouts)
                ]
        self._next_slot = 0
        #: The last ``owned`` buffer passed with ``reuse_owned=True`` that passed its checks.
        self._reused_owned: Callable[[], torch.Tensor | None] = _dead_ref
        self._device_index = self.device.index if self.device.type == "cuda" else -1
        self._generation = 0
        self._open: Stage | None = None
        self._closed = False
        self._owner_thread = threading.get_ident()
        self._counters = Counters(host_allocations=1, device_allocations=1)
        _log.info(
            "pool.created",
            device=str(self.settings.device),
            num_slots=num_slots,
            slot_bytes=slot_bytes,
            total_bytes=self.settings.total_bytes,
            pinned=self._transport.pinned,
            path=self._transport.path,
            **self.platform.log_fields(),
        )

    # -- public API --------------------------------------------------------------------
    @property
    def device(self) -> torch.device:
        return self.settings.device

    @property
    def slot_bytes(self) -> int:
        """Bytes per slot (``PoolSettings.slot_bytes``)."""
        return self._slot_bytes

    @property
    def alignment(self) -> int:
        """The alignment of each claim in a slot (``PoolSettings.alignment``)."""
        return self._alignment

    @property
    def transport(self) -> Transport:
        """How this pool moves bytes and fences (for blocks built on it, e.g. ``StaticInputs``)."""
        return self._transport

    @property
    def closed(self) -> bool:
        return self._closed

    @property
    def claims(self) -> int:
        """Slots claimed so far: every stage (owned or not) and every ``pool.readback``.

        The lifetime unit of rule 2: a ring view stays valid for ``num_slots - 1`` further
        claims of the ring (``VIEW_LIFETIME``), whoever makes them, a library call's hidden
        stages included.
        """
        return self._generation

    def stage(
        self,
        *,
        stream: Stream | None = None,
        owned_bytes: int | None = None,
        owned: torch.Tensor | None = None,
        zero_copy: bool = False,
        reuse_owned: bool = False,
    ) -> Stage:
        """Open a stage in the next slot; use as ``with pool.stage() as st:``.

        ``stream``: where the stage's copy, fence and read-backs go. Fixed now: the one
        passed, or the pool device's current stream at this call, wherever the stage is
        closed (rule 2). ``owned_bytes`` / ``owned``: copy into consumer-owned device
        memory instead of the ring mirror (rule 4), for data that outlives the ring.
        ``reuse_owned``: the caller passes this same ``owned`` buffer stage after stage (a
        ``StaticInputs`` block): its copy slices are cached, which keeps the buffer alive
        in the pool until the cache is cleared. Off by default, so a buffer passed once is
        freed with its last reference.
        ``zero_copy``: no copy; the views alias the pinned slot and must be read by kernels
        launched before the stage closes (``pinpool.zero_copy``; needs
        ``PoolSettings(zero_copy=True)`` and a platform that passed its check).
        """
        if self._open is not None or self._closed or self._debug:
            self._check_usable()  # raises, or (debug) checks the calling thread
        passed = stream
        stream, capturing = self._resolve_for_stage(stream)
        if capturing:
            raise PoolStateError(CAPTURE_REFUSAL)
        if zero_copy:
            return self._zero_copy_stage(stream, owned_bytes, owned)
        reused = reuse_owned and owned is not None
        if owned is None and owned_bytes is None:
            owned_device = None
        elif (
            owned is not None
            and owned is self._reused_owned()
            and reuse_owned
            and owned_bytes is None
            and owned.dtype is torch.uint8
            and owned.get_device() == self._device_index
            and owned.dim() == 1
            and owned.is_contiguous()
        ):
            # The buffer passed stage after stage (reuse_owned), checked in full when first
            # seen. The same object can still change in place (``resize_``, ``.data =``), so
            # what the full check asks of it is asked again, by cheaper calls: dtype, device
            # index (the device type cannot change to or from CPU that way), shape.
            owned_device = owned
        else:
            # None when the stage's stream is the current one (resolved from None just now): the
            # allocation then takes the current stream's pool without the transport asking again.
            owned_device = self._owned_buffer(owned_bytes, owned, None if passed is None else stream)
            if owned is not None and reuse_owned:
                self._reused_owned = weakref.ref(owned)  # kept alive by the slice cache only
        slot = self._claim(stream, writes_mirror=owned_device is None)
        st = Stage(self, self._layouts[slot], slot, self._generation, stream, owned_device)
        if reused:
            st.owned_reused = True
        self._open = st
        return st

    def exchange(
        self,
        fields: Sequence[Field],
        *,
        land: int | None = None,
        land_dtype: torch.dtype = torch.int64,
        stream: Stream | None = None,
    ) -> Exchange:
        """A decode step's exchange in one call: ``stage()``, a ``put`` per field, ``land``, ``flush``.

        ``fields``: ``(values, dtype)`` pairs, put in order (``ex.views`` holds their device
        views). ``land``: have a kernel store that many ``land_dtype`` values straight into
        the slot (``Stage.land``; ``ex.land_to`` are their addresses, ``ex.landing`` reads
        them after the close). The copy is issued before it returns: launch the step's
        kernels, then ``close()`` (or leave the ``with``). Same rules as ``stage()``; on any
        error the stage is aborted and the error raised: nothing is copied, except a field
        that ``overflow='spill'`` already spilled, whose copy the abort fences.
        """
        if self._open is not None or self._closed or self._debug:
            self._check_usable()  # raises, or (debug) checks the calling thread
        stream, capturing = self._resolve_for_stage(stream)
        if capturing:
            raise PoolStateError(CAPTURE_REFUSAL)
        slot = self._claim(stream, writes_mirror=True)
        ex = Exchange(self, self._layouts[slot], slot, self._generation, stream, None)
        self._open = ex
        try:
            ex.fill(fields, land, land_dtype)
        except BaseException:
            ex.close(ok=False)  # the slot goes to the next claim as it was (a spilled copy is fenced)
            raise
        return ex

    def readback(self, src: torch.Tensor, *, stream: Stream | None = None) -> Readback:
        """Copy the device tensor ``src`` into the next slot's pinned region; read it later.

        Same rules as a stage: the stream is fixed now, the slot's fence is waited on
        before its host region is written (rule 1) and recorded after the copy. The values
        stay readable for ``num_slots - 1`` further claims of the ring (``VIEW_LIFETIME``).
        """
        self._check_usable()
        stream, capturing = self._resolve_for_stage(stream)
        if capturing:
            raise PoolStateError(CAPTURE_REFUSAL)
        # Checked before claiming (the claim takes ``_next_slot``): a refused call leaves the
        # ring as it was. The views are only addresses: taking them before the slot's fence
        # wait reads nothing.
        views = self.readback_views(self._next_slot, src, 0)
        slot = self._claim(stream, writes_mirror=False)
        handle = self.copy_back(slot, self._generation, src, 0, stream, views)
        self._next_slot = (slot + 1) % self._num_slots
        return handle

    def register_consumer_stream(self, stream: Stream) -> None:
        """Protect staged slices read on ``stream`` as well as on the stage's own (rule 2).

        Before a slot's device region is overwritten, the stage's stream waits on the
        device for all work queued on ``stream`` so far: never a host wait.
        """
        self._check_usable()
        stream = self._transport.resolve_stream(stream)
        if any(self._transport.same_stream(s, stream) for s, _ in self._consumers):
            return
        fences = [self._transport.new_fence() for _ in range(self.settings.num_slots)]
        self._consumers.append((stream, fences))
        _log.info("consumer.registered", device=str(self.device), consumers=len(self._consumers))

    @property
    def stall_seconds(self) -> float:
        """Host seconds spent waiting on slot fences so far (``stats().stall_seconds``, without building a snapshot)."""
        return self._counters.stall_seconds

    @property
    def readback_wait_seconds(self) -> float:
        """Host seconds reads of read-backs and landings spent waiting for their copy or writer so far
        (``stats().readback_wait_seconds``, without building a snapshot)."""
        return self._counters.readback_wait_seconds

    def stats(self) -> PoolStats:
        return PoolStats.of(self._counters, self.platform)

    def close(self) -> None:
        """Wait for every in-flight copy, then drop the memory. A second call is a no-op.

        Inside an open stage it raises and frees nothing: that stage's copy may be queued.
        """
        if self._closed:
            return
        if self._open is not None:
            raise PoolStateError("close() called inside an open stage: finish the stage first")
        self._drain()
        self._closed = True
        self._retained = [[] for _ in self._retained]
        _log.info("pool.closed", device=str(self.device), **attrs.asdict(self._counters))

    def __del__(self) -> None:
        # A pool dropped without close() may still have copies, and retained tensors, in
        # flight: wait for them so nothing they read or write is freed early. A stage left
        # open (its ``with`` never exited) may have flushed a copy: fence it first.
        if getattr(self, "_closed", True):
            return
        try:
            st = self._open
            if isinstance(st, ZeroCopyStage):
                self._fence_readers(st)  # kernels may be reading its slot in place
            elif st is not None and st.copy_issued:
                self._fences[st.slot].record(st.stream)
            self._drain()
        except Exception:  # interpreter shutdown: the CUDA context may already be gone
            return

    def __enter__(self) -> PinnedRingBuffer:
        return self

    def __exit__(self, *exc: object) -> None:
        self.close()

    # -- the slot interface (used by Stage and Readback) ----------------------------
    def slot_generation(self, slot: int) -> int:
        """The generation of the claim that holds ``slot`` now (a lease is live while it matches)."""
        return self._slot_generation[slot]

    def drain_at_teardown(self, stream: Stream) -> None:
        """Have ``close()`` and a dropped pool also wait for ``stream``'s queued work.

        For streams that touch the slots outside the consumer guard: a ``StaticInputs``
        block's registered readers, whose replays may still store into a slot (landings)
        when the pool goes away.
        """
        stream = self._transport.resolve_stream(stream)
        if not any(self._transport.same_stream(stream, s) for s in self._teardown_streams):
            self._teardown_streams.append(stream)

    def slot_fence(self, slot: int) -> Fence:
        """The fence of ``slot``: recorded when its current claim closes (a ``Landing`` waits on it)."""
        return self._fences[slot]

    @property
    def can_land(self) -> bool:
        """Whether kernels may write the pinned slots in place: ``PoolSettings(zero_copy=True)``, check passed."""
        return self._zero_copy_layouts is not None

    def retain(self, slot: int, objs: tuple[Any, ...]) -> None:
        """Keep ``objs`` alive until ``slot``'s next fence has passed (rule 5)."""
        self._retained[slot].extend(objs)

    def issue_copy(self, st: Stage) -> None:
        """The stage's one copy of its used bytes (rule 3), on its own stream."""
        nbytes = st.used_bytes
        if nbytes == 0:
            return
        layout = self._layouts[st.slot]
        owned = st.owned_device
        if owned is not None and not st.owned_reused:
            dst, src = owned[:nbytes], layout.host_raw[:nbytes]
        elif owned is not None:
            # A caller's buffer restaged every step (StaticInputs) repeats (slot, buffer,
            # size): its two slices are cached like the ring's own, keyed by the buffer's
            # identity and kept with it, so a recycled id can never match. (A buffer the
            # pool allocated per stage, owned_bytes=, is new each time: never cached.)
            # The buffer's address is kept too: ``.data =`` or ``set_`` give the same object
            # other memory, which a cached slice (still on the old storage) would not see.
            key = (id(owned), nbytes)
            hit = self._owned_ranges[st.slot].get(key)
            if hit is None or hit[0] is not owned or hit[3] != owned.data_ptr():
                hit = self._owned_ranges[st.slot].put(
                    key, (owned, owned[:nbytes], layout.host_raw[:nbytes], owned.data_ptr())
                )
            _, dst, src, _ = hit
        else:
            ranges = self._copy_ranges[st.slot]
            pair = ranges.get(nbytes)
            if pair is None:
                pair = ranges.put(nbytes, (layout.device_raw[:nbytes], layout.host_raw[:nbytes]))
            dst, src = pair
        self._transport.copy(dst, src, st.stream)
        st.copy_issued = True
        counters = self._counters
        counters.copies += 1
        counters.bytes_copied += nbytes

    def finish_stage(self, st: Stage, ok: bool) -> None:
        """Close ``st``: its copy if not issued yet, then the slot's fence on the stage's stream."""
        if self._open is not st:
            return
        self._open = None
        counters = self._counters
        slot = st.slot
        landings = st.landings
        if not ok and not (st.copy_issued or landings or self._retained[slot]):
            # Nothing was copied, no kernel was handed the slot's landing bytes and nothing
            # is retained for one, so the slot's last fence (already passed) still guards
            # it: hand the same slot to the next stage. Its generation moves on, so views
            # from this stage read as stale.
            counters.aborted_stages += 1
            _log.debug("stage.aborted", slot=slot, generation=st.generation)
            return
        if ok and not st.flushed:
            self.issue_copy(st)
        counters.stages += 1
        if not (landings or st.copy_issued or st.used_bytes or self._retained[slot]):
            # Nothing in flight: the slot is free for the next claim as it is. (Landing
            # bytes may have been handed to a writer, and a retained object to a kernel,
            # with nothing copied: both need the fence below.)
            return
        if landings:
            # Kernels store into the slot (``Stage.land``), on the stage's stream or a
            # registered consumer: the fence follows them all, as a zero-copy stage's does,
            # even after a read-back's fence (the writers may have been launched after it).
            if self._consumers:
                self._fence_readers(st)
            else:  # the stage's stream alone, inline: every landing step closes here
                self._fences[slot].record(st.stream)
        elif not st.read_back:
            # Rule 1, on the stage's fixed stream: wherever the stage is closed, the fence
            # follows its copy. (After a stage read-back the fence is already recorded
            # after every copy of the stage.)
            self._fences[slot].record(st.stream)
        self._next_slot = (slot + 1) % self._num_slots
        if st.owned:
            counters.owned_stages += 1
        if not ok:
            counters.aborted_stages += 1
        if landings and self._debug and ok:
            # Last, with the ring moved on: a writer on an unregistered stream may still store
            # into this slot, so the next claim must not be handed it at once.
            covered = [consumer for consumer, _ in self._consumers]
            refuse_unregistered_reader(self._transport, st, [*covered, *st.guarded_by])

    def finish_zero_copy(self, st: Stage, ok: bool) -> None:
        """Close a zero-copy stage: no copy; the slot's fence after its readers (rule 1)."""
        if self._open is not st:
            return
        self._open = None
        counters = self._counters
        if not (st.used_bytes or st.copy_issued or st.landings or self._retained[st.slot]):
            # Nothing was put or retained, so no kernel can be reading the slot or need what
            # it keeps alive: hand it on as it is.
            if ok:
                counters.stages += 1
                counters.zero_copy_stages += 1
            else:
                counters.aborted_stages += 1
            return
        # Even an aborted stage is fenced: kernels launched before the error may read it.
        self._fence_readers(st)
        self._next_slot = (st.slot + 1) % self._num_slots
        counters.stages += 1
        counters.zero_copy_stages += 1
        if not ok:
            counters.aborted_stages += 1
        if self._debug and ok:
            refuse_unregistered_reader(self._transport, st, [consumer for consumer, _ in self._consumers])

    def readback_views(self, slot: int, src: torch.Tensor, offset: int) -> tuple[torch.Tensor, Any, int]:
        """(pinned torch view, numpy view, bytes) that a read-back of ``src`` at ``offset`` of ``slot`` copies into.

        Raises the typed errors of a ``src`` it cannot copy, before anything is queued, so a
        caller can check first and act after (``Stage.readback`` flushes in between).
        """
        # Fast path: a (dtype, shape, offset) cached for this slot passed the full checks
        # when it was cached; what can differ per call is the device and the layout.
        cache = self._readback_views[slot]
        if type(src) is torch.Tensor and self._device_index >= 0:
            views = cache.get((src.dtype, src.shape, offset))
            if views is not None and src.get_device() == self._device_index and src.is_contiguous():
                return views
        nbytes = self._check_readback_src(src, offset)  # raises on anything it cannot copy
        return cache.get((src.dtype, src.shape, offset)) or cache.put(
            (src.dtype, src.shape, offset), self._host_views_for(slot, src.dtype, src.shape, nbytes, offset)
        )

    def copy_back(
        self,
        slot: int,
        generation: int,
        src: torch.Tensor,
        offset: int,
        stream: Stream,
        views: tuple[torch.Tensor, Any, int] | None = None,
    ) -> Readback:
        """One device-to-pinned copy of ``src`` into ``slot`` at ``offset`` on ``stream``, then the slot's fence.

        ``views``: what ``readback_views`` returned for these arguments, when the caller checked first.
        """
        if views is None:
            views = self.readback_views(slot, src, offset)
        host_t, host_np, nbytes = views
        self._transport.copy(host_t, src, stream)
        fence = self._fences[slot]
        fence.record(stream)
        counters = self._counters
        counters.readbacks += 1
        counters.bytes_read_back += nbytes
        return Readback(self, slot, generation, fence, host_np)

    def wait_for_readback(self, fence: Fence) -> None:
        """The host wait of a read whose copy has not landed: counted and timed."""
        start = time.perf_counter()
        fence.synchronize()  # sync-ok: the caller asked for values whose copy is still queued
        counters = self._counters
        counters.readback_waits += 1
        counters.readback_wait_seconds += time.perf_counter() - start

    def spill(self, st: Stage, src: Any, dtype: torch.dtype, numel: int, name: str) -> torch.Tensor:
        """Stage ``src`` through its own pinned buffer (``overflow='spill'``); returns its device tensor.

        Correct but not free: one pinned and one device allocation and a second copy,
        each counted and logged as ``stage.overflow`` so a mis-sized pool shows.
        """
        nbytes = numel * dtype.itemsize
        transport = self._transport
        host = transport.alloc_host(nbytes)
        write(host.numpy().view(NUMPY_DTYPE[dtype]) if dtype in NUMPY_DTYPE else host.view(dtype), src, dtype, name)
        device = transport.alloc_device(nbytes, st.stream)  # from the pool of the stream that writes it
        transport.copy(device, host, st.stream)
        # The one-off pinned buffer must outlive its copy: the slot's fence, recorded when
        # the stage closes, covers this copy too.
        self._retained[st.slot].append(host)
        counters = self._counters
        counters.overflows += 1
        counters.host_allocations += 1
        counters.device_allocations += 1
        counters.copies += 1
        counters.bytes_copied += nbytes
        _log.warning(
            "stage.overflow",
            field=name,
            nbytes=nbytes,
            slot_bytes=self.settings.slot_bytes,
            overflows=counters.overflows,
        )
        return device.view(dtype)

    # -- internals ---------------------------------------------------------------------
    def _resolve_then_ask(self, stream: Stream | None) -> tuple[Stream, bool]:
        """``resolve_for_stage`` for a transport without it: the two questions apart."""
        resolved = self._transport.resolve_stream(stream)
        return resolved, self._capturing(resolved)

    def _claim(self, stream: Stream, *, writes_mirror: bool, in_place: bool = False) -> int:
        """The next slot, safe to write on the host, guarded on the device for ``stream``, under a new generation.

        ``in_place``: a zero-copy stage, which never touches the device mirror: rules 1 and 5
        only, and the slot's last mirror user stays on record for the next copy's hand-off.
        """
        slot = self._next_slot
        fence = self._fences[slot]
        # Rule 1: the host region may still feed a pending copy, receive a read-back or be
        # read in place. Wait for the slot's fence: bounded, and only when the GPU is
        # num_slots claims behind.
        if not fence.query():
            self._stall(slot, fence)
        if self._retained[slot]:
            # Rule 5: the fence has passed, so the kernels that read these are done.
            self._retained[slot].clear()
        if not in_place:
            last = self._last_stream[slot]
            if last is not stream and not self._transport.same_stream(last, stream):
                # Rule 2, change of stream: work queued on the slot's previous user's stream
                # (its copy, and kernels reading its slices there) must finish before this
                # stream touches the slot. An event recorded there now covers all of it; the
                # wait is on the device. Nothing is spent while the stream stays the same.
                self._hand_off(slot, last, stream)
            self._last_stream[slot] = stream
            if writes_mirror and (self._consumers or self._debug):
                self._guard_consumers(slot, stream)
        self._generation += 1
        self._slot_generation[slot] = self._generation
        return slot

    def _zero_copy_stage(self, stream: Stream, owned_bytes: int | None, owned: torch.Tensor | None) -> Stage:
        layouts = self._zero_copy_layouts
        if layouts is None:
            raise self.platform.refusal(self.device)  # PlatformError, or zero_copy not enabled
        if owned_bytes is not None or owned is not None:
            raise PoolStateError(
                "pass either 'zero_copy=True' or 'owned'/'owned_bytes', not both: a zero-copy stage is read in "
                "place from the ring"
            )
        # Rule 1: the host rewrites the slot in place, so everything that may still read or
        # write it (a copy, a read-back, a previous zero-copy stage's readers) must be done.
        # Rule 2 does not apply: the device mirror is not written, so neither the hand-off
        # nor the consumer guards run.
        slot = self._claim(stream, writes_mirror=False, in_place=True)
        st = ZeroCopyStage(self, layouts[slot], slot, self._generation, stream, None)
        self._open = st
        return st

    def _fence_readers(self, st: Stage) -> None:
        """The fence of a zero-copy slot: after the readers on the stage's stream and on every consumer."""
        if self._consumers:
            # A registered consumer's kernels read the slot in place: the stage's stream waits
            # for the work queued there so far (on the device), so the slot fence after it
            # covers them. The same device-side wait a copy stage makes at claim.
            self._wait_for_consumers(st.slot, st.stream)
        self._fences[st.slot].record(st.stream)

    def _hand_off(self, slot: int, last: Stream, stream: Stream) -> None:
        """``stream`` waits, on the device, for the work queued so far on ``slot``'s previous user's stream."""
        wait_for_streams(self._transport, stream, ((last, self._handoff[slot]),))

    def _wait_for_consumers(self, slot: int, stream: Stream) -> None:
        """``stream`` waits, on the device, for the work queued so far on every registered consumer stream."""
        wait_for_streams(self._transport, stream, [(consumer, fences[slot]) for consumer, fences in self._consumers])

    def _guard_consumers(self, slot: int, stream: Stream) -> None:
        # Rule 2, registered consumer streams: their queued work must finish before the
        # region is overwritten.
        self._wait_for_consumers(slot, stream)
        if self.settings.debug:
            # Poison the recycled region so a stale raw view reads NaN / -1, not old data.
            self._transport.fill(self._layouts[slot].device_raw, _POISON_BYTE, stream)

    def _drain(self) -> None:
        """Wait for everything that may still read or write the pool's memory: teardown only.

        The slot fences cover the copies; kernels reading staged slices may sit later on
        the stages' streams (rule 2 allows it) or on consumer streams, so a fresh fence is
        recorded at the end of each of those streams too.
        """
        transport = self._transport
        streams: list[Stream] = []
        for stream in [*self._last_stream, *(c for c, _ in self._consumers), *self._teardown_streams]:
            if not any(transport.same_stream(stream, seen) for seen in streams):
                streams.append(stream)
        fences = list(self._fences)
        for stream in streams:
            fence = transport.new_fence()
            fence.record(stream)
            fences.append(fence)
        for fence in fences:
            if not fence.query():
                fence.synchronize()  # sync-ok: teardown, once per pool; nothing is freed under queued work

    def _check_readback_src(self, src: torch.Tensor, offset: int) -> int:
        """Bytes of ``src`` once it is known to be a readable device tensor that fits at ``offset``."""
        if not isinstance(src, torch.Tensor):
            raise PoolStateError(f"'src' must be a torch.Tensor (got {type(src).__name__})")
        # get_device() is an int and cheap; it cannot tell CPU from meta, so only a CUDA
        # pool trusts it alone.
        index = src.get_device()
        if index != self._device_index or (index < 0 and src.device != self.device):
            raise DeviceMismatchError(f"'src' must be on the pool's device {self.device} (got {src.device})")
        if src.dtype not in NUMPY_DTYPE or not src.is_contiguous():
            raise PoolStateError(f"'src' must be contiguous with a numpy dtype (got {src.dtype})")
        nbytes: int = src.nbytes
        if offset + nbytes > self.settings.slot_bytes:
            raise CapacityError(
                f"'src' needs {nbytes} bytes but the slot has {self.settings.slot_bytes - offset} of "
                f"{self.settings.slot_bytes} left; raise PoolSettings.slot_bytes"
            )
        return nbytes

    def _host_views_for(
        self, slot: int, dtype: torch.dtype, shape: torch.Size, nbytes: int, offset: int
    ) -> tuple[torch.Tensor, np.ndarray[Any, Any], int]:
        """(pinned torch view, numpy view, bytes) of the slot at ``offset``, shaped like a read-back's source."""
        layout = self._layouts[slot]
        itemsize = dtype.itemsize
        first = offset // itemsize
        host_np = layout.host[dtype][first : first + nbytes // itemsize].reshape(shape)
        host_t = layout.host_raw[offset : offset + nbytes].view(dtype).view(shape)
        return host_t, host_np, nbytes

    def _check_usable(self) -> None:
        if self._closed:
            raise PoolStateError("the pool is closed: create a new PinnedRingBuffer")
        if self._open is not None:
            raise PoolStateError(
                f"stage() called inside open stage {self._open.generation}: finish it before opening another"
            )
        if self.settings.debug and threading.get_ident() != self._owner_thread:
            raise ThreadOwnershipError(
                "a PinnedRingBuffer must be used only from the thread that created it "
                f"(owner {self._owner_thread}, caller {threading.get_ident()}); create one pool per worker"
            )

    def _owned_buffer(
        self, owned_bytes: int | None, owned: torch.Tensor | None, stream: Stream | None
    ) -> torch.Tensor | None:
        if owned is not None:
            if owned_bytes is not None:
                raise PoolStateError("pass either 'owned' or 'owned_bytes', not both")
            if owned.device != self.device:
                raise DeviceMismatchError(f"'owned' must be on the pool's device {self.device} (got {owned.device})")
            if owned.dtype != torch.uint8 or owned.dim() != 1 or not owned.is_contiguous():
                raise PoolStateError(
                    f"'owned' must be a contiguous 1-D uint8 tensor (got {owned.dtype} of shape {tuple(owned.shape)})"
                )
            return owned
        if owned_bytes is None:
            return None
        if not int_in_range(owned_bytes, 1):
            raise PoolStateError(f"'owned_bytes' must be an int >= 1 (got {owned_bytes!r})")
        self._counters.device_allocations += 1
        # Allocated for the stage's stream, which writes it: a block taken from the current
        # stream's pool could still be read there by work queued before it was freed.
        return self._transport.alloc_device(align_up(owned_bytes, self._alignment), stream)

    def _stall(self, slot: int, fence: Fence) -> None:
        start = time.perf_counter()
        fence.synchronize()  # sync-ok: rule 1, bounded; only when the GPU is num_slots claims behind
        waited = time.perf_counter() - start
        counters = self._counters
        counters.stalls += 1
        counters.stall_seconds += waited
        counters.max_stall_seconds = max(counters.max_stall_seconds, waited)
        if self.settings.log_stalls:
            _log.warning("slot.stall", slot=slot, seconds=waited, stalls=counters.stalls)
