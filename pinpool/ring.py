"""``PinnedRingBuffer``: persistent pinned host slots, their device mirror, one fence each.

Everything is allocated in ``__init__``; staging afterwards allocates nothing (design
invariant 4). A stage claims the next slot, takes values into its pinned region, and on
exit issues one copy of the used bytes and records the slot's fence.
"""

from __future__ import annotations

import threading
import time
from typing import Any

import attrs
import torch

from pinpool.encode import NUMPY_DTYPE
from pinpool.exceptions import CapacityError, DeviceMismatchError, PoolStateError, ThreadOwnershipError
from pinpool.log import get_logger
from pinpool.readback import Readback
from pinpool.settings import PoolSettings
from pinpool.stage import Stage
from pinpool.stats import Counters, PoolStats
from pinpool.transport import Fence, Stream, Transport, transport_for

_log = get_logger("pinpool")
_POISON_BYTE = 0xFF  # NaN in every float dtype, -1 in every signed int dtype


class PinnedRingBuffer:
    """A ring of ``num_slots`` reusable staging slots for one device.

    One pool per worker process and device; it is not thread-safe (``debug=True``
    enforces that it is only used from the thread that created it).
    """

    def __init__(self, settings: PoolSettings | None = None, *, transport: Transport | None = None) -> None:
        self.settings = settings if settings is not None else PoolSettings()
        self._transport = (
            transport
            if transport is not None
            else transport_for(self.settings.device, direct=self.settings.cudart_direct)
        )
        if self._transport.device != self.settings.device:
            raise DeviceMismatchError(
                f"'transport' must serve the settings' device {self.settings.device} (got {self._transport.device})"
            )
        slot_bytes, num_slots = self.settings.slot_bytes, self.settings.num_slots
        self.host_slab = self._transport.alloc_host(slot_bytes * num_slots)
        self.device_mirror = self._transport.alloc_device(slot_bytes * num_slots)
        self._host_slots = [self.host_slab[i * slot_bytes : (i + 1) * slot_bytes] for i in range(num_slots)]
        self._device_slots = [self.device_mirror[i * slot_bytes : (i + 1) * slot_bytes] for i in range(num_slots)]
        # Typed views per slot and dtype, built once, so a put is one slice per side.
        host_np = self.host_slab.numpy()
        self._host_bytes = host_np.data  # the whole slab as a writable memoryview, for struct packing
        self._host_views: list[dict[torch.dtype, Any]] = []
        self._device_views: list[dict[torch.dtype, torch.Tensor]] = []
        for i in range(num_slots):
            raw_np = host_np[i * slot_bytes : (i + 1) * slot_bytes]
            host: dict[torch.dtype, Any] = {d: raw_np.view(n) for d, n in NUMPY_DTYPE.items()}
            host[torch.bfloat16] = self._host_slots[i].view(torch.bfloat16)
            self._host_views.append(host)
            self._device_views.append({d: self._device_slots[i].view(d) for d in host})
        self._view_cache: list[dict[tuple[torch.dtype, int, int], torch.Tensor]] = [{} for _ in range(num_slots)]
        # Copy ranges per (slot, bytes): one host and one device view, reused every lap.
        self._copy_ranges: list[dict[int, tuple[torch.Tensor, torch.Tensor]]] = [{} for _ in range(num_slots)]
        self._readback_cache: list[dict[tuple[torch.dtype, torch.Size, int], tuple[torch.Tensor, Any, int]]] = [
            {} for _ in range(num_slots)
        ]
        self._fences: list[Fence] = [self._transport.new_fence() for _ in range(num_slots)]
        self._retained: list[list[Any]] = [[] for _ in range(num_slots)]
        self._slot_generation = [0] * num_slots
        self._consumers: list[tuple[Stream, list[Fence]]] = []
        self._next_slot = 0
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
        )

    # -- public API --------------------------------------------------------------------
    @property
    def device(self) -> torch.device:
        return self.settings.device

    @property
    def closed(self) -> bool:
        return self._closed

    def stage(
        self, *, stream: Stream | None = None, owned_bytes: int | None = None, owned: torch.Tensor | None = None
    ) -> Stage:
        """Open a stage in the next slot; use as ``with pool.stage() as st:``.

        ``stream``: where the copy goes (default: the current stream of the pool's device).
        ``owned_bytes`` / ``owned``: copy into consumer-owned device memory instead of the
        ring mirror (design invariant 5), for data that outlives ``num_slots`` stages.
        """
        if self._open is not None or self._closed or self.settings.debug:
            self._check_usable()  # raises, or (debug) checks the calling thread
        if stream is not None:
            self._transport.check_stream(stream)
        owned_device = None if owned_bytes is None and owned is None else self._owned_buffer(owned_bytes, owned)
        slot = self._claim_slot()
        if owned_device is None and (self._consumers or self.settings.debug):
            self._guard_device_region(slot, stream)
        st = Stage(self, slot, self._generation, stream, owned_device)
        self._open = st
        return st

    def readback(self, src: torch.Tensor, *, stream: Stream | None = None) -> Readback:
        """Copy the device tensor ``src`` into the next slot's pinned region; read it later.

        Same slot discipline as a stage: the slot's fence is waited on (invariant 1) before
        its host region is written, and recorded after the copy. The values stay readable
        until the slot is recycled ``num_slots`` stages or readbacks later.
        """
        self._check_usable()
        if stream is not None:
            self._transport.check_stream(stream)
        self._check_readback_src(src, 0)  # before claiming: a refused call leaves the ring as it was
        slot = self._claim_slot()
        handle = self._copy_back(slot, self._generation, src, 0, stream)
        self._next_slot = (slot + 1) % self.settings.num_slots
        return handle

    def register_consumer_stream(self, stream: Stream) -> None:
        """Protect staged slices read on ``stream`` (design invariant 2).

        Before a slot's device region is overwritten, the staging stream waits on the
        device for all work queued on ``stream`` so far: never a host wait.
        """
        self._check_usable()
        self._transport.check_stream(stream)
        if any(s is stream for s, _ in self._consumers):
            return
        fences = [self._transport.new_fence() for _ in range(self.settings.num_slots)]
        self._consumers.append((stream, fences))
        _log.info("consumer.registered", device=str(self.device), consumers=len(self._consumers))

    def stats(self) -> PoolStats:
        return PoolStats.of(self._counters)

    def close(self) -> None:
        """Wait for every in-flight copy, then drop the memory. A second call is a no-op."""
        if self._closed:
            return
        if self._open is not None:
            raise PoolStateError("close() called inside an open stage: finish the stage first")
        for fence in self._fences:
            fence.synchronize()  # sync-ok: teardown, once per pool; copies must finish before free
        self._closed = True
        self._retained = [[] for _ in self._retained]
        _log.info("pool.closed", device=str(self.device), **attrs.asdict(self._counters))

    def __del__(self) -> None:
        # A pool dropped without close() may still have copies and retained tensors in
        # flight; wait for them so nothing it guards is freed early.
        if getattr(self, "_closed", True) or getattr(self, "_open", None) is not None:
            return
        try:
            for fence in self._fences:
                fence.synchronize()  # sync-ok: finaliser of an unclosed pool, once
        except Exception:  # interpreter shutdown: the CUDA context may already be gone
            return

    def __enter__(self) -> PinnedRingBuffer:
        return self

    def __exit__(self, *exc: object) -> None:
        self.close()

    # -- used by Stage -----------------------------------------------------------------
    def _copy(self, st: Stage) -> None:
        nbytes = st.used_bytes
        if nbytes == 0:
            return
        if st._owned_device is not None:
            dst, src = st._owned_device[:nbytes], self._host_slots[st.slot][:nbytes]
        else:
            ranges = self._copy_ranges[st.slot]
            pair = ranges.get(nbytes)
            if pair is None:
                if len(ranges) >= 256:
                    ranges.clear()
                pair = ranges[nbytes] = (self._device_slots[st.slot][:nbytes], self._host_slots[st.slot][:nbytes])
            dst, src = pair
        # Invariant 3: one contiguous byte range of the slot, one copy.
        self._transport.copy(dst, src, st.stream)
        counters = self._counters
        counters.copies += 1
        counters.bytes_copied += nbytes

    def _finish(self, st: Stage, ok: bool) -> None:
        if not st._open:
            return
        st._open = False
        self._open = None
        counters = self._counters
        if not ok and not st.spilled and not st.flushed:
            # Nothing was copied, so the slot's last fence (already passed) still guards
            # it: hand the same slot to the next stage. Its generation moves on, so views
            # from this stage read as stale. (A flushed stage has a copy in flight: it
            # falls through and records its fence like a finished one, invariant 1.)
            counters.aborted_stages += 1
            _log.debug("stage.aborted", slot=st.slot, generation=st.generation)
            return
        if ok and not st.flushed:
            self._copy(st)
        if st.used_bytes == 0 and not st.spilled and not st.read_back:
            counters.stages += 1
            return
        if not st.read_back:
            # (After a stage read-back, its fence is already recorded after every copy of
            # the stage, and nothing may be added to it: recording again is only cost.)
            self._fences[st.slot].record(st.stream)
        self._next_slot = (st.slot + 1) % self.settings.num_slots
        counters.stages += 1
        if st.owned:
            counters.owned_stages += 1
        if not ok:
            counters.aborted_stages += 1

    def _copy_back(self, slot: int, generation: int, src: torch.Tensor, offset: int, stream: Stream | None) -> Readback:
        """One device-to-pinned copy of ``src`` into ``slot`` at ``offset``, then the slot's fence."""
        # Fast path: a (dtype, shape, offset) already cached for this slot passed the full
        # checks when it was cached; what can differ per call is the device and layout.
        views = None
        if type(src) is torch.Tensor and self._device_index >= 0:
            views = self._readback_cache[slot].get((src.dtype, src.shape, offset))
            if views is not None and (src.get_device() != self._device_index or not src.is_contiguous()):
                views = None
        if views is None:
            nbytes = self._check_readback_src(src, offset)  # raises on anything it cannot copy
            views = self._readback_views(slot, src.dtype, src.shape, nbytes, offset)
        host_t, host_np, nbytes = views
        self._transport.copy(host_t, src, stream)
        fence = self._fences[slot]
        fence.record(stream)
        counters = self._counters
        counters.readbacks += 1
        counters.bytes_read_back += nbytes
        return Readback(self, slot, generation, fence, host_np)

    # -- internals ---------------------------------------------------------------------
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

    def _readback_views(
        self, slot: int, dtype: torch.dtype, shape: torch.Size, nbytes: int, offset: int
    ) -> tuple[torch.Tensor, Any, int]:
        """(pinned torch view, numpy view, bytes) of the slot at ``offset``, shaped like the source.

        A decode loop reads back the same shape every step; building the two views costs
        more host time than the copy itself, so they are made once per slot and shape.
        """
        cache = self._readback_cache[slot]
        key = (dtype, shape, offset)
        views = cache.get(key)
        if views is None:
            if len(cache) >= 64:
                cache.clear()
            itemsize = self._host_views[slot][dtype].itemsize
            first = offset // itemsize
            host_np = self._host_views[slot][dtype][first : first + nbytes // itemsize].reshape(shape)
            host_t = self._host_slots[slot][offset : offset + nbytes].view(dtype).view(shape)
            views = cache[key] = (host_t, host_np, nbytes)
        return views

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

    def _owned_buffer(self, owned_bytes: int | None, owned: torch.Tensor | None) -> torch.Tensor | None:
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
        if isinstance(owned_bytes, bool) or not isinstance(owned_bytes, int) or owned_bytes < 1:
            raise PoolStateError(f"'owned_bytes' must be an int >= 1 (got {owned_bytes!r})")
        align = self.settings.alignment
        self._counters.device_allocations += 1
        return self._transport.alloc_device((owned_bytes + align - 1) // align * align)

    def _claim_slot(self) -> int:
        """The next slot, safe to write on the host, under a new generation."""
        slot = self._next_slot
        fence = self._fences[slot]
        # Invariant 1: the host region may still feed a pending copy. Wait for the slot's
        # fence: bounded, and only when the GPU is num_slots stages behind.
        if not fence.query():
            self._stall(slot, fence)
        if self._retained[slot]:
            # Invariant 6: the fence has passed, so the kernels that read these are done.
            self._retained[slot].clear()
        self._generation += 1
        self._slot_generation[slot] = self._generation
        return slot

    def _guard_device_region(self, slot: int, stream: Stream | None) -> None:
        # Invariant 2: on the staging stream, stream order already puts this stage's copy
        # after every earlier kernel that read the slot. Registered consumer streams get a
        # device-side wait: their queued work must finish before the region is overwritten.
        for consumer, fences in self._consumers:
            if consumer is stream:
                continue
            fences[slot].record(consumer)
            self._transport.stream_wait(stream, fences[slot])
        if self.settings.debug:
            # Poison the recycled region so a stale raw view reads NaN / -1, not old data.
            self._transport.fill(self._device_slots[slot], _POISON_BYTE, stream)

    def _readback_wait(self, fence: Fence) -> None:
        start = time.perf_counter()
        fence.synchronize()  # sync-ok: the caller asked for values whose copy is still queued
        counters = self._counters
        counters.readback_waits += 1
        counters.readback_wait_seconds += time.perf_counter() - start

    def _stall(self, slot: int, fence: Fence) -> None:
        start = time.perf_counter()
        fence.synchronize()  # sync-ok: invariant 1, bounded; only when the GPU is num_slots stages behind
        waited = time.perf_counter() - start
        counters = self._counters
        counters.stalls += 1
        counters.stall_seconds += waited
        counters.max_stall_seconds = max(counters.max_stall_seconds, waited)
        if self.settings.log_stalls:
            _log.warning("slot.stall", slot=slot, seconds=waited, stalls=counters.stalls)
