"""``DeviceBlock``: a layout's fixed device home for CUDA graphs, one copy per step, reader streams guarded.

Four parts:
- the layout (aligned offsets, fixed addresses, one allocation) and a round trip on the
  plain CPU path (``device="cpu"``, no transport): what lands, and exactly one copy;
- the errors: typed, raised before anything is claimed or with the stage aborted, so the
  block keeps the previous step's values and no copy is counted;
- the stream rules against the stream-aware simulator (``LaggingGpu``): a random plan
  per seed (the stage's stream passed or current, the current stream and device changed,
  one or two registered replay streams, random lag and frozen bursts, aborted steps, plain
  ring stages in between) must read every step's own values. The controls plant the bugs
  the reader guard exists for and must be caught in a fixed share of the same seeds;
- landing fields (``Field.landing``): the stage writes the live rows' addresses when it
  opens, and its slot fence follows the registered readers whose replay stores through
  them (with its control).

Defects these tests found are fixed and stay covered: a refused put that rewrote the
field (found again in the new core's list path), an unhashable dtype leaking TypeError, no
hand-off between stage streams, a reader registered after a step not ordered after its
copy, and (new core) a bad ``live`` that claimed a slot before it was refused and a
``rows`` of 4.0 or True taken from the layout's plan cache.
"""

from __future__ import annotations

import random
from collections.abc import Callable, Mapping
from typing import Any

import numpy as np
import pytest
import torch

from pinpool import (
    DeviceBlock,
    DeviceMismatchError,
    Field,
    Layout,
    PinnedRingBuffer,
    PoolSettings,
    PoolStateError,
    SettingsError,
    Stage,
    StagingValueError,
)
from pinpool.encode import NUMPY_DTYPE
from pinpool.landing import land
from pinpool.layout import FIELD_ALIGN, LANDING_TAG
from pinpool.testing import LaggingGpu, SimStream
from tests.fakes import NoFenceAfterReaders

FIELDS = (
    Field("step", torch.int64, pad=-1),
    Field("positions", torch.int32, pad=0),
    Field("temps", torch.float32, pad=1.0),
    Field("mask", torch.bool, pad=False),
    Field("small", torch.int16, pad=7),
    Field("raw", torch.uint8, pad=255),
)
MAX_ROWS = 16
SIZES = (1, 3, 8, 13, 16)  # the graph sizes: odd ones make the 16-byte padding between fields matter
SLOT_BYTES = 1024

Values = dict[str, np.ndarray[Any, Any]]


# -- helpers ------------------------------------------------------------------------------
def values_for(rng: random.Random, step: int, live: int) -> Values:
    """One step's live values per field: exact in their dtype, different every step."""
    return {
        "step": np.full(live, step, dtype=np.int64),
        "positions": np.array([rng.randint(-(2**31), 2**31 - 1) for _ in range(live)], dtype=np.int32),
        "temps": np.array([rng.randint(-4000, 4000) / 8 for _ in range(live)], dtype=np.float32),
        "mask": np.array([rng.random() < 0.5 for _ in range(live)], dtype=np.bool_),
        "small": np.array([rng.randint(-(2**15), 2**15 - 1) for _ in range(live)], dtype=np.int16),
        "raw": np.array([rng.randint(0, 255) for _ in range(live)], dtype=np.uint8),
    }


def padded(block: DeviceBlock, rows: int, values: Values) -> Values:
    """What ``block.views(rows)`` must hold after the step: the live values, then each field's pad."""
    out = {}
    for f in block.layout.fields:
        arr = np.full(rows, f.pad, dtype=NUMPY_DTYPE[f.dtype])
        live = values[f.name]
        arr[: len(live)] = live
        out[f.name] = arr
    return out


def write_values(st: Stage, values: Values, rng: random.Random, skip: str | None = None) -> None:
    """Write every field (but ``skip``) by a random route: list, numpy (exact or wider dtype), tensor, in place."""
    for name, arr in values.items():
        if name == skip:
            continue
        route = rng.randrange(5)
        if route == 0:
            st.put(name, arr.tolist())
        elif route == 1:
            st.put(name, arr)  # the engine's own array: the hot path
        elif route == 2:
            wide = np.float64 if arr.dtype.kind == "f" else (np.bool_ if arr.dtype.kind == "b" else np.int64)
            st.put(name, arr.astype(wide))
        elif route == 3:
            st.put(name, torch.from_numpy(arr.copy()))
        else:
            st.host(name)[:] = arr


def block_values(block: DeviceBlock, rows: int) -> dict[str, list[Any]]:
    return {name: view.tolist() for name, view in block.views(rows).items()}


def as_lists(values: Values) -> dict[str, list[Any]]:
    return {name: arr.tolist() for name, arr in values.items()}


def cpu_block(num_slots: int = 2, max_rows: int = MAX_ROWS) -> tuple[PinnedRingBuffer, DeviceBlock]:
    pool = PinnedRingBuffer(PoolSettings(device="cpu", num_slots=num_slots, slot_bytes=SLOT_BYTES))
    return pool, DeviceBlock(pool, Layout(FIELDS, max_rows))


def one_step(block: DeviceBlock, rows: int, live: int, seed: int) -> Values:
    """A complete step on ``block``; returns what its views must hold."""
    rng = random.Random(seed)
    values = values_for(rng, seed, live)
    with block.stage(rows, live) as st:
        write_values(st, values, rng)
    return padded(block, rows, values)


# -- layout -------------------------------------------------------------------------------
def test_offsets_are_aligned_and_fields_do_not_overlap() -> None:
    """Catches a field starting off a 16-byte boundary, or two fields of one layout sharing bytes."""
    _, block = cpu_block()
    itemsizes = [torch.empty((), dtype=f.dtype).element_size() for f in FIELDS]
    for rows in range(1, MAX_ROWS + 1):
        offsets = block.layout.offsets(rows)
        assert len(offsets) == len(FIELDS) and offsets[0] == 0
        assert all(off % FIELD_ALIGN == 0 for off in offsets), offsets
        ends = [off + rows * size for off, size in zip(offsets, itemsizes, strict=True)]
        assert all(end <= nxt for end, nxt in zip(ends, offsets[1:], strict=False)), (offsets, ends)
        gaps = [nxt - end for end, nxt in zip(ends, offsets[1:], strict=False)]
        assert all(gap < FIELD_ALIGN for gap in gaps), f"more padding than alignment needs: {gaps}"
        assert block.layout.nbytes(rows) == ends[-1]
        assert block.layout.nbytes(rows) <= block.device_block.numel()
    assert block.device_block.numel() == block.layout.nbytes(MAX_ROWS)
    assert block.device_block.dtype == torch.uint8 and block.device_block.dim() == 1


def test_views_are_the_same_tensors_every_call_and_live_in_one_allocation() -> None:
    """Catches views rebuilt per call (a graph would hold stale addresses) or a layout outside the block."""
    _, block = cpu_block()
    base = block.device_block.data_ptr()
    storage = block.device_block.untyped_storage().data_ptr()
    for rows in SIZES:
        first = block.views(rows)
        again = block.views(rows)
        assert list(first) == [f.name for f in FIELDS]
        for f, off in zip(FIELDS, block.layout.offsets(rows), strict=True):
            view = first[f.name]
            assert again[f.name] is view
            assert view.data_ptr() == again[f.name].data_ptr() == base + off
            assert view.dtype == f.dtype and tuple(view.shape) == (rows,)
            assert view.untyped_storage().data_ptr() == storage
            assert view.data_ptr() + view.nbytes <= base + block.device_block.numel()
    # Staging steps moves nothing: the same addresses after steps of every size.
    ptrs = {rows: [v.data_ptr() for v in block.views(rows).values()] for rows in SIZES}
    for i, rows in enumerate(SIZES * 2):
        one_step(block, rows, rows // 2, seed=i)
    assert {rows: [v.data_ptr() for v in block.views(rows).values()] for rows in SIZES} == ptrs


# -- one step on the plain CPU path -------------------------------------------------------
@pytest.mark.parametrize("rows", SIZES)
def test_a_step_lands_live_rows_and_padding_with_exactly_one_copy(rows: int) -> None:
    """Catches a step that lands the wrong bytes, skips the padding, or copies more than once or more than its size."""
    pool, block = cpu_block()
    for seed, live in enumerate(sorted({0, 1, rows // 2, rows - 1, rows})):
        before = pool.stats()
        want = one_step(block, rows, live, seed)
        after = pool.stats()
        assert block_values(block, rows) == as_lists(want)
        assert after.copies - before.copies == 1
        assert after.bytes_copied - before.bytes_copied == block.layout.nbytes(rows)
        assert after.stages - before.stages == 1  # a block stage: neither owned nor in place
        assert (after.owned_stages, after.zero_copy_stages) == (before.owned_stages, before.zero_copy_stages)
        assert after.aborted_stages == before.aborted_stages


def test_a_smaller_step_after_a_larger_one_leaves_no_stale_rows_in_its_own_layout() -> None:
    """Catches a step of a smaller graph whose padding is not rewritten (stale live rows of the last step)."""
    _, block = cpu_block()
    one_step(block, MAX_ROWS, MAX_ROWS, seed=1)
    want = one_step(block, 8, 2, seed=2)
    assert block_values(block, 8) == as_lists(want)
    want = one_step(block, 8, 8, seed=3)
    assert block_values(block, 8) == as_lists(want)
    want = one_step(block, 8, 0, seed=4)  # no live row: every row is padding
    assert block_values(block, 8) == {f.name: [f.pad] * 8 for f in FIELDS}
    assert block_values(block, 8) == as_lists(want)


def test_stage_exposes_its_stream_and_an_unregistered_cpu_block_has_no_readers() -> None:
    """Catches a CPU block that invents a stream, or ``readers`` that grows without registration."""
    _, block = cpu_block()
    with block.stage(4, 4) as st:
        assert st.stream is None and (st.rows, st.live) == (4, 4)
        write_values(st, values_for(random.Random(0), 0, 4), random.Random(0))
    assert block.readers == ()
    block.register_reader(None)  # the host path's only stream
    block.register_reader(None)
    assert block.readers == (None,)


# -- errors: typed, and nothing half-done ---------------------------------------------------
def _assert_untouched(pool: PinnedRingBuffer, block: DeviceBlock, rows: int, want: Values, copies: int) -> None:
    assert block_values(block, rows) == as_lists(want), "the block changed: a copy ran after the error"
    assert pool.stats().copies == copies
    # Not stuck half-open: the next step works and makes its one copy.
    after = one_step(block, rows, 1, seed=99)
    assert block_values(block, rows) == as_lists(after)
    assert pool.stats().copies == copies + 1


@pytest.mark.parametrize(
    ("rows", "live"),
    [(-1, 0), (MAX_ROWS + 1, 1), (True, 1), (4.0, 1), ("4", 1), (4, -1), (4, 5), (4, True), (4, 2.0), (4, "3")],
)
def test_bad_rows_or_live_raise_before_anything_is_claimed(rows: Any, live: Any) -> None:
    """Catches a stage opened (a slot claimed, the block marked open) for sizes it cannot hold."""
    pool, block = cpu_block()
    want = one_step(block, 4, 3, seed=0)
    claims, copies = pool.claims, pool.stats().copies
    with pytest.raises(StagingValueError, match=r"'rows'|'live'"):
        block.stage(rows, live)
    assert pool.claims == claims
    _assert_untouched(pool, block, 4, want, copies)


@pytest.mark.parametrize("rows", [-1, MAX_ROWS + 1, True, 4.0, 2.0])
def test_views_of_a_size_outside_the_block_are_refused(rows: Any) -> None:
    """Catches a view past the allocation (a graph reading another buffer's bytes), or a size that is no
    int let through (or not) by whichever sizes were viewed before (4.0 and True hash as 4 and 1)."""
    _, block = cpu_block()
    with pytest.raises(StagingValueError, match="'rows'"):
        block.views(rows)
    for size in range(1, MAX_ROWS + 1):
        block.views(size)
    with pytest.raises(StagingValueError, match="'rows'"):
        block.views(rows)


BadPut = Callable[[Stage], object]
BAD_PUTS: list[Any] = [
    pytest.param(lambda st: st.put("nope", [1, 2, 3]), "declared field", id="unknown-field-put"),
    pytest.param(lambda st: st.host("nope"), "declared field", id="unknown-field-host"),
    pytest.param(lambda st: st.put("positions", [1, 2]), "hold 3 values", id="too-few-values"),
    pytest.param(lambda st: st.put("positions", [1, 2, 3, 4]), "hold 3 values", id="too-many-values"),
    pytest.param(lambda st: st.put("positions", np.zeros(4, np.int32)), "hold 3 values", id="numpy-wrong-length"),
    pytest.param(lambda st: st.put("positions", np.zeros((3, 2), np.int32)), "hold 3 values", id="numpy-2d"),
    pytest.param(lambda st: st.put("positions", 5), "hold 3 values", id="scalar"),
    pytest.param(lambda st: st.put("positions", [1, 2**40, 3]), "int32", id="2**40-into-int32"),
    pytest.param(lambda st: st.put("positions", np.array([1, 2**40, 3])), "int32", id="2**40-array-into-int32"),
    pytest.param(lambda st: st.put("step", [1, 1.5, 2]), "whole numbers", id="1.5-into-int64"),
    pytest.param(lambda st: st.put("step", np.array([1.0, 1.5, 2.0])), "whole numbers", id="1.5-array-into-int64"),
    pytest.param(lambda st: st.put("raw", [1, -1, 2]), "uint8", id="-1-into-uint8"),
    pytest.param(lambda st: st.put("temps", [1.0, 1e39, 2.0]), "float32", id="1e39-into-float32"),
    pytest.param(lambda st: st.put("mask", [0, 2, 1]), "0/1", id="2-into-bool"),
]


@pytest.mark.parametrize(("bad", "match"), BAD_PUTS)
def test_a_bad_value_raises_typed_and_the_step_is_aborted_without_a_copy(bad: BadPut, match: str) -> None:
    """Catches an error that lets the step's copy run (the block half-updated) or leaves the stage open."""
    pool, block = cpu_block()
    want = one_step(block, 8, 5, seed=0)
    copies, aborted = pool.stats().copies, pool.stats().aborted_stages
    rng = random.Random(1)
    with pytest.raises(StagingValueError, match=match), block.stage(8, 3) as st:
        write_values(st, values_for(rng, 1, 3), rng)
        bad(st)
    assert pool.stats().aborted_stages == aborted + 1
    _assert_untouched(pool, block, 8, want, copies)


@pytest.mark.parametrize("missing", [f.name for f in FIELDS])
def test_a_field_not_written_aborts_the_step_with_no_copy(missing: str) -> None:
    """Catches a close that copies a field the step never wrote (an older step's rows in the slot)."""
    pool, block = cpu_block()
    want = one_step(block, 8, 5, seed=0)
    copies = pool.stats().copies
    rng = random.Random(2)
    with pytest.raises(PoolStateError, match=f"missing: \\['{missing}'\\]"), block.stage(8, 5) as st:
        write_values(st, values_for(rng, 2, 5), rng, skip=missing)
    _assert_untouched(pool, block, 8, want, copies)


def test_a_step_with_no_live_row_needs_no_put_and_lands_all_padding() -> None:
    """Catches a live=0 step (an empty graph-padded batch) refused for unwritten fields, or landing stale rows."""
    pool, block = cpu_block()
    one_step(block, 8, 8, seed=0)
    copies = pool.stats().copies
    with block.stage(8, 0) as st:
        assert st.host("temps").shape == (0,)
    assert block_values(block, 8) == {f.name: [f.pad] * 8 for f in FIELDS}
    assert pool.stats().copies == copies + 1


def test_an_exception_in_the_body_aborts_the_step_and_propagates() -> None:
    """Catches a ``with`` body error that still copies the half-written step."""
    pool, block = cpu_block()
    want = one_step(block, 8, 5, seed=0)
    copies = pool.stats().copies
    rng = random.Random(3)
    with pytest.raises(KeyError, match="scheduler bug"), block.stage(8, 8) as st:
        write_values(st, values_for(rng, 3, 8), rng)  # every field written: only the error stops the copy
        raise KeyError("scheduler bug")
    _assert_untouched(pool, block, 8, want, copies)


def test_close_ok_false_aborts_and_a_second_close_is_a_no_op() -> None:
    """Catches an explicit abort that copies, or a double close that copies or raises."""
    pool, block = cpu_block()
    want = one_step(block, 8, 5, seed=0)
    copies = pool.stats().copies
    rng = random.Random(4)
    st = block.stage(8, 8)
    write_values(st, values_for(rng, 4, 8), rng)
    st.close(ok=False)
    st.close()
    _assert_untouched(pool, block, 8, want, copies)


def test_a_second_stage_while_one_is_open_is_refused_and_the_first_still_lands() -> None:
    """Catches nested stages (two copies racing into one block) or a refusal that breaks the open stage."""
    pool, block = cpu_block()
    rng = random.Random(5)
    values = values_for(rng, 5, 6)
    st = block.stage(8, 6)
    claims, copies = pool.claims, pool.stats().copies
    with pytest.raises(PoolStateError, match="inside open stage"):
        block.stage(8, 6)
    with pytest.raises(PoolStateError, match="inside open stage"):
        pool.stage()  # a plain ring stage cannot open under it either
    assert pool.claims == claims
    write_values(st, values, rng)
    st.close()
    assert pool.stats().copies == copies + 1
    assert block_values(block, 8) == as_lists(padded(block, 8, values))


def test_a_block_stage_under_an_open_ring_stage_is_refused_and_leaves_the_block_usable() -> None:
    """Catches a refused block stage that still marks the block open (every later step refused)."""
    pool, block = cpu_block()
    with pool.stage() as ring_stage:
        ring_stage.put([1, 2], torch.int32)
        with pytest.raises(PoolStateError):
            block.stage(4, 2)
    want = one_step(block, 4, 2, seed=6)
    assert block_values(block, 4) == as_lists(want)


@pytest.mark.parametrize("dtype", [torch.bfloat16, torch.complex64, "int32", np.int32, None, 4])
def test_a_field_of_a_dtype_without_a_numpy_twin_is_refused(dtype: Any) -> None:
    """Catches a field whose host view cannot be written (bfloat16, complex) or a dtype given by name."""
    with pytest.raises(SettingsError, match="'dtype'"):
        Field("x", dtype)


@pytest.mark.parametrize("name", ["", "a b", "1x", "x-y", 3, None, b"x"])
def test_a_field_name_must_be_an_identifier(name: Any) -> None:
    """Catches names that cannot be looked up reliably (empty, spaced, non-strings)."""
    with pytest.raises(SettingsError, match="'name'"):
        Field(name, torch.int32)


@pytest.mark.parametrize(
    ("dtype", "pad"),
    [
        (torch.int8, 200),
        (torch.uint8, -1),
        (torch.int32, 2**40),
        (torch.int32, 1.5),
        (torch.int64, float("nan")),
        (torch.float32, 1e39),
        (torch.bool, 2),
        (torch.int32, "x"),
        (torch.int32, None),
    ],
)
def test_a_pad_the_dtype_cannot_hold_is_refused_at_construction(dtype: torch.dtype, pad: Any) -> None:
    """Catches a pad that would be written wrapped or truncated on every step's close."""
    with pytest.raises(SettingsError, match="'pad'"):
        Layout([Field("ok", torch.int64), Field("x", dtype, pad=pad)], 4)


def test_max_rows_that_does_not_fit_a_slot_is_refused() -> None:
    """Catches a block whose largest step would overflow its ring slot (a CapacityError every step)."""
    pool = PinnedRingBuffer(PoolSettings(device="cpu", num_slots=2, slot_bytes=SLOT_BYTES))
    wide = Layout(FIELDS, 200)
    fits = max(r for r in range(1, 200) if wide.nbytes(r) <= SLOT_BYTES)
    assert wide.nbytes(fits + 1) > SLOT_BYTES
    DeviceBlock(pool, Layout(FIELDS, fits))
    with pytest.raises(SettingsError, match=r"'layout' of \d+ rows.*slot_bytes or lower max_rows"):
        DeviceBlock(pool, Layout(FIELDS, fits + 1))


@pytest.mark.parametrize(
    ("fields", "max_rows", "match"),
    [
        (FIELDS, 0, "'max_rows'"),
        (FIELDS, True, "'max_rows'"),
        (FIELDS, 2.0, "'max_rows'"),
        ((), 4, "'fields'"),
        ((FIELDS[0], "temps"), 4, "'fields'"),
        ((FIELDS[0], Field("step", torch.int32)), 4, "unique"),
    ],
)
def test_bad_layout_settings_are_refused(fields: Any, max_rows: Any, match: str) -> None:
    """Catches a layout (so a block) built from settings it cannot serve."""
    with pytest.raises(SettingsError, match=match):
        Layout(fields, max_rows)


@pytest.mark.parametrize("layout", [FIELDS, list(FIELDS), None, "layout"])
def test_a_block_of_anything_but_a_layout_is_refused(layout: Any) -> None:
    """Catches a block built from bare fields (the old ``StaticInputs(pool, fields, max_rows)`` call) or junk."""
    pool = PinnedRingBuffer(PoolSettings(device="cpu", num_slots=2, slot_bytes=SLOT_BYTES))
    with pytest.raises(SettingsError, match=r"'layout' must be a pinpool\.Layout"):
        DeviceBlock(pool, layout)


def test_a_stream_on_the_cpu_path_is_refused() -> None:
    """Catches a stream handed to a synchronous CPU pool being ignored silently."""
    pool, block = cpu_block()
    with pytest.raises(DeviceMismatchError):
        block.stage(4, 2, stream=object())
    with pytest.raises(DeviceMismatchError):
        block.register_reader(object())
    assert pool.claims == 0 and block.readers == ()


# Defects these tests found (fixed): each stays covered here.
def test_a_refused_put_leaves_the_fields_earlier_values() -> None:
    """Catches a put that raises yet rewrote the field: "exactly or not at all" broken for Stage."""
    _, block = cpu_block()
    with block.stage(4, 3) as st:
        rng = random.Random(7)
        write_values(st, values_for(rng, 7, 3), rng, skip="step")
        st.put("step", [1, 2, 3])
        with pytest.raises(StagingValueError):
            st.put("step", [5, 1.5, 7])  # the caller handles the error and keeps the step's earlier value
    assert block_values(block, 4)["step"] == [1, 2, 3, -1]


def test_an_unhashable_dtype_is_refused_as_a_settings_error() -> None:
    """Catches the dtype check leaking Python's TypeError from the dict lookup."""
    with pytest.raises(SettingsError, match="'dtype'"):
        Field("x", [torch.int32])  # type: ignore[arg-type]


# -- the stream rules against the simulator ---------------------------------------------
class Abort(Exception):
    pass


class UnregisteredReaders(DeviceBlock):
    """Planted bug: ``register_reader`` does nothing, so replays on other streams are not ordered at all."""

    def register_reader(self, stream: Any) -> None:
        return None


class _DropWaits:
    """A transport that drops the ``stream_wait`` calls ``drop(fence)`` picks; everything else passes through."""

    def __init__(self, inner: Any, drop: Callable[[Any], bool]) -> None:
        self._inner, self._drop = inner, drop

    def stream_wait(self, waiter: Any, fence: Any) -> None:
        if not self._drop(fence):
            self._inner.stream_wait(waiter, fence)

    def __getattr__(self, name: str) -> Any:
        return getattr(self._inner, name)


class NoWaitBeforeCopy(DeviceBlock):
    """Planted bug: the copy does not wait for the readers' queued replays (the next step overwrites a pending read)."""

    def __init__(self, *args: Any, **kwargs: Any) -> None:
        super().__init__(*args, **kwargs)
        self._transport = _DropWaits(self._transport, lambda fence: any(fence is f for _, f in self._readers))


class NoWaitAfterCopy(DeviceBlock):
    """Planted bug: the readers do not wait for the copy (a replay reads before the step has landed)."""

    def __init__(self, *args: Any, **kwargs: Any) -> None:
        super().__init__(*args, **kwargs)
        self._transport = _DropWaits(self._transport, lambda fence: fence is self._landed)


def run_plan(seed: int, block_type: type[DeviceBlock] = DeviceBlock, steps: int = 30) -> tuple[LaggingGpu, bool]:
    """One random plan of staged steps and replays: the simulator (it records every wrong read) and
    whether the block ends on the last landed step's values."""
    rng = random.Random(seed)
    gpu = LaggingGpu(max_lag=rng.randint(0, 40), seed=seed, devices=2)
    streams: list[SimStream] = [gpu.current_stream(0)]
    streams += [gpu.new_stream(f"s{i}") for i in range(1, rng.randint(2, 3) + 1)]
    other_device = [gpu.current_stream(1), gpu.new_stream("dev1:side", device_index=1)]
    pool = PinnedRingBuffer(
        PoolSettings(device="cpu", num_slots=rng.randint(2, 5), slot_bytes=SLOT_BYTES), transport=gpu
    )
    gpu.set_current(rng.choice(streams))  # the block's allocation stream: any of them
    block = block_type(pool, Layout(FIELDS, MAX_ROWS))
    # One or two replay streams, registered before the first step (late registration has its own test below).
    readers = rng.sample(streams, rng.randint(1, 2))
    for reader in readers:
        if rng.random() < 0.5:
            block.register_reader(reader)
        else:
            gpu.set_current(reader)
            block.register_reader(None)  # the pool device's current stream, now
    last: tuple[int, Values, int] | None = None  # (rows, what its views hold, step) of the last landed step
    for step in range(steps):
        gpu.current_device = rng.choice([0, 1])  # the block must follow the pool's device, never this
        gpu.set_current(rng.choice(streams))
        gpu.set_current(rng.choice(other_device))
        if rng.random() < 0.15:
            gpu.frozen = not gpu.frozen  # bursts where the device runs only when the host waits
        if rng.random() < 0.1:  # a plain ring stage in between moves slots and their streams
            with pool.stage(stream=rng.choice([*streams, None])) as ring_stage:
                ring_stage.put([step] * rng.randint(1, 8), torch.int64)
        rows = rng.choice(SIZES)
        live = rng.randint(0, rows)
        values = values_for(rng, step, live)
        kind = rng.choice(["ok"] * 8 + ["abort", "missing"])
        try:
            with block.stage(rows, live, stream=rng.choice([*streams, None])) as st:
                write_values(st, values, rng, skip=rng.choice(list(values)) if kind == "missing" else None)
                gpu.set_current(rng.choice(streams))  # the current stream at close need not be the stage's
                if kind == "abort":
                    raise Abort
        except (Abort, PoolStateError):
            assert kind != "ok"
        else:
            assert kind == "ok" or (kind == "missing" and live == 0), kind  # no live row: all padding, no put needed
            last = (rows, padded(block, rows, values), step)
        if last is None:
            continue
        for reader in rng.sample(readers, rng.randint(0, len(readers))):  # the graph replays, reading the block
            rows_read, want, landed = last
            for name, view in block.views(rows_read).items():
                gpu.enqueue_check(
                    view, want[name], f"seed {seed} step {step} ({landed}) {name} on {reader.name}", reader
                )
    gpu.frozen = False
    gpu.drain()
    ends_right = last is None or block_values(block, last[0]) == as_lists(last[1])
    return gpu, ends_right


PLAN_SEEDS = range(80)


def test_any_mix_of_stage_streams_and_registered_replay_streams_reads_every_steps_own_values() -> None:
    """Catches a replay on a registered stream that reads before its step landed or after the next overwrote it."""
    for seed in PLAN_SEEDS:
        gpu, ends_right = run_plan(seed)
        assert ends_right, f"seed {seed}: the block ends on another step's values"
        assert gpu.mismatches == [], gpu.mismatches[:3]
        assert gpu.races == [], gpu.races[:3]
        assert gpu.errors == [], gpu.errors[:3]  # nothing queued on the other device's streams


def _caught(block_type: type[DeviceBlock]) -> int:
    return sum(bool(run_plan(seed, block_type)[0].mismatches) for seed in PLAN_SEEDS)


@pytest.mark.parametrize(
    ("planted", "least"),
    [
        pytest.param(UnregisteredReaders, 0.8, id="register_reader-a-no-op"),
        pytest.param(NoWaitBeforeCopy, 0.6, id="copy-does-not-wait-for-replays"),
        pytest.param(NoWaitAfterCopy, 0.8, id="replays-do-not-wait-for-the-copy"),
    ],
)
def test_control_the_same_plans_without_the_reader_guard_read_wrong_steps(
    planted: type[DeviceBlock], least: float
) -> None:
    """Catches a property test too weak to see the guard: with each half of it planted away, it must fail."""
    caught = _caught(planted)
    print(f"{planted.__name__}: caught in {caught} of {len(PLAN_SEEDS)} seeds")
    assert caught >= least * len(PLAN_SEEDS), f"{planted.__name__} caught in only {caught} of {len(PLAN_SEEDS)} seeds"


def _sim_block(
    max_lag: int = 0, seed: int = 0, num_slots: int = 2, block_type: type[DeviceBlock] = DeviceBlock
) -> tuple[LaggingGpu, PinnedRingBuffer, DeviceBlock]:
    gpu = LaggingGpu(max_lag=max_lag, seed=seed, devices=2)
    pool = PinnedRingBuffer(PoolSettings(device="cpu", num_slots=num_slots, slot_bytes=SLOT_BYTES), transport=gpu)
    return gpu, pool, block_type(pool, Layout(FIELDS, MAX_ROWS))


def _sim_step(block: DeviceBlock, rows: int, live: int, seed: int, stream: SimStream | None) -> Values:
    rng = random.Random(seed)
    values = values_for(rng, seed, live)
    with block.stage(rows, live, stream=stream) as st:
        write_values(st, values, rng)
    return padded(block, rows, values)


def test_a_registered_reader_costs_two_device_waits_and_no_host_wait() -> None:
    """Catches a guard in the wrong order (wait after the copy, record before the replay) or a host wait."""
    gpu, _, block = _sim_block()
    stage, reader = gpu.new_stream("stage"), gpu.new_stream("replay")
    block.register_reader(reader)
    for seed in range(3):  # the first copy's allocation-stream wait and the slots' hand-offs are behind us
        _sim_step(block, 8, 5, seed, stage)
    gpu.calls.clear()
    _sim_step(block, 8, 5, 3, stage)
    assert gpu.calls == [
        ("cudaEventRecord", "replay"),  # after the previous replay...
        ("cudaStreamWaitEvent", "stage"),  # ...the copy waits for it
        ("cudaMemcpyAsync", "stage"),  # the one copy
        ("cudaEventRecord", "stage"),  # landed...
        ("cudaStreamWaitEvent", "replay"),  # ...the next replay waits for it
        ("cudaEventRecord", "stage"),  # the slot's fence, at close
    ]
    gpu.calls.clear()
    _sim_step(block, 8, 5, 4, reader)  # staging on the reader's own stream: stream order is enough
    assert gpu.calls == [
        ("cudaEventRecord", "stage"),  # the ring's own hand-off of the slot from ``stage``
        ("cudaStreamWaitEvent", "replay"),
        ("cudaEventRecord", "stage"),  # the block's hand-off: its last copy was on ``stage``
        ("cudaStreamWaitEvent", "replay"),
        ("cudaMemcpyAsync", "replay"),
        ("cudaEventRecord", "replay"),
    ]
    assert gpu.host_waits == 0
    assert block.readers == (reader,)
    block.register_reader(reader)  # again: no second guard
    assert block.readers == (reader,)


def test_a_stream_of_another_device_is_refused_before_anything_is_claimed() -> None:
    """Catches a stage or a reader on another device's stream (CUDA's invalid resource handle, or a wrong device)."""
    gpu, pool, block = _sim_block()
    want = _sim_step(block, 4, 2, 0, None)
    dev1 = gpu.new_stream("dev1", device_index=1)
    claims, calls, copies = pool.claims, len(gpu.calls), pool.stats().copies
    with pytest.raises(DeviceMismatchError, match="pool's device 0"):
        block.stage(4, 2, stream=dev1)
    with pytest.raises(DeviceMismatchError, match="pool's device 0"):
        block.register_reader(dev1)
    assert pool.claims == claims and len(gpu.calls) == calls and pool.stats().copies == copies
    assert block.readers == ()
    gpu.drain()
    assert block_values(block, 4) == as_lists(want)
    _sim_step(block, 4, 2, 1, None)  # not left open
    assert gpu.errors == []


def test_register_reader_none_takes_the_pool_devices_current_stream_whatever_device_is_current() -> None:
    """Catches rule 8 broken for readers: "current" taken from the current device instead of the pool's."""
    gpu, _, block = _sim_block()
    replay = gpu.new_stream("replay")
    gpu.set_current(replay)
    gpu.set_current(gpu.new_stream("dev1", device_index=1))
    gpu.current_device = 1
    block.register_reader(None)
    assert block.readers == (replay,)
    with block.stage(4, 4) as st:  # None: device 0's current stream, i.e. the reader
        assert st.stream is replay
        write_values(st, values_for(random.Random(0), 0, 4), random.Random(0))
    assert gpu.errors == []


class ForgetsTheAllocationStream(DeviceBlock):
    """Planted bug: the first copy does not wait for the stream the block was allocated on."""

    def __init__(self, *args: Any, **kwargs: Any) -> None:
        super().__init__(*args, **kwargs)
        self._transport = _DropWaits(self._transport, lambda fence: fence is self._writer_fence)


def _allocation_plan(seed: int, block_type: type[DeviceBlock]) -> tuple[LaggingGpu, DeviceBlock, Values]:
    rng = random.Random(seed)
    gpu = LaggingGpu(max_lag=rng.randint(0, 10), seed=seed, devices=2)
    a, b = gpu.new_stream("A"), gpu.new_stream("B")
    pool = PinnedRingBuffer(PoolSettings(device="cpu", num_slots=2, slot_bytes=SLOT_BYTES), transport=gpu)
    for _ in range(2):  # every slot's last user is B: the ring's own hand-off cannot cover the block
        with pool.stage(stream=b) as ring_stage:
            ring_stage.put([0], torch.int32)
    gpu.drain()
    gpu.set_current(a)
    gpu.frozen = True  # A's queued work stays queued
    block = block_type(pool, Layout(FIELDS, MAX_ROWS))  # allocated while A is current
    # The memory's previous owner: work queued on A that still writes these bytes.
    gpu.enqueue_write(block.device_block, torch.full_like(block.device_block, 0x5A), a)
    rows = rng.choice(SIZES)
    want = _sim_step(block, rows, rng.randint(0, rows), seed, b)
    for name, view in block.views(rows).items():
        gpu.enqueue_check(view, want[name], f"seed {seed} {name} read on B", b)
    gpu.frozen = False
    gpu.drain()
    return gpu, block, want


def test_the_first_copy_on_another_stream_waits_for_the_allocation_streams_queued_work() -> None:
    """Catches a first copy that lands before work queued on the block's allocation stream (then overwritten)."""
    for seed in range(40):
        gpu, block, want = _allocation_plan(seed, DeviceBlock)
        assert gpu.mismatches == [], gpu.mismatches[:3]
        assert block_values(block, len(want["step"])) == as_lists(want)


def test_control_without_the_allocation_stream_wait_the_first_step_is_overwritten() -> None:
    """Catches an allocation-stream test that cannot see the wait it checks."""
    caught = 0
    for seed in range(40):
        gpu, block, want = _allocation_plan(seed, ForgetsTheAllocationStream)
        caught += bool(gpu.mismatches) or block_values(block, len(want["step"])) != as_lists(want)
    print(f"without the allocation-stream wait: caught in {caught} of 40 seeds")
    assert caught >= 10


def test_a_stage_on_a_new_stream_waits_for_the_previous_stages_stream() -> None:
    """Catches a stale copy landing after a newer one when the stage's stream changes and no reader is registered.

    Reads happen only on each step's own stage stream, right after its stage: the usage
    the module allows without registration ("work that reads the block on that stream is
    ordered by the stream").
    """
    wrong = []
    for seed in range(40):
        rng = random.Random(seed)
        gpu, _, block = _sim_block(max_lag=rng.randint(0, 30), seed=seed, num_slots=4)
        streams = [gpu.current_stream(0), gpu.new_stream("s1"), gpu.new_stream("s2")]
        want: Values = {}
        rows = 8
        for step in range(12):
            stream = rng.choice(streams)
            want = _sim_step(block, rows, rng.randint(0, rows), seed * 100 + step, stream)
            for name, view in block.views(rows).items():
                gpu.enqueue_check(view, want[name], f"seed {seed} step {step} {name}", stream)
        gpu.drain()
        if gpu.mismatches or block_values(block, rows) != as_lists(want):
            wrong.append(seed)
    assert wrong == [], f"{len(wrong)} of 40 seeds read or ended on a stale step"


def test_a_reader_registered_after_a_step_waits_for_that_steps_copy() -> None:
    """Catches a reader registered between steps (e.g. at graph capture) that replays before the last copy lands."""
    wrong = 0
    for seed in range(40):
        gpu, _, block = _sim_block(max_lag=random.Random(seed).randint(0, 10), seed=seed)
        stage, replay = gpu.new_stream("stage"), gpu.new_stream("replay")
        _sim_step(block, 8, 8, seed, stage)
        gpu.drain()
        gpu.frozen = True
        want = _sim_step(block, 8, 3, seed + 1000, stage)  # queued on ``stage``, not run yet
        block.register_reader(replay)
        for name, view in block.views(8).items():
            gpu.enqueue_check(view, want[name], f"seed {seed} {name} on replay", replay)
        gpu.frozen = False
        gpu.drain()
        wrong += bool(gpu.mismatches)
    assert wrong == 0, f"{wrong} of 40 seeds read the block before the last step landed"


def test_readers_are_a_tuple_in_registration_order_without_duplicates() -> None:
    """Catches ``readers`` exposing the internal list (a caller could unregister a stream by mutating it)."""
    gpu, _, block = _sim_block()
    r1, r2 = gpu.new_stream("r1"), gpu.new_stream("r2")
    block.register_reader(r1)
    block.register_reader(r2)
    block.register_reader(r1)
    readers = block.readers
    assert readers == (r1, r2) and isinstance(readers, tuple)
    assert isinstance(block.views(4), Mapping)


# -- host images, and a flushed stage reading back into its own slot ---------------------
def test_a_host_image_lands_every_field_and_its_padding_in_one_memcpy() -> None:
    """Catches an image whose padding or live rows differ from what puts would have landed."""
    pool, block = cpu_block()
    rng = random.Random(3)
    for rows, live in [(8, 3), (8, 8), (4, 0), (MAX_ROWS, 1)]:
        values = values_for(rng, rows * 10 + live, live)
        image = block.layout.host_image(rows, live)
        for name, arr in values.items():
            image.views[name][:] = arr
        copies = pool.stats().copies
        with block.stage(rows, live) as st:
            st.put_image(image)
        assert pool.stats().copies == copies + 1
        assert block_values(block, rows) == as_lists(padded(block, rows, values))


def test_an_image_of_another_shape_or_block_is_refused_and_nothing_lands() -> None:
    """Catches put_image copying an image laid out for another (rows, live) or block."""
    pool, block = cpu_block()
    other = DeviceBlock(pool, Layout(FIELDS, MAX_ROWS))
    before = one_step(block, 8, 5, seed=1)
    for image in (block.layout.host_image(8, 4), block.layout.host_image(4, 4), other.layout.host_image(8, 5)):
        copies = pool.stats().copies
        with pytest.raises(StagingValueError, match="'image'"), block.stage(8, 5) as st:
            st.put_image(image)
        assert pool.stats().copies == copies
        assert block_values(block, 8) == as_lists(before)


def test_a_flushed_stage_reads_back_into_its_own_slot_under_one_claim() -> None:
    """Catches a read-back that claims a second slot, lands before the copy, or lets a write follow flush."""
    pool, block = cpu_block(num_slots=3)
    src = torch.arange(5, dtype=torch.int64) * 7
    claims, stats = pool.claims, pool.stats()
    st = block.stage(8, 5)
    values = values_for(random.Random(2), 2, 5)
    for name, arr in values.items():
        st.put(name, arr)
    st.flush()
    with pytest.raises(PoolStateError, match="flushed"):
        st.put("step", values["step"])
    handle = st.readback(src)
    st.close()
    after = pool.stats()
    assert pool.claims == claims + 1
    assert after.copies == stats.copies + 1 and after.readbacks == stats.readbacks + 1
    assert handle.tolist() == src.tolist()
    assert block_values(block, 8) == as_lists(padded(block, 8, values))


def test_a_flushed_stage_on_the_simulator_reads_back_what_its_replay_wrote() -> None:
    """Catches a read-back queued before the replay's output, or a copy that lands after the replay read it."""
    for seed in range(30):
        gpu, _, block = _sim_block(max_lag=random.Random(seed).randint(0, 12), seed=seed, num_slots=3)
        stream = gpu.new_stream("forward")
        out = torch.zeros(8, dtype=torch.int64)  # "device" memory the replay writes
        handles = []
        for step in range(10):
            rng = random.Random(seed * 100 + step)
            values = values_for(rng, step, 8)
            st = block.stage(8, 8, stream=stream)
            write_values(st, values, rng)
            st.flush()
            for name, view in block.views(8).items():  # the replay reads its own step...
                gpu.enqueue_check(view, padded(block, 8, values)[name], f"seed {seed} step {step} {name}", stream)
            gpu.enqueue_write(out, torch.full((8,), step * 3 + 1, dtype=torch.int64), stream)  # ...and writes
            handles.append((step, st.readback(out)))
            st.close()
            if len(handles) == 2:  # read each within the ring's lifetime
                done, handle = handles.pop(0)
                assert handle.tolist() == [done * 3 + 1] * 8, f"seed {seed} step {done}"
        gpu.drain()
        assert not gpu.mismatches and not gpu.races and not gpu.errors, (seed, gpu.mismatches[:2])


# -- landing fields: the replay stores its output straight into the step's slot -----------
def _landing_pool(gpu: LaggingGpu, num_slots: int = 2) -> PinnedRingBuffer:
    settings = PoolSettings(device="cpu", num_slots=num_slots, slot_bytes=SLOT_BYTES, zero_copy=True)
    return PinnedRingBuffer(settings, transport=gpu)


def _landing_layout(dtype: torch.dtype = torch.int64) -> Layout:
    return Layout([Field("step", torch.int64, pad=-1), Field.landing("token_dst", dtype)], 8)


def _stores(tokens: torch.Tensor, addresses: torch.Tensor) -> Callable[[], None]:
    """A "kernel" that stores ``tokens`` through the landing addresses in ``addresses`` when it runs."""
    return lambda: land(tokens, addresses)


@pytest.mark.parametrize("dtype", [torch.int64, torch.int32, torch.float32])
def test_a_landing_field_holds_this_steps_live_row_addresses_and_zero_on_padding(dtype: torch.dtype) -> None:
    """Catches a landing field not written when the stage opens (the replay would store through an older
    step's addresses), a padding row with an address (a store into bytes nobody reads), an address outside
    the stage's slot or without its dtype's tag, a landing field the caller may overwrite, or a handle
    that reads other bytes than the writer stored into."""
    gpu = LaggingGpu(max_lag=0, seed=0)  # no lag: each call runs as it is queued
    pool = _landing_pool(gpu)
    block = DeviceBlock(pool, _landing_layout(dtype))
    slab_lo = pool.host_slab.data_ptr()
    slab_hi = slab_lo + pool.host_slab.numel()
    for step, (rows, live) in enumerate([(8, 5), (4, 4), (8, 0), (8, 8), (4, 1), (8, 3)]):
        st = block.stage(rows, live)
        st.put("step", [step] * live)
        with pytest.raises(PoolStateError, match="landing"):
            st.put("token_dst", [0] * live)
        with pytest.raises(PoolStateError, match="landing"):
            st.host("token_dst")
        st.flush()
        addresses = block.views(rows)["token_dst"]
        assert {k: v.data_ptr() for k, v in st.views.items()} == {k: v.data_ptr() for k, v in block.views(rows).items()}
        held = addresses.tolist()
        assert held[live:] == [0] * (rows - live), f"step {step}: a padding row holds an address"
        assert all(a & 3 == LANDING_TAG[dtype] and slab_lo <= a - (a & 3) < slab_hi for a in held[:live]), held
        assert len(set(held[:live])) == live
        tokens = torch.arange(rows, dtype=torch.int64) + 100 * step
        gpu.submit(st.stream, _stores(tokens, addresses), "kernel")  # the replay's last kernel
        st.close()
        assert st.landing("token_dst").tolist() == tokens[:live].tolist(), f"step {step}"
        assert block.views(rows)["step"].tolist() == [step] * live + [-1] * (rows - live)
    assert gpu.mismatches == [] and gpu.races == [] and gpu.errors == []


def _landing_plan(seed: int, block_type: type[DeviceBlock]) -> list[tuple[int, list[Any]]]:
    """Steps whose replay, on a lagging registered reader, stores the tokens: (step, what the handle read) for
    each step whose handle read other values than its replay stored."""
    rng = random.Random(seed)
    gpu = LaggingGpu(max_lag=rng.randint(0, 10), seed=seed)
    pool = _landing_pool(gpu, num_slots=rng.randint(2, 4))
    block = block_type(pool, _landing_layout())
    stage, replay = gpu.new_stream("stage"), gpu.new_stream("replay")
    block.register_reader(replay)
    wrong = []
    for step in range(12):
        gpu.frozen = rng.random() < 0.5  # bursts where the device runs only when the host waits
        rows, live = 8, rng.randint(1, 8)
        st = block.stage(rows, live, stream=stage)
        st.put("step", [step] * live)
        st.flush()
        for _ in range(rng.randint(0, 40)):  # the forward pass before the replay's last kernel
            gpu.submit(replay, lambda: None, "kernel")
        tokens = torch.arange(rows, dtype=torch.int64) + 1000 * (step + 1)
        gpu.submit(replay, _stores(tokens, block.views(rows)["token_dst"]), "kernel")
        st.close()
        got = st.landing("token_dst").tolist()  # read at once: waits for the slot's fence
        if got != tokens[:live].tolist():
            wrong.append((step, got[:3]))
    gpu.frozen = False
    gpu.drain()
    assert gpu.errors == [] and gpu.races == []
    return wrong


def test_a_landing_stages_fence_follows_the_blocks_registered_readers() -> None:
    """Catches a landing whose slot fence is recorded on the stage's stream only: the handle would read
    (and the ring hand the slot on) before the replay on a registered reader stored the tokens."""
    for seed in range(30):
        assert _landing_plan(seed, DeviceBlock) == [], f"seed {seed}"


def test_control_a_landing_fence_that_ignores_the_readers_reads_before_the_replay() -> None:
    """Catches a landing test too weak to see the fence's wait for the readers: with it planted away, the
    handles must read values the replay had not stored yet."""
    caught = sum(bool(_landing_plan(seed, NoFenceAfterReaders)) for seed in range(30))
    print(f"landing fence without the readers: caught in {caught} of 30 seeds")
    assert caught >= 20, f"caught in only {caught} of 30 seeds"


def test_a_block_stages_views_are_the_blocks_own_tensors() -> None:
    """Catches a block stage handing out views at the block's addresses but as other tensor objects than
    ``block.views(rows)`` (the ones a graph captured), which a caller comparing them would trip over."""
    pool = PinnedRingBuffer(PoolSettings(device="cpu", num_slots=3, slot_bytes=1 << 12))
    block = DeviceBlock(pool, Layout([Field("rows", torch.int64), Field("pos", torch.int32, pad=-1)], 8))
    for _ in range(4):  # every slot, and a slot seen twice
        with block.stage(4, 2) as st:
            st.put("rows", [1, 2])
            st.put("pos", [3, 4])
            assert all(st.views[name] is view for name, view in block.views(4).items())
    assert block.views(4)["pos"].tolist() == [3, 4, -1, -1]
