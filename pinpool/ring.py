"""``PinnedRingBuffer``: persistent pinned host slots and their device mirror, as a user calls them."""

from __future__ import annotations

import attrs
import torch

from pinpool.exceptions import CAPTURE_REFUSAL, PoolStateError
from pinpool.layout import Layout
from pinpool.log import get_logger
from pinpool.readback import Readback
from pinpool.settings import PoolSettings
from pinpool.slot_ring import SlotRing
from pinpool.stage import IN_PLACE, OWNED, RING, Stage
from pinpool.stats import PoolStats
from pinpool.transport import Stream, Transport

_log = get_logger("pinpool")


class PinnedRingBuffer(SlotRing):
    """A ring of ``num_slots`` reusable staging slots for one device: one pool per worker process and device,
    not thread-safe (``debug=True`` checks the thread). The slots' state and rules live in ``SlotRing``."""

    def __init__(self, settings: PoolSettings | None = None, *, transport: Transport | None = None) -> None:
        """Allocate all the memory the pool will use (``transport``: tests pass ``pinpool.testing.LaggingGpu``)."""
        super().__init__(settings, transport)
        settings = self.settings
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
