"""``LayoutStep``: one step of a declared layout in a claimed slot, for the ``Stage`` that holds it.

It tracks which input fields the step wrote (each must be, every step: the slot still holds
an older step's values) and writes the padding rows once.
"""

from __future__ import annotations

import math
from typing import Any

import numpy as np

from pinpool.encode import NUMPY_DTYPE, as_source, write
from pinpool.exceptions import PoolStateError, StagingTypeError, StagingValueError
from pinpool.layout import HostImage, Layout
from pinpool.slot import Placed, SlotMemory


class LayoutStep:
    """``layout`` at ``rows`` padded rows, ``live`` of them real, placed in slot memory ``mem``."""

    __slots__ = ("layout", "live", "mem", "padded", "placed", "rows", "written")

    def __init__(self, layout: Layout, rows: int, live: int, mem: SlotMemory, placed: Placed) -> None:
        self.layout, self.rows, self.live, self.mem, self.placed = layout, rows, live, mem, placed
        self.written = 0  # bit i: input field i was written this step
        self.padded = False

    def put(self, name: str, values: Any) -> None:
        """Field ``name``'s live rows from ``values``: converted exactly, or refused with the field as it was.

        ``Stage.put`` packs a list of the live count with the field's packer first; this is the rest."""
        spec = self.placed.fields.get(name)
        if spec is None:
            self.input_field(name)  # raises: an unknown field, or a landing
            return
        i, _, dtype = spec
        live = self.live
        src, _, shape = as_source(values, dtype, name)
        if math.prod(shape) != live:
            raise StagingValueError(f"'{name}' must hold {live} values, one per live row (got shape {shape})")
        if isinstance(src, np.ndarray):
            write(self.placed.host_views[i][:live], src, dtype, name)  # arrays are checked before the copy
        else:  # a list is written, then checked: aside, so a refused one leaves the field as it was
            converted = np.empty(live, NUMPY_DTYPE[dtype])
            write(converted, src, dtype, name)
            self.placed.host_views[i][:live] = converted
        self.written |= 1 << i

    def host(self, name: str) -> np.ndarray[Any, Any]:
        """Field ``name``'s live rows in the pinned slot, to fill in place (counts as written)."""
        i = self.input_field(name)
        self.written |= 1 << i
        return self.placed.host_views[i][: self.live]

    def put_image(self, image: HostImage) -> None:
        """Every field from a prebuilt host image (padding included): one memcpy."""
        layout, rows = self.layout, self.rows
        if not isinstance(image, HostImage) or (image.layout, image.rows, image.live) != (layout, rows, self.live):
            raise StagingValueError(
                f"'image' must be this stage's layout.host_image({rows}, {self.live}) (got {image!r})"
            )
        data = image.data  # a public attribute: checked, as a size mismatch would write past the layout
        if not isinstance(data, np.ndarray) or data.dtype != np.uint8 or data.shape != (self.placed.nbytes,):
            raise StagingValueError(
                f"'image.data' must be uint8 of the layout's {self.placed.nbytes} bytes "
                f"(got {getattr(data, 'dtype', type(data).__name__)} {getattr(data, 'shape', '')})"
            )
        mem = self.mem
        mem.host_bytes[mem.host_base : mem.host_base + data.nbytes] = data  # type: ignore[call-overload]
        n = self.live * 8  # the image holds no addresses: this step's go back over it
        for at, column, _ in self.placed.landed:
            mem.host_bytes[at : at + n] = column[:n]
        self.written, self.padded = layout.all_written, True

    def before_copy(self) -> None:
        """Refuse a step that left an input field unwritten, else write the padding rows once."""
        layout, written = self.layout, self.written
        if self.live and written != layout.all_written:
            missing = [f.name for i, f in enumerate(layout.fields) if f.lands is None and not written >> i & 1]
            raise PoolStateError(
                f"every input field must be written each step (missing: {missing}); the slot still holds an "
                "older step's values there, so the stage was aborted and nothing was copied"
            )
        if self.live < self.rows and not self.padded:
            self.placed.pad(self.live)
            self.padded = True

    def input_field(self, name: str) -> int:
        i = self.layout.field(name)
        if self.layout.fields[i].lands is not None:
            raise PoolStateError(f"field {name!r} is a landing: the stage writes its addresses itself")
        return i


def no_landing(step: LayoutStep | None, name: str) -> StagingValueError:
    """The error for asking a landing of ``name``, which is none of the step's layout's landings."""
    if step is not None:
        step.layout.field(name)  # an undeclared name: its own typed error
    return StagingValueError(f"'name' must be a landing field of this stage's layout (got {name!r})")


def no_layout(name: str) -> StagingTypeError:
    return StagingTypeError(f"put({name!r}, ...) names a field, but this stage has no layout")
