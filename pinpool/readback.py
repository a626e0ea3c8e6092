"""``Readback``: device values brought back to a pinned slot, read when their fence has passed.

The other direction of the ring: ``pool.readback(tensor)`` claims a slot like a stage,
queues one device-to-pinned copy on its stream and records the slot's fence there. The
host reads the values later (a decode loop reads step N's tokens while the GPU runs step
N+1), so the wait in ``values()`` is normally already satisfied.
"""

from __future__ import annotations

from typing import Any, Protocol

import numpy as np

from pinpool.exceptions import PoolStateError, StaleLeaseError
from pinpool.layout import VIEW_LIFETIME
from pinpool.transport import Fence


class SlotReads(Protocol):
    """What a read-back handle asks of its ring (``PinnedRingBuffer`` is the one implementation).

    Typed here, beside its user, so that this module never imports the ring: the ring imports it.
    """

    def slot_generation(self, slot: int) -> int: ...

    def wait_for_readback(self, fence: Fence) -> None: ...


class Readback:
    """A pending device-to-host copy into one ring slot.

    Example::

        handle = pool.readback(next_tokens)   # queued on the current stream, no wait
        ...                                   # launch the next step
        tokens = handle.tolist()              # sync-ok: waits only if the copy has not landed
    """

    __slots__ = ("_fence", "_host", "_landed_seen", "_pool", "generation", "slot")

    def __init__(self, pool: SlotReads, slot: int, generation: int, fence: Fence, host: np.ndarray[Any, Any]):
        self._pool = pool
        self.slot = slot
        self.generation = generation
        self._fence = fence
        self._host = host
        self._landed_seen = False  # a fence once passed stays passed (until the slot is recycled)

    @property
    def size(self) -> int:
        """How many values the handle reads."""
        return int(self._host.size)

    def ready(self) -> bool:
        """True once the copy has landed (never blocks)."""
        if not self._landed_seen:
            self._landed_seen = self._fence.query()
        return self._landed_seen

    def values(self) -> np.ndarray[Any, Any]:
        """The copied values as a numpy array of their own (waits if the copy is still queued)."""
        self._landed()
        return self._host.copy()

    def tolist(self) -> Any:
        """The copied values as Python numbers (waits if the copy is still queued).

        What a scheduler wants for next-token ids; it skips the intermediate array of
        ``values()``.
        """
        self._landed()
        return self._host.tolist()  # sync-ok: a numpy view of pinned host memory whose fence has passed (checked above)

    def _stale(self) -> StaleLeaseError:
        return StaleLeaseError(
            f"{type(self).__name__.lower()} of generation {self.generation} (slot {self.slot}) was read after the "
            f"slot was recycled; read it within {VIEW_LIFETIME}"
        )

    def _landed(self) -> None:
        if self._pool.slot_generation(self.slot) != self.generation:
            raise self._stale()
        if not self._landed_seen:
            if not self._fence.query():
                self._pool.wait_for_readback(self._fence)
            self._landed_seen = True


class Landing(Readback):
    """Values a kernel writes straight into a stage's slot (``Field.landing``, ``Stage.land``), read after its fence.

    Nothing is copied: the kernel stores into the pinned slot through UVA. The fence that
    covers it is recorded when the stage closes, so the handle is readable only after a
    successful close; reading it before, or after an aborted stage, raises
    ``PoolStateError``. Then it reads like a ``Readback`` (``values``, ``tolist``,
    ``ready``), within ``num_slots - 1`` further claims of the ring (``VIEW_LIFETIME``).
    """

    __slots__ = ("armed",)

    def __init__(self, pool: SlotReads, slot: int, generation: int, fence: Fence, host: np.ndarray[Any, Any]):
        # ``Readback.__init__``'s fields, set here without the extra call: a decode step
        # makes one of these right after its launches, when every call runs cold.
        self._pool = pool
        self.slot = slot
        self.generation = generation
        self._fence = fence
        self._host = host
        self._landed_seen = False
        #: Set by the stage's successful close, once the fence follows the writing kernel.
        self.armed = False

    def ready(self) -> bool:
        if not self.armed:
            return False
        if not self._landed_seen:
            self._landed_seen = self._fence.query()
        return self._landed_seen

    def tolist(self) -> Any:
        """The landed values as Python numbers (waits if the writer has not run yet)."""
        # ``_landed`` inline: a decode loop reads one of these a step, right after its launches.
        if not self.armed or self._pool.slot_generation(self.slot) != self.generation:
            self._landed()  # raises: read before a successful close, or the slot recycled
        if not self._landed_seen:
            if not self._fence.query():
                self._pool.wait_for_readback(self._fence)
            self._landed_seen = True
        return self._host.tolist()  # sync-ok: a numpy view of pinned host memory whose fence has passed (checked above)

    def _landed(self) -> None:
        # ``Readback._landed`` with the armed check first, in one call (a decode loop reads
        # one of these a step).
        if not self.armed:
            raise PoolStateError(
                f"landing of stage {self.generation} (slot {self.slot}) was read before its stage closed, or its "
                "stage was aborted: the slot's fence follows the writing kernel only after a successful close"
            )
        if self._pool.slot_generation(self.slot) != self.generation:
            raise self._stale()
        if not self._landed_seen:
            if not self._fence.query():
                self._pool.wait_for_readback(self._fence)
            self._landed_seen = True
