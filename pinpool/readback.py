"""``Readback``: device values brought back to a pinned slot, read when their fence has passed.

``pool.readback(tensor)`` claims a slot like a stage, queues one device-to-pinned copy and
records the slot's fence after it. The host reads later (step N's tokens while the GPU runs
step N+1), so the wait in ``values()`` has normally passed already.
"""

from __future__ import annotations

from typing import Any, Protocol

import numpy as np

from pinpool.exceptions import PoolStateError, StaleLeaseError
from pinpool.layout import VIEW_LIFETIME
from pinpool.transport import Fence


class SlotReads(Protocol):
    """What a read-back handle asks of its ring, typed here so that this module never imports the ring."""

    def slot_generation(self, slot: int) -> int: ...

    def wait_for_readback(self, fence: Fence) -> None: ...


class Readback:
    """A pending device-to-host copy into one ring slot.

    Example::

        handle = pool.readback(next_tokens)   # queued on the current stream, no wait
        ...                                   # launch the next step
        tokens = handle.tolist()              # sync-ok: waits only if the copy has not landed
    """

    __slots__ = ("_fence", "_host", "_landed_seen", "_pool", "armed", "generation", "slot")

    def __init__(
        self,
        pool: SlotReads,
        slot: int,
        generation: int,
        fence: Fence,
        host: np.ndarray[Any, Any],
        armed: bool = True,
    ) -> None:
        self._pool = pool
        self.slot = slot
        self.generation = generation
        self._fence = fence
        self._host = host
        self._landed_seen = False  # a fence once passed stays passed (until the slot is recycled)
        #: Whether the fence covers the values: always for a copy; a ``Landing`` once its stage closed.
        self.armed = armed

    @property
    def size(self) -> int:
        """How many values the handle reads."""
        return int(self._host.size)

    def ready(self) -> bool:
        """True once the values have landed (never blocks)."""
        if not self._landed_seen and self.armed:
            self._landed_seen = self._fence.query()
        return self._landed_seen

    def values(self) -> np.ndarray[Any, Any]:
        """The values as a numpy array of their own (waits if they have not landed yet)."""
        self._landed()
        return self._host.copy()

    def tolist(self) -> Any:
        """The values as Python numbers, without ``values()``'s array (waits if they have not landed yet)."""
        self._landed()
        return self._host.tolist()  # sync-ok: a numpy view of pinned host memory whose fence has passed (checked above)

    def _landed(self) -> None:
        if not self.armed:
            raise PoolStateError(
                f"landing of stage {self.generation} (slot {self.slot}) was read before its stage closed, or its "
                "stage was aborted: the slot's fence follows the writing kernel only after a successful close"
            )
        if self._pool.slot_generation(self.slot) != self.generation:
            raise StaleLeaseError(
                f"{type(self).__name__.lower()} of generation {self.generation} (slot {self.slot}) was read after "
                f"the slot was recycled; read it within {VIEW_LIFETIME}"
            )
        if not self._landed_seen:
            if not self._fence.query():
                self._pool.wait_for_readback(self._fence)
            self._landed_seen = True


class Landing(Readback):
    """Values a kernel stores straight into a stage's slot through UVA (``Field.landing``, ``Stage.land``).

    The fence covers them once the stage closes successfully (``armed``): reading before that, or
    after an aborted stage, raises ``PoolStateError``. Then it reads like a ``Readback``. Made unarmed
    (``armed=False``); the stage's successful close arms it.
    """

    __slots__ = ()
