"""Where a stage's bytes land (``Placement``), its one lifecycle (``State``), and what a block stage asks of its block.

- ``RING``: the slot's device mirror (``pool.stage()``): views rotate with the slot;
- ``OWNED``: device memory the caller owns or the pool allocates (``owned=``);
- ``BLOCK``: a fixed device block a CUDA graph captures (``DeviceBlock.stage``);
- ``IN_PLACE``: the pinned slot itself, read over UVA (``zero_copy=True``): no copy.
"""

from __future__ import annotations

import enum
from collections.abc import Mapping
from typing import Protocol

import torch

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
