"""``PinnedRingBuffer``: persistent pinned host slots, their device mirror and the rules of their reuse.

1. the host rewrites a slot only after its fence has passed (``_claim``);
2. a slot's device copy is rewritten only after its readers on any stream are waited for on the device (``_claim``);
3. one copy per stage (``_issue_copy``), the slot's fence after what may still read or write it (``_finish``);
4. ``retain`` keeps objects alive until the slot's next fence; read-backs take a slot like a stage;
5. a CPU pool runs the same rules on plain memory; every CUDA call runs under the pool's device (the transport).
"""

from __future__ import annotations

import threading
import time
from typing import Any

import attrs
import torch

from pinpool.cuda import transport_for
from pinpool.encode import int_in_range
from pinpool.exceptions import (
    CAPTURE_REFUSAL,
    DeviceMismatchError,
    PoolStateError,
    SettingsTypeError,
    ThreadOwnershipError,
    UnguardedReaderError,
)
from pinpool.layout import Layout, align_up
from pinpool.log import get_logger
from pinpool.readback import Readback
from pinpool.settings import PoolSettings
from pinpool.slot import allocate_slots
from pinpool.stage import IN_PLACE, OWNED, RING, BlockSide, Placement, Stage
from pinpool.stats import Counters, PoolStats
from pinpool.transport import Fence, Stream, Transport, drain, wait_for_streams

_log = get_logger("pinpool")
_POISON_BYTE = 0xFF  # NaN in every float dtype, -1 in every signed int dtype


class PinnedRingBuffer:
    """A ring of ``num_slots`` reusable staging slots for one device: one pool per worker process and device,
    not thread-safe (``debug=True`` checks the thread). Methods with a leading underscore are the package's
    slot interface (stages, blocks, read-back handles)."""

    def __init__(self, settings: PoolSettings | None = None, *, transport: Transport | None = None) -> None:
        """Allocate all the memory the pool will use (``transport``: tests pass ``pinpool.testing.LaggingGpu``)."""
        if settings is not None and not isinstance(settings, PoolSettings):
            raise SettingsTypeError(
                f"'settings' must be a PoolSettings or None (got {settings!r}); e.g. PoolSettings(device='cpu')"
            )
        self.settings = settings = settings if settings is not None else PoolSettings()
        self._transport = transport if transport is not None else transport_for(settings.device)
        if self._transport.device != settings.device:
            raise DeviceMismatchError(
                f"'transport' must serve the settings' device {settings.device} (got {self._transport.device})"
            )
        self._resolve_for_stage = self._transport.resolve_for_stage
        self._num_slots = settings.num_slots
        self._debug = settings.debug
        self.host_slab, self.device_mirror, self._slots, self.platform = allocate_slots(self._transport, settings)
        self._consumers: list[tuple[Stream, list[Fence]]] = []  # each with one fence per slot
        self._teardown_streams: list[Stream] = []  # besides the slots' last users and the consumers
        #: Whether kernels may read and write the pinned slots in place (zero-copy stages, landings).
        self.can_land = self._slots[0].alias is not None
        self._next_slot = self._generation = 0
        self._open: Stage | None = None
        self._closed = False
        self._owner_thread = threading.get_ident()
        self._counters = Counters(host_allocations=1, device_allocations=1)
        _log.info(
            "pool.created",
            device=str(settings.device),
            num_slots=self._num_slots,
            slot_bytes=settings.slot_bytes,
            total_bytes=settings.total_bytes,
            pinned=self._transport.pinned,
            path=self._transport.path,
            **self.platform.log_fields(),
        )

    @property
    def device(self) -> torch.device:
        return self.settings.device

    @property
    def transport(self) -> Transport:
        """How this pool moves bytes and fences (for blocks built on it, e.g. ``DeviceBlock``)."""
        return self._transport

    @property
    def closed(self) -> bool:
        return self._closed

    @property
    def claims(self) -> int:
        """Slots claimed so far (stages and read-backs): the unit of ``VIEW_LIFETIME``."""
        return self._generation

    def stage(
        self,
        layout: Layout | None = None,
        *,
        rows: int | None = None,
        live: int | None = None,
        stream: Stream | None = None,
        owned: int | torch.Tensor | None = None,
        zero_copy: bool = False,
    ) -> Stage:
        """Open a stage in the next slot; use as ``with pool.stage() as st:``.

        ``layout`` for ``rows`` rows, ``live`` of them real (each defaults to the other). ``stream``:
        fixed now (default: the pool device's current one). Placement: the ring's mirror; ``owned``
        (a byte count, or a contiguous 1-D uint8 device tensor) for data that outlives the ring;
        ``zero_copy=True``: kernels read the pinned slot in place (launch every reader before close).
        """
        if zero_copy is not False and zero_copy is not True:
            raise PoolStateError(f"'zero_copy' must be a bool (got {zero_copy!r})")
        if zero_copy:
            if owned is not None:
                raise PoolStateError(
                    "pass either 'zero_copy=True' or 'owned', not both: a zero-copy stage is read in place"
                )
            return self._open_stage(stream, IN_PLACE, None, layout, rows, live)
        if owned is None:
            return self._open_stage(stream, RING, None, layout, rows, live)
        return self._open_stage(stream, OWNED, owned, layout, rows, live)

    def readback(self, src: torch.Tensor, *, stream: Stream | None = None) -> Readback:
        """Copy device tensor ``src`` into the next slot's pinned bytes on a stream fixed now; read the
        handle within ``VIEW_LIFETIME``."""
        self._check_usable()
        stream, capturing = self._resolve_for_stage(stream)
        if capturing:
            raise PoolStateError(CAPTURE_REFUSAL)
        mem = self._slots[self._next_slot]
        views = mem.readback_views(src, 0, self.device)  # refused before anything is claimed
        slot = self._claim(stream, RING, writes_mirror=False)
        handle = self._copy_back(slot, stream, src, views)
        self._next_slot = (slot + 1) % self._num_slots
        return handle

    def register_consumer_stream(self, stream: Stream) -> None:
        """Protect staged views read on ``stream`` as well as on the stage's own (rule 2, a device wait)."""
        self._check_usable()
        stream = self._transport.resolve_stream(stream)
        if any(self._transport.same_stream(s, stream) for s, _ in self._consumers):
            return
        self._consumers.append((stream, [self._transport.new_fence() for _ in self._slots]))
        _log.info("consumer.registered", device=str(self.device), consumers=len(self._consumers))

    @property
    def stall_seconds(self) -> float:
        """Host seconds spent waiting on slot fences so far (without building a ``stats()`` snapshot)."""
        return self._counters.stall_seconds

    @property
    def readback_wait_seconds(self) -> float:
        """Host seconds reads of read-backs and landings spent waiting so far."""
        return self._counters.readback_wait_seconds

    def stats(self) -> PoolStats:
        return PoolStats.of(self._counters, self.platform)

    def close(self) -> None:
        """Wait for every in-flight copy, then drop the memory; refused inside an open stage (its copy may queue)."""
        if self._closed:
            return
        if self._open is not None:
            raise PoolStateError("close() called inside an open stage: finish the stage first")
        self._drain()
        self._closed = True
        for mem in self._slots:
            mem.retained.clear()
            mem.views.clear()  # the views kept per slot hold their memory (a block's, say) alive
        _log.info("pool.closed", device=str(self.device), **attrs.asdict(self._counters))

    def __del__(self) -> None:
        # A pool dropped without close() may still have copies and retained tensors in
        # flight: wait for them. A stage left open may have flushed or be read in place.
        if getattr(self, "_closed", True):
            return
        try:
            st = self._open
            if st is not None and (st.copy_issued or st.placement is IN_PLACE or st.landing_bytes):
                self._slots[st.slot].fence.record(st.stream)
            self._drain()
        except Exception:  # interpreter shutdown: the CUDA context may already be gone
            return

    def __enter__(self) -> PinnedRingBuffer:
        return self

    def __exit__(self, *exc: object) -> None:
        self.close()

    # -- the package's slot interface (stages, blocks, read-back handles) ---------------------
    def wait_for_readback(self, fence: Fence) -> None:
        """The host wait of a read whose copy or writer has not finished: counted and timed."""
        self._counters.readback_wait_seconds += self._host_wait(fence)
        self._counters.readback_waits += 1

    def _open_stage(
        self,
        stream: Stream | None,
        placement: Placement,
        owned: int | torch.Tensor | None,
        layout: Layout | None,
        rows: int | None,
        live: int | None,
        block: BlockSide | None = None,
        block_memory: torch.Tensor | None = None,
    ) -> Stage:
        """Every placement opens here: checks, then the claim, then the layout; a refused open claims nothing."""
        if self._open is not None or self._closed or self._debug:
            self._check_usable()
        passed = stream
        stream, capturing = self._resolve_for_stage(stream)
        if capturing:
            raise PoolStateError(CAPTURE_REFUSAL)
        if layout is not None:
            if not isinstance(layout, Layout):
                raise PoolStateError(f"'layout' must be a pinpool.Layout or None (got {type(layout).__name__})")
            rows, live = (live if rows is None else rows), (rows if live is None else live)
            if rows is None:
                raise PoolStateError("a stage with a layout needs 'rows' (or 'live')")
            if type(rows) is not int or type(live) is not int or not 0 <= live <= rows <= layout.max_rows:
                layout.check_rows(rows, live)  # raises typed, before the claim
        elif rows is not None or live is not None:
            raise PoolStateError("'rows' and 'live' need a 'layout'")
        if (placement is IN_PLACE or (layout is not None and layout.landings)) and not self.can_land:
            raise self.platform.refusal(self.device)  # PoolStateError / PlatformError, saying why
        dst = self._owned_buffer(owned, None if passed is None else stream) if placement is OWNED else block_memory
        slot = self._claim(stream, placement, writes_mirror=placement is RING)
        mem = self._slots[slot]
        if dst is None:
            dst = mem.alias if placement is IN_PLACE else mem.device_raw
        st = self._open = Stage(self, mem, stream, placement, dst)  # type: ignore[arg-type]
        if layout is not None:
            try:
                st.open_layout(layout, rows, live, block)  # type: ignore[arg-type]
            except BaseException:
                st.close(ok=False)
                raise
        return st

    def _issue_copy(self, st: Stage) -> None:
        """The stage's one copy of its used bytes (rule 3), on its own stream."""
        nbytes = st.used_bytes
        if nbytes == 0:
            return
        mem, key = st._mem, ("copy", st._dst_id, nbytes)  # the entry holds ``dst``, so its id stays its own
        pair = None if st.owned else mem.views.get(key)  # an owned buffer may differ next time
        if pair is None:
            pair = (st.dst, st.dst[:nbytes], mem.host_raw[:nbytes])
            if not st.owned:
                mem.views.put(key, pair)
        self._transport.copy(pair[1], pair[2], st.stream)
        st.copy_issued = True
        counters = self._counters
        counters.copies += 1
        counters.bytes_copied += nbytes

    def _finish(self, st: Stage, ok: bool) -> None:
        """Close ``st``: the slot's fence after what may still read or write the slot, or the slot as it was."""
        if self._open is not st:
            return
        self._open = None
        slot, in_place, counters = st.slot, st.placement is IN_PLACE, self._counters
        if not ok:
            _log.debug("stage.aborted", slot=slot, generation=st.generation)
        # Unfenced, nothing queued reads or writes the slot: the next claim takes it as it is (a new generation).
        fenced = st.copy_issued or st.landing_bytes or self._slots[slot].retained or (in_place and st.used_bytes)
        if fenced:
            if (in_place or st.landing_bytes) and self._consumers:
                # Kernels on registered consumers read the slot in place or store into it.
                self._wait_for_consumers(slot, st.stream)
            self._slots[slot].fence.record(st.stream)
            self._next_slot = (slot + 1) % self._num_slots
            counters.owned_stages += st.placement is OWNED
        counted = ok or bool(fenced)
        counters.stages += counted
        counters.aborted_stages += not ok
        counters.zero_copy_stages += counted and in_place
        if self._debug and ok and fenced and (in_place or st.landing_bytes):
            self._refuse_unregistered_reader(st)

    def _drain_at_teardown(self, stream: Stream) -> None:
        """Have ``close()`` also wait for ``stream`` (a block's readers, whose replays may store into a slot)."""
        if not any(self._transport.same_stream(stream, s) for s in self._teardown_streams):
            self._teardown_streams.append(stream)

    def _copy_back(
        self, slot: int, stream: Stream, src: torch.Tensor, views: tuple[torch.Tensor, Any, int]
    ) -> Readback:
        """A read-back (the pool's or a stage's): one device-to-pinned copy on ``stream``, then the slot's fence."""
        host_t, host_np, nbytes = views
        self._transport.copy(host_t, src, stream)
        self._slots[slot].fence.record(stream)
        self._counters.readbacks += 1
        self._counters.bytes_read_back += nbytes
        return Readback(self, self._slots[slot], host_np)

    # -- internals ---------------------------------------------------------------------
    def _claim(self, stream: Stream, placement: Placement, *, writes_mirror: bool) -> int:
        """The next slot, safe to write on the host and guarded on the device for ``stream``, under a new generation."""
        slot = self._next_slot
        mem = self._slots[slot]
        # Rule 1: the host bytes may still feed a copy, receive a read-back or be read in
        # place. Bounded: only when the GPU is num_slots claims behind.
        if not mem.fence.query():
            self._stall(slot, mem.fence)
        if mem.retained:
            mem.retained.clear()  # rule 5: the fence has passed, so their readers are done
        if placement is not IN_PLACE:  # an in-place stage never touches the device copy
            last = mem.last_user
            if last is not stream and not self._transport.same_stream(last, stream):
                # Rule 2, change of stream: the previous user's queued work on the slot comes first.
                wait_for_streams(self._transport, stream, ((last, mem.handoff),))
            mem.last_user = stream
            if writes_mirror and (self._consumers or self._debug):
                self._wait_for_consumers(slot, stream)
                if self._debug:  # a stale raw view of the recycled bytes reads NaN / -1, not old data
                    self._transport.fill(mem.device_raw, _POISON_BYTE, stream)
        self._generation += 1
        mem.generation = self._generation
        return slot

    def _wait_for_consumers(self, slot: int, stream: Stream) -> None:
        wait_for_streams(self._transport, stream, [(consumer, fences[slot]) for consumer, fences in self._consumers])

    def _owned_buffer(self, owned: int | torch.Tensor | None, stream: Stream | None) -> torch.Tensor:
        if isinstance(owned, torch.Tensor):
            if owned.device != self.device:
                raise DeviceMismatchError(f"'owned' must be on the pool's device {self.device} (got {owned.device})")
            if owned.dtype != torch.uint8 or owned.dim() != 1 or not owned.is_contiguous():
                raise PoolStateError(
                    f"'owned' must be a contiguous 1-D uint8 tensor (got {owned.dtype} of shape {tuple(owned.shape)})"
                )
            return owned
        if not int_in_range(owned, 1):
            raise PoolStateError(f"'owned' must be a byte count >= 1 or a uint8 device tensor (got {owned!r})")
        self._counters.device_allocations += 1
        # For the stage's stream, which writes it (None: the current one, without asking again).
        return self._transport.alloc_device(align_up(owned, self.settings.alignment), stream)  # type: ignore[arg-type]

    def _refuse_unregistered_reader(self, st: Stage) -> None:
        """(debug) A stage read in place or landed into, closed under a stream its fence does not cover."""
        transport = self._transport
        current = transport.resolve_stream(None)
        covered = [st.stream, *(c for c, _ in self._consumers), *self._teardown_streams]
        if any(transport.same_stream(current, s) for s in covered):
            return
        raise UnguardedReaderError(
            f"stage {st.generation} ({st.placement.value}, landings: {st.landing_bytes}) closed while stream "
            f"{current!r} is current, which is neither the stage's stream nor a registered consumer: kernels there "
            "are not covered by the slot's fence. Register it with pool.register_consumer_stream(stream)"
        )

    def _drain(self) -> None:
        """Teardown: wait for everything that may still read or write the pool's memory."""
        users = [*(m.last_user for m in self._slots), *(c for c, _ in self._consumers), *self._teardown_streams]
        drain(self._transport, users, [m.fence for m in self._slots])

    def _check_usable(self) -> None:
        if self._closed:
            raise PoolStateError("the pool is closed: create a new PinnedRingBuffer")
        if self._open is not None:
            raise PoolStateError(
                f"stage() called inside open stage {self._open.generation}: finish it before opening another"
            )
        if self._debug and threading.get_ident() != self._owner_thread:
            raise ThreadOwnershipError(
                "a PinnedRingBuffer must be used only from the thread that created it "
                f"(owner {self._owner_thread}, caller {threading.get_ident()}); create one pool per worker"
            )

    def _host_wait(self, fence: Fence) -> float:
        """The pool's host wait on a fence (rule 1's stall, or a read of a copy still queued): its seconds."""
        start = time.perf_counter()
        fence.synchronize()  # sync-ok: rule 1, bounded (the GPU is num_slots claims behind), or a read asked for
        return time.perf_counter() - start

    def _stall(self, slot: int, fence: Fence) -> None:
        waited = self._host_wait(fence)
        counters = self._counters
        counters.stalls += 1
        counters.stall_seconds += waited
        counters.max_stall_seconds = max(counters.max_stall_seconds, waited)
        if self.settings.log_stalls:
            _log.warning("slot.stall", slot=slot, seconds=waited, stalls=counters.stalls)
