"""``Exchange``: a decode step's metadata up and its results landed back, opened in one call.

``pool.exchange(fields, land=n)`` is ``pool.stage()``, a ``put`` per field, ``land(n)`` and
``flush()`` in one call: the step's kernels then read ``ex.views`` and store into
``ex.land_to``, and ``close()`` records the slot's fence after them. Same slot, same rules,
same single copy as the calls it replaces (it is a ``Stage``).

Why one call: right after a step's ~80 eager launches every host call runs cold, and the
exchange's cost is mostly its calls, not its bytes. A step repeats its layout (the same
slot sees the same field sizes lap after lap), so the first exchange of a layout on a slot
runs the general path (``put``, ``land``: every check) and keeps where each field went;
later ones pack each list straight into its place, write the landing's address column and
issue the copy. ``struct`` still checks every value (exact or refused, as ``put``); a list
it refuses goes through the general path, which converts it or raises the typed error.
"""

from __future__ import annotations

import struct
from collections.abc import Sequence
from typing import Any

import torch

from pinpool.encode import PACKERS
from pinpool.exceptions import StagingTypeError
from pinpool.readback import Landing
from pinpool.stage import Stage

#: One field of an exchange: a list of numbers (or any value ``Stage.put`` takes) and its dtype.
Field = tuple[Any, torch.dtype]


class Exchange(Stage):
    """A flushed stage holding a step's fields (``views``) and, with ``land=``, its landing.

    Example::

        with pool.exchange([(rows, torch.int64), (positions, torch.int64)], land=bs) as ex:
            rows_d, positions_d = ex.views
            tokens_d = sample(model(rows_d, positions_d), land_to=ex.land_to)  # stores into the slot
        tokens = ex.landing.tolist()  # sync-ok: after the close; waits only if the sampler has not run

    The copy is already issued: nothing more can be put. ``readback`` still works.
    """

    __slots__ = ("land_to", "landing", "views")
    #: The fields' device views, in order.
    views: tuple[torch.Tensor, ...]
    #: With ``land=``: int64 device addresses for the kernel that stores the values; else None.
    land_to: torch.Tensor | None
    #: With ``land=``: the handle that reads the landed values after the close; else None.
    landing: Landing | None

    def __enter__(self) -> Exchange:
        return self

    def fill(self, fields: Sequence[Field], land: int | None, land_dtype: torch.dtype) -> None:
        """Put ``fields``, claim the landing, issue the copy.

        On an error the caller (``PinnedRingBuffer.exchange``) aborts the stage: nothing
        was copied (except a field ``overflow='spill'`` spilled, which the abort fences).
        """
        layout = self._layout
        key = plan = None
        # A plan replays only arguments of the exact shapes it was made from: a list or tuple
        # of (values, dtype) tuples, ``land`` an int or None. Anything else (a generator, a
        # list pair, ``land=True``) takes the general path, which checks it.
        if (
            (type(fields) is list or type(fields) is tuple)
            and (land is None or type(land) is int)
            and type(land_dtype) is torch.dtype
        ):
            try:
                shapes = [(type(f[0]), f[1], len(f[0])) if type(f) is tuple and len(f) == 2 else None for f in fields]
                if None not in shapes:
                    key = (tuple(shapes), land, land_dtype)
                    plan = layout.exchanges.get(key)
            except TypeError:
                key = plan = None  # values without a length, an unhashable dtype: the general path says why
        if plan is not None:
            packs, views, landing_plan, used, cursor = plan
            host_bytes = layout.host_bytes
            try:
                for (values, _), (packer, at) in zip(fields, packs, strict=True):
                    packer.pack_into(host_bytes, at, *values)
            except (struct.error, TypeError, OverflowError):
                plan = None  # a value struct refuses: the general path converts it or raises typed
        if plan is None:
            plan = self._fill_general(fields, land, land_dtype)
            if plan is not None and key is not None:
                layout.exchanges.put(key, plan)
        else:
            self.views = views
            self.used_bytes, self._cursor = used, cursor
            if landing_plan is None:
                self.land_to = self.landing = None
            else:
                tail, _, offset, column, addresses, values_host, fence = landing_plan
                base = layout.host_base + offset
                layout.host_bytes[base : base + len(column)] = column
                self._tail, self.landings = tail, True
                handle = self.landing = Landing(self._pool, self.slot, self.generation, fence, values_host)
                self._landings.append(handle)
                self.land_to = addresses
        self._pool.issue_copy(self)
        self.flushed = True

    def _fill_general(self, fields: Sequence[Field], land: int | None, land_dtype: torch.dtype) -> Any:
        """Every field through ``put`` and the landing through ``land`` (all their checks); the plan
        that repeats it, or None when a field or the landing cannot be replayed so."""
        if isinstance(fields, (str, bytes)) or not isinstance(fields, Sequence):
            raise StagingTypeError(
                f"'fields' must be a sequence of (values, dtype) pairs (got {type(fields).__name__})"
            )
        layout = self._layout
        packs: list[tuple[struct.Struct, int]] = []
        views: list[torch.Tensor] = []
        plannable = True
        for i, field in enumerate(fields):
            if not isinstance(field, tuple) or len(field) != 2:
                raise StagingTypeError(f"'fields[{i}]' must be a (values, dtype) pair (got {type(field).__name__})")
            values, dtype = field
            start = self._cursor
            view = self.put(values, dtype, name=f"fields[{i}]")
            views.append(view)
            packer = PACKERS.get((dtype, len(values))) if type(values) is list else None
            if packer is None or self.spilled or self.used_bytes != start + packer.size or view.dim() != 1:
                plannable = False  # not a flat list struct packs in place at ``start``
            else:
                packs.append((packer, layout.host_base + start))
        self.views = tuple(views)
        landing_plan = None
        if land is None:
            self.land_to = self.landing = None
        else:
            key = (self._cursor, self._tail, self._capacity, land, land_dtype)
            self.land_to, self.landing = self.land(land, land_dtype, name="land")
            landing_plan = layout.landings.get(key)  # the plan ``land`` kept; None when it spilled
            plannable = plannable and landing_plan is not None and not self.spilled
        if not plannable:
            return None
        return tuple(packs), self.views, landing_plan, self.used_bytes, self._cursor
