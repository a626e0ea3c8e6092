"""``Layout``: a step's fields, declared once, and where each sits for a given row count (docs/layouts.md)."""

from __future__ import annotations

from collections.abc import Mapping, Sequence
from typing import Any

import attrs
import numpy as np
import torch

from pinpool.encode import NUMPY_DTYPE, int_in_range, write
from pinpool.exceptions import SettingsError, StagingTypeError, StagingValueError

FIELD_ALIGN = 16
#: How long a ring view lives (a stage's device views, a read-back's or a landing's values); docs/rules.md.
VIEW_LIFETIME = "num_slots - 1 further claims of the ring"
LANDING_ITEMSIZE = {torch.int64: 8, torch.int32: 4, torch.float32: 4}
#: A landed value's address carries its dtype in its two low bits (free: values are 4-byte aligned), so a
#: writer stores exactly that dtype whatever it computed, never past the landing.
LANDING_TAG = {torch.int64: 0, torch.int32: 1, torch.float32: 2}


def align_up(nbytes: int, align: int) -> int:
    """The first multiple of ``align`` at or past ``nbytes``."""
    return (nbytes + align - 1) // align * align


def landing_column(numel: int, dtype: torch.dtype) -> np.ndarray[Any, Any]:
    """int64 [numel]: each landed value's byte offset from the landing's start, plus its dtype tag."""
    return np.arange(numel, dtype=np.int64) * LANDING_ITEMSIZE[dtype] + LANDING_TAG[dtype]


def _check_dtype(instance: Any, attribute: Any, value: Any) -> None:
    if not isinstance(value, torch.dtype) or value not in NUMPY_DTYPE:
        raise SettingsError(f"'dtype' of a field must be one of {sorted(map(str, NUMPY_DTYPE))} (got {value!r})")


def _check_name(instance: Any, attribute: Any, value: Any) -> None:
    if not isinstance(value, str) or not value.isidentifier():
        raise SettingsError(f"'name' of a field must be an identifier (got {value!r})")


def _check_lands(instance: Field, attribute: Any, value: torch.dtype | None) -> None:
    if value is None:
        return
    if value not in LANDING_ITEMSIZE:
        raise SettingsError(f"'lands' must be one of {list(map(str, LANDING_ITEMSIZE))} or None (got {value!r})")
    if instance.dtype != torch.int64 or instance.pad != 0:
        raise SettingsError(
            f"a landing field holds int64 addresses with pad 0 (got {instance.dtype}, pad {instance.pad!r})"
        )


@attrs.frozen
class Field:
    """One per-row input of ``dtype``; rows past the live ones hold ``pad``. ``lands``: a landing instead."""

    name: str = attrs.field(validator=_check_name)
    dtype: torch.dtype = attrs.field(validator=_check_dtype)
    pad: int | float = 0
    lands: torch.dtype | None = attrs.field(default=None, validator=_check_lands)

    @classmethod
    def landing(cls, name: str, dtype: torch.dtype = torch.int64) -> Field:
        """A field a kernel stores ``dtype`` results through: int64 host addresses, 0 on padding rows."""
        return cls(name, torch.int64, 0, dtype)


class Layout:
    """Fields declared once, for batches of up to ``max_rows`` rows."""

    def __init__(self, fields: Sequence[Field], max_rows: int) -> None:
        if not int_in_range(max_rows, 1):
            raise SettingsError(f"'max_rows' must be an int >= 1 (got {max_rows!r})")
        declared: tuple[Any, ...] = tuple(fields) if isinstance(fields, (list, tuple)) else (fields,)
        if not declared or not all(isinstance(f, Field) for f in declared):
            raise SettingsError(f"'fields' must be a non-empty sequence of Field (got {fields!r})")
        names = [f.name for f in declared]
        if len(set(names)) != len(names):
            raise SettingsError(f"'fields' names must be unique (got {names})")
        self.fields = fields = declared
        self.max_rows = max_rows
        self.index = {f.name: i for i, f in enumerate(fields)}
        #: Each field's pad as a numpy scalar of its dtype, checked once.
        self.pads = [_pad_scalar(f) for f in fields]
        self.landings = tuple(i for i, f in enumerate(fields) if f.lands is not None)
        #: The bit mask of a step that wrote every input field (landing fields write themselves).
        self.all_written = sum(1 << i for i, f in enumerate(fields) if f.lands is None)
        self.itemsizes = [int(NUMPY_DTYPE[f.dtype].itemsize) for f in fields]

    def check_rows(self, rows: Any, live: Any = 0) -> None:
        """A typed error for a row count outside ``[0, max_rows]``, or ``live`` real rows outside ``[0, rows]``."""
        if type(rows) is int and type(live) is int and 0 <= live <= rows <= self.max_rows:
            return  # every open asks: plain ints in range skip the calls below
        if not int_in_range(rows, 0, self.max_rows):
            raise StagingValueError(f"'rows' must be an int in [0, max_rows={self.max_rows}] (got {rows!r})")
        if not int_in_range(live, 0, rows):
            raise StagingValueError(f"'live' must be an int in [0, rows={rows}] (got {live!r})")

    def offsets(self, rows: int) -> list[int]:
        """Each field's first byte for ``rows`` padded rows (field-major); not cached: a slot's ``Placed`` keeps it."""
        self.check_rows(rows)
        offsets, cursor = [], 0
        for size in self.itemsizes:
            offsets.append(cursor)
            cursor = align_up(cursor + rows * size, FIELD_ALIGN)
        return offsets

    def nbytes(self, rows: int) -> int:
        """Bytes one step copies for ``rows`` padded rows."""
        return self.offsets(rows)[-1] + rows * self.itemsizes[-1]

    def field(self, name: str) -> int:
        """The index of field ``name``; a typed error naming the declared ones otherwise."""
        index = self.index.get(name)
        if index is None:
            raise StagingValueError(f"'name' must be a declared field, one of {list(self.index)} (got {name!r})")
        return index

    def host_views(self, raw: np.ndarray[Any, Any], rows: int) -> list[np.ndarray[Any, Any]]:
        """Each field's ``rows`` elements as a typed numpy view of ``raw`` (uint8, the layout's bytes)."""
        spans = zip(self.fields, self.offsets(rows), self.itemsizes, strict=True)
        return [raw[off : off + rows * size].view(NUMPY_DTYPE[f.dtype]) for f, off, size in spans]

    def device_views(self, raw: torch.Tensor, rows: int) -> dict[str, torch.Tensor]:
        """name -> each field's ``rows`` elements as a typed view of ``raw`` (uint8 device memory)."""
        spans = zip(self.fields, self.offsets(rows), self.itemsizes, strict=True)
        return {f.name: raw[off : off + rows * size].view(f.dtype) for f, off, size in spans}

    def host_image(self, rows: int, live: int) -> HostImage:
        """A plain host copy of the layout for (``rows``, ``live``), padding already written."""
        self.check_rows(rows, live)
        return HostImage(self, rows, live)


class HostImage:
    """A plain host copy of one step's layout for ``Stage.put_image``; ``views[name]``: a field's live rows."""

    __slots__ = ("data", "layout", "live", "rows", "views")

    def __init__(self, layout: Layout, rows: int, live: int) -> None:
        self.layout, self.rows, self.live = layout, rows, live
        self.data = np.zeros(layout.nbytes(rows), np.uint8)
        columns = layout.host_views(self.data, rows)
        for column, pad in zip(columns, layout.pads, strict=True):
            column[live:] = pad
        self.views: Mapping[str, np.ndarray[Any, Any]] = {
            f.name: column[:live] for f, column in zip(layout.fields, columns, strict=True)
        }


def _pad_scalar(f: Field) -> Any:
    pad = np.zeros(1, NUMPY_DTYPE[f.dtype])
    try:
        write(pad, [f.pad], f.dtype, f"{f.name}.pad")
    except (StagingValueError, StagingTypeError) as err:
        raise SettingsError(f"'pad' of field {f.name!r} must fit {f.dtype} (got {f.pad!r}): {err}") from None
    return pad[0]
