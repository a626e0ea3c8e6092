"""``StaticInputs``: graph-static device inputs, landed each step by one copy from a ring slot.

A captured CUDA graph reads its inputs at the addresses it saw at capture. The ring's
views rotate between slots, so a graph cannot read them; a ``StaticInputs`` block can.
Its fields (name, dtype, padding value) are declared once and live in one device
allocation. For a padded batch of ``rows`` rows the layout is field-major: field ``f``
holds ``rows`` elements at a fixed offset, so ``views(rows)`` are the same tensors every
step and a graph captured for ``rows`` reads them. Each graph size has its own layout in
the same allocation, and a step copies only its own size's bytes.

Each step::

    with block.stage(rows=16, live=13) as st:      # an owned stage of the pool (rule 4)
        st.put("positions", positions)             # live rows; padding is written on close
        st.host("seeds")[:] = seeds                # or fill the pinned slot in place
    graph.replay()                                 # reads block.views(16)

On close the host writes every field's padding, and ONE host-to-device copy lands the
whole layout in the block: no device-to-device copy, no fill kernel, no allocation.

Stream rules (README, rule 9). The copy runs on the stage's stream (rule 2: fixed at
open). Work that reads the block on that stream is ordered by the stream. A replay on
another stream must be registered (``register_reader``): before the copy, the stage's
stream waits on the device for the work queued on each reader so far (the previous
replay), and each reader waits for the copy before its next work. No host wait.
"""

from __future__ import annotations

from collections.abc import Mapping, Sequence
from types import TracebackType
from typing import Any

import attrs
import numpy as np
import torch

from pinpool.cache import BoundedCache
from pinpool.encode import NUMPY_DTYPE, as_source, int_in_range, write
from pinpool.exceptions import PoolStateError, SettingsError, StagingTypeError, StagingValueError
from pinpool.readback import Landing, Readback
from pinpool.ring import PinnedRingBuffer
from pinpool.slots import align_up
from pinpool.stage import LAND_WITHOUT_FLUSH, Stage, landing_itemsize, landing_offsets
from pinpool.transport import Fence, Stream, wait_for_streams

#: Each field's first byte is aligned to this, whatever the dtypes around it.
FIELD_ALIGN = 16


def _check_dtype(instance: Any, attribute: Any, value: Any) -> None:
    try:
        known = value in NUMPY_DTYPE
    except TypeError:  # unhashable: certainly no dtype
        known = False
    if not known:
        raise SettingsError(f"'dtype' of a static field must be one of {sorted(map(str, NUMPY_DTYPE))} (got {value!r})")


def _check_name(instance: Any, attribute: Any, value: Any) -> None:
    if not isinstance(value, str) or not value.isidentifier():
        raise SettingsError(f"'name' of a static field must be an identifier (got {value!r})")


@attrs.frozen
class StaticField:
    """One graph input: a 1-D tensor of ``rows`` elements; rows past the live ones hold ``pad``."""

    name: str = attrs.field(validator=_check_name)
    dtype: torch.dtype = attrs.field(validator=_check_dtype)
    pad: int | float = 0


class StaticInputs:
    """One device allocation of graph inputs, restaged in place by one copy per step."""

    def __init__(self, pool: PinnedRingBuffer, fields: Sequence[StaticField], max_rows: int) -> None:
        if not int_in_range(max_rows, 1):
            raise SettingsError(f"'max_rows' must be an int >= 1 (got {max_rows!r})")
        fields = tuple(fields)
        if not fields or not all(isinstance(f, StaticField) for f in fields):
            raise SettingsError(f"'fields' must be a non-empty sequence of StaticField (got {fields!r})")
        names = [f.name for f in fields]
        if len(set(names)) != len(names):
            raise SettingsError(f"'fields' names must be unique (got {names})")
        for f in fields:
            _pad_array(f)  # refuses a pad value the dtype cannot hold, now rather than per step
        if _nbytes(fields, max_rows) > pool.settings.slot_bytes:
            raise SettingsError(
                f"'max_rows' {max_rows} needs {_nbytes(fields, max_rows)} bytes per step but a slot holds "
                f"{pool.settings.slot_bytes}; raise PoolSettings.slot_bytes or lower max_rows"
            )
        self.pool = pool
        self.fields = fields
        self.max_rows = max_rows
        self._index = {f.name: i for i, f in enumerate(fields)}
        self._nbytes: dict[int, int] = {}
        #: The bit mask of a stage that wrote every field.
        self.all_written = (1 << len(fields)) - 1
        #: Each field's pad as a numpy scalar of its dtype.
        self.pads = [_pad_array(f) for f in fields]
        transport = pool.transport
        self._transport = transport
        # The block comes from the caching allocator on the pool device's current stream,
        # which may still have work queued on that memory: the first copy on another
        # stream waits for it (the same rule as the ring's mirror).
        alloc_stream = transport.resolve_stream(None)
        #: The one device allocation every layout lives in (uint8, device memory).
        self.device_block = transport.alloc_device(_nbytes(fields, max_rows), alloc_stream)
        # The stream of the block's last writer: its allocation, then each stage's copy. A
        # copy on another stream, or a newly registered reader, first waits for it.
        self._writer: Stream = alloc_stream
        self._writer_fence = transport.new_fence()
        self._readers: list[Stream] = []
        self._read_fences: list[Fence] = []
        self._landed = transport.new_fence()
        self._seen_streams: list[Stream] = [alloc_stream]
        self._device_views: dict[int, dict[str, torch.Tensor]] = {}
        self._host_views: BoundedCache[
            tuple[int, int, int], tuple[np.ndarray[Any, Any], list[np.ndarray[Any, Any]]]
        ] = BoundedCache()
        #: (slot, landing offset, rows, live, dtype, field) -> (the address column's offset in
        #: the slot, its bytes, the landing's typed host view): for ``StaticStage.land``.
        self.landing_views: BoundedCache[tuple[Any, ...], tuple[int, bytes, np.ndarray[Any, Any]]] = BoundedCache()
        #: (field name, landing dtype) -> (field index, the landed dtype's size): checked once.
        self.landing_fields: dict[tuple[str, torch.dtype], tuple[int, int]] = {}
        self._open: StaticStage | None = None

    # -- layout ------------------------------------------------------------------------
    def offsets(self, rows: int) -> list[int]:
        """Byte offset of each field for a padded batch of ``rows`` rows."""
        return _offsets(self.fields, rows)

    def nbytes(self, rows: int) -> int:
        """Bytes one step copies for ``rows`` padded rows."""
        cached = self._nbytes.get(rows)
        if cached is None:
            cached = self._nbytes[rows] = _nbytes(self.fields, rows)
        return cached

    def views(self, rows: int) -> Mapping[str, torch.Tensor]:
        """name -> device view of ``rows`` elements: fixed addresses, for a graph to capture."""
        self._check_rows(rows)
        views = self._device_views.get(rows)
        if views is None:
            views = self._device_views[rows] = {
                f.name: self.device_block[off : off + rows * _itemsize(f.dtype)].view(f.dtype)
                for f, off in zip(self.fields, self.offsets(rows), strict=True)
            }
        return views

    def host_image(self, rows: int, live: int) -> HostImage:
        """A plain host copy of the layout for (``rows``, ``live``), padding already written."""
        self._check_rows(rows)
        self._check_live(rows, live)
        return HostImage(self, rows, live)

    # -- streams -----------------------------------------------------------------------
    def register_reader(self, stream: Stream) -> None:
        """Declare a stream (a graph replay's) that reads the block; see the module's stream rules."""
        transport = self._transport
        stream = transport.resolve_stream(stream)
        if any(transport.same_stream(r, stream) for r in self._readers):
            return
        # What the block holds now may still be landing on the writer's stream: the new
        # reader's next work waits for it, as it will for every later copy.
        wait_for_streams(transport, stream, ((self._writer, self._writer_fence),))
        self._readers.append(stream)
        self._read_fences.append(self._transport.new_fence())
        self._note_stream(stream)
        # A replay there may store into a slot (a landing): the pool's teardown waits for it.
        self.pool.drain_at_teardown(stream)

    @property
    def readers(self) -> tuple[Stream, ...]:
        return tuple(self._readers)

    # -- staging -----------------------------------------------------------------------
    def stage(self, rows: int, live: int, *, stream: Stream | None = None) -> StaticStage:
        """Open this step's stage: ``live`` real rows of a graph sized ``rows``.

        The stream is fixed now (rule 2): the one passed, or the pool device's current one.
        """
        self._check_rows(rows)
        self._check_live(rows, live)
        if self._open is not None:
            raise PoolStateError("a StaticInputs stage is already open: close it before opening the next")
        st = self.pool.stage(stream=stream, owned=self.device_block, reuse_owned=True)
        try:
            nbytes = self.nbytes(rows)
            start = st.claim_bytes(nbytes, name="static inputs")
        except BaseException:
            st.close(ok=False)
            raise
        # The slot's bytes for this size, whole and per field: built once per (slot, size).
        key = (st.slot, rows, start)
        hit = self._host_views.get(key)
        if hit is None:
            host_raw = st.slot_view(start, nbytes)[1]
            hit = self._host_views.put(
                key,
                (
                    host_raw,
                    [
                        host_raw[off : off + rows * _itemsize(f.dtype)].view(NUMPY_DTYPE[f.dtype])
                        for f, off in zip(self.fields, self.offsets(rows), strict=True)
                    ],
                ),
            )
        opened = self._open = StaticStage(self, st, hit[1], hit[0], rows, live)
        self._note_stream(st.stream)
        return opened

    # -- used by StaticStage -------------------------------------------------------------
    def field_index(self, name: str) -> int:
        index = self._index.get(name)
        if index is None:
            known = list(self._index)
            raise StagingValueError(f"'name' must be a declared static field, one of {known} (got {name!r})")
        return index

    def finish(self, sst: StaticStage, ok: bool) -> None:
        """Close ``sst``: its copy unless issued already (``flush``) or aborted, then the slot's fence."""
        self._open = None
        st = sst.stage
        if not sst.flushed and not ok:
            # Nothing copied: the block keeps the last copied step's values, its landing addresses
            # included, which point into that step's slot (reused after VIEW_LIFETIME):
            # replaying after an aborted step would store there (README, rule 9).
            st.close(ok=False)
            return
        try:
            if not sst.flushed:
                self.issue(sst)
        finally:
            # The slot's fence, on the stage's stream, after the copy (and any read-back);
            # a copy that raised still closes the ring's stage (fenced if it was queued).
            st.close(ok=ok and sst.flushed)

    def issue(self, sst: StaticStage) -> None:
        """Pad, order the copy after the block's previous readers and writer, copy, order readers after it."""
        st = sst.stage
        live, rows = sst.live, sst.rows
        if live < rows and not sst.padded:
            for view, pad in zip(sst.host_views, self.pads, strict=True):
                view[live:] = pad
        transport, stream = self._transport, st.stream
        readers = self._readers
        if readers:
            # Before the copy overwrites the block: the previous readers' work must be done.
            self.wait_for_readers(stream)
        writer = self._writer
        if writer is not stream:
            # A change of stream (rule 2): the previous copy (or the allocation) may still be
            # queued there; this copy must land after it, or the block ends on older values.
            wait_for_streams(transport, stream, ((writer, self._writer_fence),))
        self._writer = stream
        st.flush()  # the one copy, on the stage's stream
        sst.flushed = True  # from here on the copy is queued: close must fence it
        if not readers:
            return
        waiting = [r for r in readers if not transport.same_stream(r, stream)]
        if waiting:
            self._landed.record(stream)
            for reader in waiting:
                transport.stream_wait(reader, self._landed)

    def wait_for_readers(self, stream: Stream) -> None:
        """Make ``stream`` wait, on the device, for the work queued so far on every other reader."""
        if self._readers:
            wait_for_streams(self._transport, stream, zip(self._readers, self._read_fences, strict=True))

    def fence_after_readers(self, stream: Stream) -> None:
        """Before a stage with landings records its fence on ``stream``: the readers' work (the kernel
        that stores into the slot) must come first, so the fence follows it."""
        self.wait_for_readers(stream)

    def record_stream(self, stream: Stream) -> None:
        """Declare a stream that touches the block outside stages and readers (device-to-device
        writes into ``views``, say), so its memory is not reused while that stream may use it."""
        self._note_stream(self._transport.resolve_stream(stream))

    def _note_stream(self, stream: Stream) -> None:
        # torch's caching allocator frees a block for reuse by its allocation stream only:
        # a block also used on other streams is recorded there, so teardown cannot hand
        # it out while a copy or a replay queued on them may still touch it.
        seen = self._seen_streams
        if stream is seen[-1] or any(self._transport.same_stream(s, stream) for s in seen):
            return
        self._seen_streams.append(stream)
        block = self.device_block
        if isinstance(stream, torch.cuda.Stream) and block.is_cuda:
            block.record_stream(stream)

    def _check_rows(self, rows: int) -> None:
        if not int_in_range(rows, 1, self.max_rows):
            raise StagingValueError(f"'rows' must be an int in [1, max_rows={self.max_rows}] (got {rows!r})")

    @staticmethod
    def _check_live(rows: int, live: int) -> None:
        if not int_in_range(live, 0, rows):
            raise StagingValueError(f"'live' must be an int in [0, rows={rows}] (got {live!r})")


class StaticStage:
    """This step's values for a ``StaticInputs`` block: every field must be written before close."""

    __slots__ = (
        "_block",
        "_host_raw",
        "_landed",
        "_landings",
        "_written",
        "flushed",
        "host_views",
        "live",
        "padded",
        "rows",
        "stage",
    )

    def __init__(
        self,
        block: StaticInputs,
        stage: Stage,
        host_views: list[np.ndarray[Any, Any]],
        host_raw: np.ndarray[Any, Any],
        rows: int,
        live: int,
    ) -> None:
        self._block = block
        self.stage = stage
        self.host_views = host_views
        self._host_raw = host_raw  # the whole layout's pinned bytes
        self.rows = rows
        self.live = live
        self._written = 0  # bit i: field i was written this step
        #: True once the padding rows hold their pads (``put_image``): close skips writing them.
        self.padded = False
        #: True once the copy is issued (``flush``/``readback``): nothing more can be written.
        self.flushed = False
        self._landings: list[Landing] = []
        self._landed = 0  # bit i: field i holds landing addresses (land): nothing may overwrite it

    def put_image(self, image: HostImage) -> None:
        """Write every field, padding included, from ``image`` in one memcpy.

        ``image`` (``block.host_image(rows, live)``) is a caller's host copy of the layout
        for this stage's ``rows`` and ``live``; later ``put`` calls may still overwrite a
        field's live rows. For a scheduler whose batch changes rarely: build the image when
        it changes, update the per-step fields in it (or put them after), one memcpy a step.
        """
        if self.flushed:
            raise PoolStateError("this static stage was flushed: its copy is issued, so nothing more can be written")
        if self._landed:
            raise PoolStateError("put_image() must come before land(): the image would overwrite the landing addresses")
        if image.block is not self._block or image.rows != self.rows or image.live != self.live:
            raise StagingValueError(
                f"'image' must be this block's image for rows={self.rows}, live={self.live} "
                f"(got rows={image.rows}, live={image.live}"
                f"{'' if image.block is self._block else ', of another block'})"
            )
        data = image.data  # a public attribute: checked, as a size mismatch would write past the block
        if not isinstance(data, np.ndarray) or data.dtype != np.uint8 or data.shape != self._host_raw.shape:
            raise StagingValueError(
                f"'image.data' must be uint8 of the layout's {self._host_raw.shape[0]} bytes "
                f"(got {getattr(data, 'dtype', type(data).__name__)} {getattr(data, 'shape', '')})"
            )
        # The block's bytes are the stage's first claim (offset 0): a memcpy, no numpy call (see land).
        self.stage.write_host(0, data)
        self._written = self._block.all_written
        self.padded = True

    @property
    def stream(self) -> Stream:
        return self.stage.stream

    def host(self, name: str) -> np.ndarray[Any, Any]:
        """The pinned host view of ``name``'s live rows, to fill in place before close."""
        if self.flushed:
            raise PoolStateError("this static stage was flushed: its copy is issued, so nothing more can be written")
        i = self._block.field_index(name)
        self._refuse_landed(i, name)
        self._written |= 1 << i
        return self.host_views[i][: self.live]

    def put(self, name: str, values: Any) -> None:
        """Write ``live`` values of field ``name`` (list, numpy array or CPU tensor), converted exactly."""
        if self.flushed:
            raise PoolStateError("this static stage was flushed: its copy is issued, so nothing more can be written")
        i = self._block.field_index(name)
        self._refuse_landed(i, name)
        dtype = self._block.fields[i].dtype
        if isinstance(values, np.ndarray) and values.dtype == NUMPY_DTYPE[dtype] and values.shape == (self.live,):
            self.host_views[i][: self.live] = values  # hot path: the engine's own arrays
        else:
            src, target, shape = as_source(values, dtype, name)
            if shape != (self.live,):
                raise StagingValueError(f"'{name}' must hold live={self.live} values (got shape {shape})")
            # Converted aside first: a value refused halfway must not leave the field half-overwritten.
            converted = np.empty(self.live, NUMPY_DTYPE[dtype])
            write(converted, src, target, name)
            self.host_views[i][: self.live] = converted
        self._written |= 1 << i

    def __enter__(self) -> StaticStage:
        return self

    def __exit__(
        self, exc_type: type[BaseException] | None, exc: BaseException | None, tb: TracebackType | None
    ) -> None:
        self.close(ok=exc_type is None)

    def flush(self) -> None:
        """Issue the step's one copy now, keeping the stage open for ``readback`` after the replay."""
        if not self.stage.is_open or self.flushed:
            raise PoolStateError("this static stage is closed or already flushed: its copy is issued")
        self._check_complete()
        self._block.issue(self)

    def readback(self, src: torch.Tensor) -> Readback:
        """Copy ``src`` (the replay's output) back into this step's slot: one slot, one fence, both ways.

        Call it after launching the work that reads the block and writes ``src`` (the
        graph replay), on the stage's stream or on a registered reader (the read-back then
        waits for that reader on the device); it flushes first if needed. The slot's fence
        is recorded after this copy, so close adds none. Read the handle within
        ``num_slots - 1`` further claims of the ring (``VIEW_LIFETIME``), like ``pool.readback``.
        """
        if not self.stage.is_open:
            raise PoolStateError("this static stage is closed: open the next step's with block.stage()")
        # Every check of ``src`` before the copy: a refused read-back leaves the step open.
        plan = self.stage.readback_plan(src)
        if not self.flushed:
            self.flush()
        # ``src`` is written by the replay, which may run on a registered reader: the
        # read-back's stream waits (on the device) for the work queued there so far.
        self._block.wait_for_readers(self.stage.stream)
        return self.stage.readback_planned(src, plan)

    def land(self, name: str, dtype: torch.dtype = torch.int64) -> Landing:
        """Have the replay write ``live`` values of ``dtype`` straight into this step's slot: no read-back copy.

        ``name`` is an int64 field with pad 0 that the graph passes to
        ``pinpool.landing.land`` as the addresses of its output. This writes, in that
        field's live rows, the pinned host address each row's value goes to, so the
        step's one copy carries them; padding rows keep 0 and store nothing. Call it
        before ``flush``. Launch the replay before ``close``, on the stage's stream or a
        registered reader: close makes the slot's fence follow the readers, and the
        returned handle becomes readable then. Needs a pool whose kernels may write its
        slots in place (``PoolSettings(zero_copy=True)``, platform check passed).
        """
        if self.flushed:
            raise PoolStateError("land() must come before flush(): the addresses travel in the step's copy")
        block = self._block
        # (name, dtype) pairs that passed the checks below: a loop lands the same one each step.
        checked = block.landing_fields.get((name, dtype)) if type(name) is str and type(dtype) is torch.dtype else None
        if checked is None:
            i = block.field_index(name)
            f = block.fields[i]
            if f.dtype != torch.int64 or f.pad != 0:
                raise StagingValueError(
                    f"'name' must be an int64 field with pad 0 to hold landing addresses (got {name!r}: {f.dtype}, "
                    f"pad {f.pad!r})"
                )
            checked = block.landing_fields[(name, dtype)] = (i, landing_itemsize(block.pool, dtype))
        i, itemsize = checked
        if self._landed >> i & 1:
            self._refuse_landed(i, name)  # raises
        live, st = self.live, self.stage
        start = st.claim_landing(live * itemsize, name=name)
        # A step repeats (slot, landing offset, rows, live, dtype): the address column's
        # bytes, where they go and the typed view are built once and kept, as the block's
        # host views are; a step then copies the bytes into place with no numpy call (numpy
        # runs cold right after a step's launches, at many times its cost alone).
        key = (st.slot, start, self.rows, live, dtype, i)
        hit = block.landing_views.get(key)
        if hit is None:
            address, raw = st.slot_view(start, live * itemsize)
            offset = self.host_views[i].__array_interface__["data"][0] - (address - start)
            column = (landing_offsets(live, dtype) + address).tobytes()
            hit = block.landing_views.put(key, (offset, column, raw.view(NUMPY_DTYPE[dtype])))
        offset, column, values = hit
        st.write_host(offset, column)
        self._written |= 1 << i
        self._landed |= 1 << i
        handle = st.landing_handle(values)
        self._landings.append(handle)
        return handle

    def _refuse_landed(self, i: int, name: str) -> None:
        if self._landed >> i & 1:
            raise PoolStateError(
                f"field {name!r} holds this step's landing addresses (land): writing it again would cancel the landing"
            )

    def _check_complete(self) -> None:
        block = self._block
        # With no live row every value is padding, which the stage writes itself.
        if self.live and self._written != block.all_written:
            missing = [f.name for i, f in enumerate(block.fields) if not self._written >> i & 1]
            block.finish(self, ok=False)
            raise PoolStateError(
                f"every static field must be written each step (missing: {missing}); the slot still holds an "
                "older step's values there, so the stage was aborted and nothing was copied"
            )

    def close(self, ok: bool = True) -> None:
        """Pad, then the one copy (``ok``); or abort, leaving the block as it was."""
        if not self.stage.is_open:
            return
        if ok and not self.flushed:
            if self._landings:
                # A copy issued now would leave live addresses in the block, for a replay
                # launched after close to store through past the slot's fence: abort.
                self._block.finish(self, ok=False)
                raise PoolStateError(LAND_WITHOUT_FLUSH)
            self._check_complete()  # raises, the stage aborted, when a field was not written
        # The addresses travel in the copy and the replay that stores runs after it: a copy
        # issued only now, at close, means no replay can have stored this step's values.
        flushed = self.flushed
        if self._landings and flushed:
            # The replay may run on a registered reader: the slot's fence, recorded at the
            # ring's close on the stage's stream (after any read-back's, since the stage has
            # landing bytes), must follow it.
            self._block.fence_after_readers(self.stage.stream)
            self.stage.guarded_by = self._block.readers
        self._block.finish(self, ok)
        if ok and flushed:
            for handle in self._landings:
                handle.armed = True


class HostImage:
    """A host copy (plain memory) of one step's layout, for ``StaticStage.put_image``.

    ``views[name]``: that field's ``live`` rows, to fill; its padding rows already hold
    the field's pad. Built by ``StaticInputs.host_image(rows, live)``.
    """

    __slots__ = ("block", "data", "live", "rows", "views")

    def __init__(self, block: StaticInputs, rows: int, live: int) -> None:
        self.block, self.rows, self.live = block, rows, live
        self.data = np.zeros(block.nbytes(rows), np.uint8)
        self.views: dict[str, np.ndarray[Any, Any]] = {}
        for f, off, pad in zip(block.fields, block.offsets(rows), block.pads, strict=True):
            column = self.data[off : off + rows * _itemsize(f.dtype)].view(NUMPY_DTYPE[f.dtype])
            column[live:] = pad
            self.views[f.name] = column[:live]


def _itemsize(dtype: torch.dtype) -> int:
    return int(NUMPY_DTYPE[dtype].itemsize)


def _offsets(fields: Sequence[StaticField], rows: int) -> list[int]:
    out, cursor = [], 0
    for f in fields:
        out.append(cursor)
        cursor += align_up(rows * _itemsize(f.dtype), FIELD_ALIGN)
    return out


def _nbytes(fields: Sequence[StaticField], rows: int) -> int:
    last = fields[-1]
    return _offsets(fields, rows)[-1] + rows * _itemsize(last.dtype)


def _pad_array(f: StaticField) -> Any:
    """The pad value as a numpy scalar of the field's dtype, checked once."""
    pad = np.zeros(1, NUMPY_DTYPE[f.dtype])
    try:
        write(pad, [f.pad], f.dtype, f"{f.name}.pad")
    except (StagingValueError, StagingTypeError) as err:
        raise SettingsError(f"'pad' of static field {f.name!r} must fit {f.dtype} (got {f.pad!r}): {err}") from None
    return pad[0]
