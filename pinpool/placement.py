"""Where a stage's bytes land (``Placement``), its one lifecycle (``State``), and what a stage asks of its ring
(``RingSide``) and of its block (``BlockSide``).

- ``RING``: the slot's device mirror (``pool.stage()``): views rotate with the slot;
- ``OWNED``: device memory the caller owns or the pool allocates (``owned=``);
- ``BLOCK``: a fixed device block a CUDA graph captures (``DeviceBlock.stage``);
- ``IN_PLACE``: the pinned slot itself, read over UVA (``zero_copy=True``): no copy.
"""

from __future__ import annotations

import enum
from collections.abc import Mapping
from typing import Any, Protocol, TypeVar

import torch

from pinpool.readback import Readback, SlotReads
from pinpool.settings import PoolSettings
from pinpool.transport import Stream


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


class BlockSide(Protocol):
    """What a ``BLOCK`` stage asks of its ``DeviceBlock`` around the copy."""

    def before_copy(self, stream: Stream) -> None: ...
    def after_copy(self, stream: Stream) -> None: ...
    def wait_for_readers(self, stream: Stream) -> None: ...
    def views(self, rows: int) -> Mapping[str, torch.Tensor]: ...


#: The ``Stage`` that asks its ring (``RingSide[Stage]``): a parameter, as stage.py imports this module.
_S = TypeVar("_S", contravariant=True)


class RingSide(SlotReads, Protocol[_S]):
    """What a stage asks of its ring (``SlotRing``, the package's side of ``PinnedRingBuffer``)."""

    settings: PoolSettings
    can_land: bool

    @property
    def device(self) -> torch.device: ...

    def _issue_copy(self, st: _S) -> None: ...
    def _finish(self, st: _S, ok: bool) -> None: ...
    def _copy_back(
        self, slot: int, generation: int, stream: Stream, src: torch.Tensor, views: tuple[torch.Tensor, Any, int]
    ) -> Readback: ...
