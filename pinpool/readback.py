"""``Readback`` and ``Landing``: device values in a pinned slot, read once the slot's fence has passed."""

from __future__ import annotations

from typing import Any, Protocol

import numpy as np

from pinpool.exceptions import PoolStateError, StaleLeaseError
from pinpool.layout import VIEW_LIFETIME
from pinpool.slot import SlotMemory
from pinpool.transport import Fence


class SlotReads(Protocol):
    """What a read-back handle asks of its ring (so that this module never imports the ring)."""

    def wait_for_readback(self, fence: Fence) -> None: ...


class Readback:
    """A pending device-to-host copy into one ring slot (``pool.readback(t)``, docs/rules.md rule 6)."""

    __slots__ = ("_fence", "_host", "_landed_seen", "_mem", "_pool", "armed", "generation", "slot")

    def __init__(self, pool: SlotReads, mem: SlotMemory, host: np.ndarray[Any, Any], armed: bool = True) -> None:
        self._pool, self._mem, self.slot, self.generation, self._fence = pool, mem, mem.index, mem.generation, mem.fence
        self._host = host
        self._landed_seen = False  # a fence once passed stays passed (until the slot is recycled)
        #: Whether the fence covers the values: always for a copy; a ``Landing`` once its stage closed.
        self.armed = armed

    @property
    def size(self) -> int:
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
        if self._mem.generation != self.generation:
            raise StaleLeaseError(
                f"{type(self).__name__.lower()} of generation {self.generation} (slot {self.slot}) was read after "
                f"the slot was recycled; read it within {VIEW_LIFETIME}"
            )
        if not self._landed_seen:
            if not self._fence.query():
                self._pool.wait_for_readback(self._fence)
            self._landed_seen = True


class Landing(Readback):
    """Values a kernel stores straight into a stage's slot (a ``Field.landing``): made unarmed,
    armed by the stage's successful close; read before that, or after an abort, it raises ``PoolStateError``."""

    __slots__ = ()
