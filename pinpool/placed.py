"""``Placed``: a layout for a row count placed in one slot and one destination, made once and kept with the slot.

A decode step opens the same layout at the same size in the same slot lap after lap, so its puts
are a dict lookup and a pack. Nothing here depends on the live count: a step's state is its stage's.
"""

from __future__ import annotations

import math
from collections.abc import Mapping
from typing import TYPE_CHECKING, Any

import numpy as np
import torch

from pinpool.encode import NUMPY_DTYPE, as_source, packer_for, write
from pinpool.exceptions import CapacityError, PoolStateError, StagingValueError
from pinpool.layout import LANDING_ITEMSIZE, HostImage, Layout, align_up, landing_column

if TYPE_CHECKING:
    from pinpool.slot import SlotMemory


def claim_tail(tail: int, cursor: int, nbytes: int, alignment: int, name: str) -> int:
    """Where ``nbytes`` claimed below ``tail`` start: landed values fill a slot from its end down, past ``cursor``."""
    start = (tail - nbytes) // alignment * alignment
    if start < cursor:
        raise CapacityError(
            f"'{name}' needs {nbytes} bytes but the slot has {max(tail - cursor, 0)} left; "
            "raise PoolSettings.slot_bytes"
        )
    return start


class Placed:
    """``layout`` at ``rows`` rows in slot memory ``mem``, landing at ``dst`` (or a block's ``views``)."""

    def __init__(
        self,
        layout: Layout,
        rows: int,
        mem: SlotMemory,
        dst: torch.Tensor,
        views: Mapping[str, torch.Tensor] | None,
        capacity: int,
    ) -> None:
        self.layout, self.rows, self.dst = layout, rows, dst  # held, so the ids in the slot's key stay theirs
        self.all_written = layout.all_written
        self.nbytes = nbytes = layout.nbytes(rows)
        if nbytes > capacity:
            raise CapacityError(
                f"a layout of {rows} rows needs {nbytes} bytes but the stage has {capacity}; "
                "raise PoolSettings.slot_bytes or lower max_rows"
            )
        self.cursor = align_up(nbytes, mem.alignment)
        self.host_views = layout.host_views(mem.host[torch.uint8], rows)
        self.views = dict(views) if views is not None else layout.device_views(dst, rows)
        at = [mem.host_base + off for off in layout.offsets(rows)]
        #: name -> (index, first byte in the slab, dtype, the packer of ``rows`` values or None), input fields only.
        self.fields = {
            f.name: (i, at[i], f.dtype, packer_for(f.dtype, rows))
            for i, f in enumerate(layout.fields)
            if f.lands is None
        }
        #: Per landing field, for every row: (its address field in the slot, the addresses, the values' host view).
        landed = []
        self.tail = mem.nbytes
        for i in layout.landings:
            name, dtype = layout.fields[i].name, layout.fields[i].lands
            assert dtype is not None
            self.tail = start = claim_tail(self.tail, self.cursor, rows * LANDING_ITEMSIZE[dtype], mem.alignment, name)
            column = (landing_column(rows, dtype) + (mem.address + start)).tobytes()
            values = mem.host[torch.uint8][start : start + rows * LANDING_ITEMSIZE[dtype]].view(NUMPY_DTYPE[dtype])
            landed.append((mem.host_bytes[at[i] : at[i] + len(column)], memoryview(column), values))
        self.landed: tuple[tuple[memoryview, memoryview, np.ndarray[Any, Any]], ...] = tuple(landed)
        self.landing_of = {layout.fields[i].name: k for k, i in enumerate(layout.landings)}

    def input_field(self, name: str) -> int:
        """The index of input field ``name``; a typed error for an unknown name or a landing."""
        i = self.layout.field(name)
        if self.layout.fields[i].lands is not None:
            raise PoolStateError(f"field {name!r} is a landing: the stage writes its addresses itself")
        return i

    def put(self, name: str, values: Any, live: int) -> int:
        """Field ``name``'s ``live`` rows from ``values``, converted exactly or refused as it was; its index."""
        i = self.input_field(name)
        dtype = self.layout.fields[i].dtype
        src, _, shape = as_source(values, dtype, name)
        if math.prod(shape) != live:
            raise StagingValueError(f"'{name}' must hold {live} values, one per live row (got shape {shape})")
        if isinstance(src, np.ndarray):
            write(self.host_views[i][:live], src, dtype, name)  # an array is checked before it is written
        else:  # a list is written, then checked: aside, so a refused one leaves the field as it was
            converted = np.empty(live, NUMPY_DTYPE[dtype])
            write(converted, src, dtype, name)
            self.host_views[i][:live] = converted
        return i

    def put_image(self, image: HostImage, live: int, mem: SlotMemory) -> None:
        """Every field from ``image`` (padding included, one memcpy), then this step's landing addresses."""
        if not isinstance(image, HostImage) or (image.layout, image.rows, image.live) != (self.layout, self.rows, live):
            raise StagingValueError(
                f"'image' must be this stage's layout.host_image({self.rows}, {live}) (got {image!r})"
            )
        data = image.data  # a public attribute: checked, as a size mismatch would write past the layout
        if not isinstance(data, np.ndarray) or data.dtype != np.uint8 or data.shape != (self.nbytes,):
            raise StagingValueError(
                f"'image.data' must be uint8 of the layout's {self.nbytes} bytes "
                f"(got {getattr(data, 'dtype', type(data).__name__)} {getattr(data, 'shape', '')})"
            )
        mem.host_bytes[mem.host_base : mem.host_base + data.nbytes] = data  # type: ignore[call-overload]
        n = live * 8  # the image holds no addresses: this step's go back over it
        for addresses, column, _ in self.landed:
            addresses[:n] = column[:n]

    def unwritten(self, written: int) -> PoolStateError:
        """The error for a step that left an input field unwritten: the slot still holds an older step's values."""
        missing = [f.name for i, f in enumerate(self.layout.fields) if f.lands is None and not written >> i & 1]
        return PoolStateError(
            f"every input field must be written each step (missing: {missing}); the slot still holds an "
            "older step's values there, so the stage was aborted and nothing was copied"
        )

    def pad(self, live: int) -> None:
        """Write every field's padding rows (``live`` onwards) in the slot."""
        for view, pad in zip(self.host_views, self.layout.pads, strict=True):
            view[live:] = pad
