"""``Layout``: a step's fields declared once, staged with ``pool.stage(layout, rows=...)`` in one copy.

Five parts:
- the layout itself: where ``plan(rows)`` puts each field (offsets aligned to
  ``FIELD_ALIGN``, ``nbytes`` ending at the last field), worked out from the declaration
  alone; bad fields, pads, names and row counts are typed errors;
- values on the CPU path, step after step, layouts and row counts changing: views (live
  rows and padding), landing fields, numpy fields, ``host`` fills, read-backs;
- refusals (a value struct refuses, a wrong count, an unknown or landing field, a missing
  input field) are typed errors that copy nothing and leave the pool usable;
- the stream rules against the stream-aware simulator (``LaggingGpu``): a random plan of
  stage streams, consumer streams, current stream and device changes, lag and frozen
  bursts must read every step's own values and landings. The control removes the
  hand-off (a slot changing stream no longer waits for its previous stream) and must be
  caught;
- a layout stage on an unchanged stream costs one copy and one event record, nothing more.

Ported from ``tests/unit/test_exchange.py`` (``pool.exchange`` is gone: a step declares its
``Layout`` once and stages it with ``pool.stage(layout, rows=...)``). The exchange's
memoised per-slot plans are gone by design (a layout's plan is a function of the
declaration and the row count), so the tests that told replayed laps from general ones
(``plans(pool)``, the ``general`` / ``replay`` parametrisations, a plan keyed by a nested
list's shape, numpy fields never planned) have no subject left and were deleted.
"""

from __future__ import annotations

import functools
import random
from collections import deque
from collections.abc import Callable
from typing import Any

import numpy as np
import pytest
import torch

from pinpool import (
    CapacityError,
    Field,
    Layout,
    PinnedRingBuffer,
    PoolSettings,
    PoolStateError,
    SettingsError,
    StagingTypeError,
    StagingValueError,
)
from pinpool.landing import land_reference
from pinpool.layout import FIELD_ALIGN
from pinpool.readback import Landing
from pinpool.stage import Placement, State
from pinpool.testing import LaggingGpu, SimFence, SimStream
from pinpool.transport import Stream

SLOT_BYTES = 1024
NUM_SLOTS = 3
MAX_ROWS = 8
#: The decode step of the exchange tests: two inputs and the sampled tokens' landing.
STEP = Layout(
    [Field("rows", torch.int64), Field("pos", torch.int32, pad=-1), Field.landing("tokens", torch.int64)], MAX_ROWS
)
#: Another layout sharing the slots: a step's views must be its own layout's.
OTHER = Layout([Field("temp", torch.float32, pad=1.0), Field("ids", torch.int16, pad=7)], MAX_ROWS)


def cpu_pool(num_slots: int = NUM_SLOTS, **kw: Any) -> PinnedRingBuffer:
    return PinnedRingBuffer(
        PoolSettings(device="cpu", num_slots=num_slots, slot_bytes=SLOT_BYTES, zero_copy=True, **kw)
    )


def padded(values: list[Any], rows: int, pad: Any) -> list[Any]:
    return values + [pad] * (rows - len(values))


# -- the layout itself ---------------------------------------------------------------------------
ALL_DTYPES = [torch.bool, torch.uint8, torch.int8, torch.int16, torch.int32, torch.int64, torch.float16, torch.float32]


@pytest.mark.parametrize("seed", range(20))
def test_a_plan_puts_every_field_field_major_aligned_and_nbytes_ends_at_the_last_field(seed: int) -> None:
    """Catches fields that overlap, a field not aligned to FIELD_ALIGN (a misaligned device view), an
    nbytes that copies less than the last field or more than the layout, or a plan that depends on
    what an earlier call asked (the order of row counts) instead of the declaration alone."""
    rng = random.Random(seed)
    dtypes = [rng.choice(ALL_DTYPES) for _ in range(rng.randint(1, 6))]
    fields = [Field(f"f{i}", d) for i, d in enumerate(dtypes)]
    max_rows = rng.randint(1, 300)
    layout = Layout(fields, max_rows)
    asked = [rng.randint(0, max_rows) for _ in range(10)]
    plans = {rows: layout.offsets(rows) for rows in asked}
    fresh = Layout(fields, max_rows)  # the same declaration, its row counts asked in another order
    for rows in reversed(asked):
        offsets = fresh.offsets(rows)
        assert offsets == plans[rows]
        ends = [off + rows * d.itemsize for off, d in zip(offsets, dtypes, strict=True)]
        assert offsets[0] == 0
        assert all(off % FIELD_ALIGN == 0 for off in offsets), offsets
        assert all(nxt >= end for end, nxt in zip(ends, offsets[1:], strict=False)), offsets
        assert all(nxt - end < FIELD_ALIGN for end, nxt in zip(ends, offsets[1:], strict=False)), offsets
        assert layout.nbytes(rows) == fresh.nbytes(rows) == ends[-1]


def test_a_plan_of_a_small_layout_by_hand() -> None:
    """Catches the arithmetic itself drifting (field-major, each field rounded up to 16 bytes)."""
    layout = Layout([Field("a", torch.int64), Field("b", torch.int32), Field("c", torch.int8)], 8)
    assert layout.offsets(5) == [0, 48, 80] and layout.nbytes(5) == 85
    assert layout.offsets(8) == [0, 64, 96] and layout.nbytes(8) == 104
    assert layout.offsets(0) == [0, 0, 0] and layout.nbytes(0) == 0


BAD_DECLARATIONS: list[Any] = [
    pytest.param(lambda: Field("1x", torch.int64), r"'name' of a field must be an identifier", id="name-digit"),
    pytest.param(lambda: Field("a b", torch.int64), r"'name' of a field must be an identifier", id="name-space"),
    pytest.param(lambda: Field(3, torch.int64), r"'name' of a field must be an identifier", id="name-int"),
    pytest.param(lambda: Field("x", "int64"), r"'dtype' of a field must be one of", id="dtype-str"),
    pytest.param(lambda: Field("x", torch.bfloat16), r"'dtype' of a field must be one of", id="dtype-bf16"),
    pytest.param(lambda: Field("x", [torch.int64]), r"'dtype' of a field must be one of", id="dtype-list"),
    pytest.param(lambda: Layout([Field("x", torch.int8, pad=300)], 4), r"'pad' of field 'x' must fit", id="pad-big"),
    pytest.param(lambda: Layout([Field("x", torch.int32, pad=0.5)], 4), r"'pad' of field 'x' must fit", id="pad-frac"),
    pytest.param(lambda: Layout([Field("x", torch.int64, pad="0")], 4), r"'pad' of field 'x' must fit", id="pad-str"),
    pytest.param(
        lambda: Layout([Field("x", torch.float32, pad=1e39)], 4), r"'pad' of field 'x' must fit", id="pad-f32-range"
    ),
    pytest.param(lambda: Field.landing("t", torch.int16), r"'lands' must be one of", id="landing-int16"),
    pytest.param(lambda: Field.landing("t", "int64"), r"'lands' must be one of", id="landing-str"),
    pytest.param(
        lambda: Field("t", torch.int64, 1, torch.int64), r"a landing field holds int64 addresses", id="landing-pad"
    ),
    pytest.param(
        lambda: Field("t", torch.int32, 0, torch.int32), r"a landing field holds int64 addresses", id="landing-i32"
    ),
    pytest.param(lambda: Layout([], 4), r"'fields' must be a non-empty sequence of Field", id="no-fields"),
    pytest.param(
        lambda: Layout([("x", torch.int64)], 4), r"'fields' must be a non-empty sequence of Field", id="tuple-field"
    ),
    pytest.param(
        lambda: Layout([Field("x", torch.int64), Field("x", torch.int32)], 4), r"names must be unique", id="dup"
    ),
    pytest.param(lambda: Layout([Field("x", torch.int64)], 0), r"'max_rows' must be an int >= 1", id="rows-0"),
    pytest.param(lambda: Layout([Field("x", torch.int64)], True), r"'max_rows' must be an int >= 1", id="rows-True"),
    pytest.param(lambda: Layout([Field("x", torch.int64)], 2.0), r"'max_rows' must be an int >= 1", id="rows-float"),
]


@pytest.mark.parametrize(("declare", "match"), BAD_DECLARATIONS)
def test_bad_fields_pads_names_and_max_rows_are_settings_errors_naming_them(
    declare: Callable[[], object], match: str
) -> None:
    """Catches a declaration accepted that every step would then stage wrong (a pad that does not fit
    its dtype, a landing that is not int64 addresses with pad 0, two fields of one name) or refused
    with an untyped error."""
    with pytest.raises(SettingsError, match=match):
        declare()


@pytest.mark.parametrize("rows", [-1, MAX_ROWS + 1, True, 2.0, "4", None], ids=repr)
def test_a_bad_row_count_is_a_staging_value_error_and_claims_nothing(rows: Any) -> None:
    """Catches a row count past max_rows (the layout would overrun its slot or block), a bool or float
    taken as a count, or a refused open that still claimed (and so aged every live view by one claim)."""
    with pytest.raises(StagingValueError, match=r"'rows' must be an int in \[0, max_rows=8\]"):
        STEP.offsets(rows)
    pool = cpu_pool()
    if rows is None:  # no row count at all: the stage cannot know its layout's size
        with pytest.raises(PoolStateError, match="needs 'rows'"):
            pool.stage(STEP)
    else:
        with pytest.raises(StagingValueError, match=r"'rows' must be an int"):
            pool.stage(STEP, rows=rows)
    assert pool.claims == 0 and pool.stats().copies == 0


@pytest.mark.parametrize("live", [-1, 5, True, 1.0], ids=repr)
def test_a_bad_live_count_is_a_staging_value_error_and_copies_nothing(live: Any) -> None:
    """Catches more live rows than padded ones (puts past the layout), or a bool or float taken as a
    count; the refused open claims nothing and leaves no stage open."""
    pool = cpu_pool()
    with pytest.raises(StagingValueError, match=r"'live' must be an int in \[0, rows=4\]"):
        pool.stage(STEP, rows=4, live=live)
    assert pool.claims == 0 and pool.stats().copies == 0
    check_usable(pool)


def test_rows_and_live_without_a_layout_are_refused() -> None:
    """Catches a row count silently ignored by a plain stage (the caller believes a layout was staged)."""
    pool = cpu_pool()
    with pytest.raises(PoolStateError, match="'rows' and 'live' need a 'layout'"):
        pool.stage(rows=4)
    with pytest.raises(PoolStateError, match=r"'layout' must be a pinpool\.Layout"):
        pool.stage([Field("x", torch.int64)], rows=4)  # type: ignore[arg-type]
    assert pool.claims == 0


def test_a_layout_larger_than_the_slot_is_a_capacity_error() -> None:
    """Catches a layout that overruns its slot into the next one."""
    big = Layout([Field("x", torch.int64)], 200)  # 1600 bytes at 200 rows: more than the slot
    pool = cpu_pool()
    with pytest.raises(CapacityError, match="a layout of 200 rows needs 1600 bytes"):
        pool.stage(big, rows=200)
    assert pool.stats().copies == 0
    with pool.stage(big, rows=100) as st:  # what fits still goes in
        st.put("x", list(range(100)))
    assert st.views["x"].tolist() == list(range(100))


@pytest.mark.parametrize("owned", [None, 64], ids=["ring", "owned-64-bytes"])
def test_a_layout_with_a_landing_that_does_not_fit_names_the_layout_and_the_stage(owned: int | None) -> None:
    """Catches the landing's tail claim answering first for a layout that does not fit its stage (an
    error about the landing, or about the slot where the owned buffer is the limit), or a refused
    open that claims a slot."""
    big = Layout([Field("x", torch.int64), Field.landing("tokens")], 200)
    pool = cpu_pool()
    limit = 64 if owned else SLOT_BYTES
    with pytest.raises(CapacityError, match=rf"a layout of 100 rows needs \d+ bytes but the stage has {limit}"):
        pool.stage(big, rows=100, owned=owned)
    assert pool.stats().copies == 0 and pool.stats().stages == 0


def test_a_landing_reads_its_live_rows_and_its_padding_rows_store_nothing() -> None:
    """Catches a landing whose handle reads more or fewer than the live rows, padding rows whose
    address column is not 0 (a writer would store through it), or a step whose live count changes
    the layout's bytes in the slot (a landing's values are claimed for every row)."""
    pool = cpu_pool(num_slots=2)
    tails = set()
    for live in (4, 1, 0, 3):
        with pool.stage(STEP, rows=4, live=live) as st:
            st.put("rows", list(range(live)))
            st.put("pos", [7] * live)
            st.flush()
            addresses = st.views["tokens"]
            assert addresses[live:].tolist() == [0] * (4 - live)
            land_reference(torch.arange(100, 104), addresses)
            tails.add(st.tail)
        assert st.landing("tokens").tolist() == list(range(100, 100 + live))
    assert len(tails) == 1


def test_a_placed_layout_is_kept_per_row_count_whatever_the_live_count() -> None:
    """Catches a placed layout keyed by the live count too: a graph loop whose live count changes every
    step would fill and empty its slots' caches, rebuilding the layout's views nearly every step."""
    pool = cpu_pool(num_slots=2)
    placed = []  # held, so that no two of them can share an id
    for live in range(MAX_ROWS + 1):
        with pool.stage(STEP, rows=MAX_ROWS, live=live) as st:
            st.put("rows", [0] * live)
            st.put("pos", [0] * live)
            st.flush()
        assert st._placed is not None
        placed.append(st._placed)
    assert len({id(p) for p in placed}) == 2  # one per slot


# -- values on the CPU path -------------------------------------------------------------------
def test_views_and_landings_hold_each_steps_own_values_and_padding() -> None:
    """Catches a field packed at the wrong offset or dtype, another layout's views handed back for a
    slot the two layouts share, padding rows left holding an earlier step's values, a stale address
    column, or a landing handle of another slot or step."""
    pool = cpu_pool()
    sizes = [(4, 3), (1, 1), (8, 5), (6, 6), (4, 0), (2, 1)]
    steps = 24
    for step in range(steps):
        rows, live = sizes[step % len(sizes)]
        if step % 3 == 2:  # another layout on the same slots in between
            with pool.stage(OTHER, rows=rows, live=live) as other:
                other.put("temp", [0.25 * i for i in range(live)])
                other.put("ids", list(range(live)))
            assert other.views["temp"].tolist() == padded([0.25 * i for i in range(live)], rows, 1.0)
            assert other.views["ids"].tolist() == padded(list(range(live)), rows, 7)
            continue
        ids = [-(2**40) - step * 7 - i for i in range(live)]  # needs int64
        pos = [step * 3 - i for i in range(live)]
        st = pool.stage(STEP, rows=rows, live=live)
        assert st.placement is Placement.RING and st.state is State.OPEN
        st.put("rows", ids)
        st.put("pos", pos)
        st.flush()
        assert [st.views[n].dtype for n in ("rows", "pos", "tokens")] == [torch.int64, torch.int32, torch.int64]
        assert all(v.numel() == rows for v in st.views.values())
        addresses = st.views["tokens"].tolist()
        assert all(addresses[:live]) and addresses[live:] == [0] * (rows - live)
        landed = [step * 100 + 50 + i for i in range(rows)]
        land_reference(torch.tensor(landed, dtype=torch.int64), st.views["tokens"])  # the "sampler"
        st.close()
        assert st.state is State.CLOSED
        assert st.views["rows"].tolist() == padded(ids, rows, 0), f"step {step}"
        assert st.views["pos"].tolist() == padded(pos, rows, -1), f"step {step}"
        assert st.landing("tokens").tolist() == landed[:live], f"step {step}"
    stats = pool.stats()
    assert stats.copies == steps and stats.readbacks == 0 and stats.aborted_stages == 0


def test_numpy_tensor_and_in_place_fields_read_right_every_step() -> None:
    """Catches an array or CPU tensor packed wrong (dtype converted, strided source read flat), or a
    ``host`` fill that does not count as the field's write or lands at another field's offset."""
    pool = cpu_pool()
    for step in range(10):
        live = 5 - step % 3
        ids = np.arange(10, dtype=np.int64)[::2][:live] + step * 100  # strided
        with pool.stage(STEP, rows=6, live=live) as st:
            st.put("rows", ids)
            st.host("pos")[:] = np.arange(live, dtype=np.int32) - step
            st.flush()
            land_reference(torch.arange(6, dtype=torch.int64) + step, st.views["tokens"])
        assert st.views["rows"].tolist() == padded(ids.tolist(), 6, 0), f"step {step}"
        assert st.views["pos"].tolist() == padded(list(range(-step, live - step)), 6, -1), f"step {step}"
        assert st.landing("tokens").tolist() == list(range(step, step + live))
        with pool.stage(OTHER, rows=4, live=3) as other:
            other.put("temp", torch.tensor([0.5, 1.5, 2.5]))
            other.put("ids", np.array([1, 2, 3], dtype=np.int64))  # converted exactly to int16
        assert other.views["temp"].tolist() == [0.5, 1.5, 2.5, 1.0]
        assert other.views["ids"].tolist() == [1, 2, 3, 7]


def test_padding_rows_hold_the_pads_after_flush_over_an_earlier_steps_values() -> None:
    """Catches padding written only once (the next step of fewer live rows in a slot keeps the earlier
    step's values in its padding rows), or pads written over the live rows."""
    pool = cpu_pool(num_slots=2)
    for _ in range(2):  # every row live: both slots' bytes hold values
        with pool.stage(STEP, rows=MAX_ROWS) as st:
            st.put("rows", list(range(100, 108)))
            st.put("pos", list(range(200, 208)))
            st.flush()
            land_reference(torch.zeros(MAX_ROWS, dtype=torch.int64), st.views["tokens"])
    for live in (5, 0, 3, 7):
        st = pool.stage(STEP, rows=MAX_ROWS, live=live)
        st.put("rows", list(range(live)))
        st.put("pos", list(range(live)))
        host_pos = st._placed.host_views[1]  # white box: the pinned bytes the copy carries
        st.flush()
        assert host_pos.tolist() == padded(list(range(live)), MAX_ROWS, -1)
        assert st.views["rows"].tolist() == padded(list(range(live)), MAX_ROWS, 0)
        assert st.views["pos"].tolist() == padded(list(range(live)), MAX_ROWS, -1)
        assert st.views["tokens"].tolist()[live:] == [0] * (MAX_ROWS - live)
        st.close()


def test_a_step_with_no_live_rows_writes_only_padding_and_needs_no_input() -> None:
    """Catches a zero-row step refused for its missing inputs (nothing is live to write), or copied
    without its padding (a graph of that size would read the previous step's rows)."""
    pool = cpu_pool(num_slots=2)
    for _ in range(2):  # both slots' bytes hold values
        with pool.stage(STEP, rows=4) as st:
            st.put("rows", [9, 9, 9, 9])
            st.put("pos", [9, 9, 9, 9])
            st.flush()
    with pool.stage(STEP, rows=4, live=0) as st:
        st.flush()
    assert (st.views["rows"].tolist(), st.views["pos"].tolist()) == ([0] * 4, [-1] * 4)
    assert st.views["tokens"].tolist() == [0] * 4 and st.landing("tokens").tolist() == []


@pytest.mark.parametrize("landing", [False, True], ids=["no-landing", "landing"])
def test_a_readback_in_a_layout_stage_reads_its_own_values(landing: bool) -> None:
    """Catches a read-back placed over the layout's fields or the landing, or one whose fence is lost at close."""
    layout = STEP if landing else OTHER
    pool = cpu_pool()
    for step in range(8):
        with pool.stage(layout, rows=4, live=3) as st:
            if landing:
                st.put("rows", [step, step + 1, step + 2])
                st.put("pos", [1, 2, 3])
            else:
                st.put("temp", [0.5, 1.0, 1.5])
                st.put("ids", [step, step + 1, step + 2])
            src = torch.arange(5, dtype=torch.int64) * 3 + step * 1000
            handle = st.readback(src)  # flushes first
            assert st.state is State.FLUSHED
            if landing:
                land_reference(torch.tensor([step, step + 1, step + 2, 99]), st.views["tokens"])
        assert handle.tolist() == src.tolist(), f"step {step}"
        first = "rows" if landing else "ids"
        assert st.views[first].tolist()[:3] == [step, step + 1, step + 2]
        if landing:
            assert st.landing("tokens").tolist() == [step, step + 1, step + 2]
        else:
            with pytest.raises(StagingValueError, match="must be a landing field"):
                st.landing("ids")
    assert pool.stats().readbacks == 8


# -- refusals ------------------------------------------------------------------------------------
def check_usable(pool: PinnedRingBuffer) -> None:
    """The pool's next layout stage works and reads right, on every slot."""
    for step in range(pool.settings.num_slots + 1):
        with pool.stage(STEP, rows=3, live=2) as st:
            st.put("rows", [41, step])
            st.put("pos", [43, step])
            st.flush()
            land_reference(torch.tensor([44, step, 46]), st.views["tokens"])
        assert st.views["rows"].tolist() == [41, step, 0] and st.views["pos"].tolist() == [43, step, -1]
        assert st.landing("tokens").tolist() == [44, step]


@pytest.mark.parametrize("as_array", [False, True], ids=["list", "array"])
@pytest.mark.parametrize(
    ("rows", "pos", "match"),
    [
        ([1.5, 2], [3, 4], r"'rows' must hold whole numbers"),
        ([2**63, 2], [3, 4], r"'rows' must fit int64"),
        ([1, 2], [3, 2**31], r"'pos' must fit int32"),
        ([1, 2], [0.5, 4], r"'pos' must hold whole numbers"),
        ([1, 2], [3, float("nan")], r"'pos' must hold whole numbers|'pos' must be finite"),
    ],
    ids=["float-in-int64", "2**63", "2**31-in-int32", "float-in-int32", "nan-in-int32"],
)
def test_a_value_the_field_cannot_hold_is_a_typed_error_and_nothing_is_copied(
    as_array: bool, rows: list[Any], pos: list[Any], match: str
) -> None:
    """Catches a value struct refuses (the list fast path) or numpy would round (the general path)
    let through rounded, struct's own error raised instead of the typed one naming the field, a
    stage whose copy carries a half-packed field, or a pool left unusable."""
    pool = cpu_pool()
    copies, claims = pool.stats().copies, pool.claims
    with pytest.raises(StagingValueError, match=match), pool.stage(STEP, rows=3, live=2) as st:
        st.put("rows", np.array(rows) if as_array else rows)
        st.put("pos", np.array(pos) if as_array else pos)
    assert st.state is State.ABORTED
    assert pool.stats().copies == copies, "a refused stage copied"
    assert pool.stats().aborted_stages == 1 and pool.claims == claims + 1
    check_usable(pool)


def test_a_field_left_half_packed_by_a_refused_put_is_never_copied() -> None:
    """Catches a caller that catches the refused put and flushes anyway: the field's bytes may be half
    written (struct packs element by element), so the flush must abort with nothing copied, and its
    landing handle must never read."""
    pool = cpu_pool()
    st = pool.stage(STEP, rows=3, live=3)
    st.put("pos", [1, 2, 3])
    with pytest.raises(StagingValueError, match="'rows' must fit int64"):
        st.put("rows", [7, 8, 2**64])
    assert st.state is State.OPEN  # a refused put changes nothing else: the caller may put again
    with pytest.raises(PoolStateError, match=r"missing: \['rows'\].*nothing was copied"):
        st.flush()
    assert st.state is State.ABORTED and not st.is_open
    assert pool.stats().copies == 0 and pool.stats().aborted_stages == 1
    with pytest.raises(PoolStateError, match="aborted"):
        st.landing("tokens").tolist()
    with pytest.raises(PoolStateError, match="aborted"):
        st.put("rows", [1, 2, 3])
    check_usable(pool)


@pytest.mark.parametrize("finish", ["flush", "close", "with", "readback"])
def test_a_missing_input_field_aborts_the_stage_with_nothing_copied(finish: str) -> None:
    """Catches a step whose copy carries a field nobody wrote this step (the slot still holds an older
    step's values there, which the device would read as this step's), whichever way the copy is issued.
    (A layout without landings: with one, a close without flush is refused first, as it must be.)"""
    inputs = Layout(STEP.fields[:2], MAX_ROWS)
    pool = cpu_pool(num_slots=2)
    for _ in range(2):  # both slots' bytes hold an older step's values
        with pool.stage(inputs, rows=2) as st:
            st.put("rows", [5, 6])
            st.put("pos", [7, 8])
    copies = pool.stats().copies
    st = pool.stage(inputs, rows=2)
    st.put("rows", [1, 2])  # "pos" is never written
    with pytest.raises(PoolStateError, match=r"every input field must be written each step \(missing: \['pos'\]\)"):
        if finish == "flush":
            st.flush()
        elif finish == "close":
            st.close()
        elif finish == "readback":
            st.readback(torch.zeros(2, dtype=torch.int64))
        else:
            with st:
                pass
    assert st.state is State.ABORTED and not st.is_open
    assert pool.stats().copies == copies and pool.stats().aborted_stages == 1
    with pytest.raises(PoolStateError, match="aborted"):
        st.put("pos", [1, 2])
    check_usable(pool)


def test_puts_the_layout_cannot_take_are_typed_errors_and_the_stage_stays_usable() -> None:
    """Catches a wrong count of live values written past the live rows (over padding or the next
    field), an unknown name, a landing field written by hand (its addresses would be lost), a name on
    a plain stage, or a number beyond float64 raised as a bare OverflowError."""
    wide = Layout([Field("x", torch.float64), *STEP.fields], MAX_ROWS)
    pool = cpu_pool()
    with pool.stage(wide, rows=4, live=2) as st:
        for values in ([1, 2, 3], [1], np.arange(3), [[1, 2, 3]]):
            with pytest.raises(StagingValueError, match=r"'rows' must hold 2 values, one per live row"):
                st.put("rows", values)
        with pytest.raises(StagingValueError, match=r"'name' must be a declared field, one of \['x', 'rows'"):
            st.put("nope", [1, 2])
        with pytest.raises(StagingValueError, match="must be a declared field"):
            st.host("nope")
        for write in (lambda: st.put("tokens", [0, 0]), lambda: st.host("tokens")):
            with pytest.raises(PoolStateError, match="'tokens' is a landing: the stage writes its addresses"):
                write()
        with pytest.raises(StagingValueError, match=r"'x' holds a number too large for torch.float64"):
            st.put("x", [10**400, 1.0])
        st.put("x", [2.5, -1.0])
        st.put("rows", [1, 2])
        st.put("pos", [3, 4])
        st.flush()
        with pytest.raises(PoolStateError, match="flushed"):
            st.put("rows", [1, 2])
    assert st.views["x"].tolist() == [2.5, -1.0, 0.0, 0.0] and st.views["rows"].tolist() == [1, 2, 0, 0]
    with pool.stage() as plain:
        with pytest.raises(
            StagingTypeError, match=r"put\('rows', \.\.\.\) names a field, but this stage has no layout"
        ):
            plain.put("rows", [1])
        with pytest.raises(StagingValueError, match="must be a landing field"):
            plain.landing("tokens")


def test_a_landing_layout_on_a_pool_that_cannot_land_is_refused_before_the_claim() -> None:
    """Catches a stage handing out addresses a kernel may not store through (no zero-copy platform)."""
    pool = PinnedRingBuffer(PoolSettings(device="cpu", num_slots=2, slot_bytes=SLOT_BYTES))
    with pytest.raises(PoolStateError, match="zero_copy"):
        pool.stage(STEP, rows=2)
    assert pool.claims == 0
    with pool.stage(OTHER, rows=2) as st:  # a layout without landings still stages
        st.put("temp", [1.0, 2.0])
        st.put("ids", [1, 2])
    assert st.views["ids"].tolist() == [1, 2]


# -- the stream rules, in the simulator ------------------------------------------------------------
class NoHandOffRing(PinnedRingBuffer):
    """Planted: a slot changes stream without the new stream waiting for the old (the ring is told,
    before each claim, that the slot's last user was the claiming stream itself)."""

    def _claim(self, stream: Stream, placement: Placement, *, writes_mirror: bool) -> int:
        self._slots[self._next_slot].last_user = stream
        return super()._claim(stream, placement, writes_mirror=writes_mirror)


def run_layout_plan(seed: int, ring: type[PinnedRingBuffer] = PinnedRingBuffer, steps: int = 30) -> list[str]:
    """One random plan: each step stages two fields and a landing, queues checks of the views and a
    "kernel" that reads the staged addresses when it runs and stores the step's values there, each on
    the stage's stream or a registered consumer, then closes; landings are read up to num_slots - 1
    claims later. Returns every wrong value seen (device reads and landing reads)."""
    rng = random.Random(seed)
    gpu = LaggingGpu(max_lag=rng.randint(0, 40), seed=seed, devices=2)
    streams: list[SimStream] = [gpu.current_stream(0)]
    streams += [gpu.new_stream(f"s{i}") for i in range(1, rng.randint(2, 3) + 1)]
    other_device = [gpu.current_stream(1), gpu.new_stream("dev1:side", device_index=1)]
    num_slots = rng.randint(2, 5)
    gpu.set_current(rng.choice(streams))
    pool = ring(
        PoolSettings(device="cpu", num_slots=num_slots, slot_bytes=SLOT_BYTES, zero_copy=True),
        transport=gpu,  # type: ignore[arg-type]  # a structural Transport
    )
    consumers = rng.sample(streams, rng.randint(0, 2))
    for consumer in consumers:
        pool.register_consumer_stream(consumer)
    wrong: list[str] = []
    waiting: deque[tuple[Landing, list[int], int]] = deque()
    reads: list[tuple[int, Callable[[], None]]] = []
    slab_lo = pool.host_slab.data_ptr()
    slab_hi = slab_lo + pool.host_slab.numel()

    def read_one() -> None:
        handle, want, step = waiting.popleft()
        got = handle.tolist()
        if got != want:
            wrong.append(f"seed {seed} step {step}: landing read {got[:4]}, expected {want[:4]}")

    def writer_kernel(values: torch.Tensor, land_to: torch.Tensor, step: int) -> None:
        addresses = land_to.clone()  # read on the "device" when the kernel runs
        outside = [a for a in addresses.tolist() if a and not slab_lo <= a < slab_hi]
        if outside:  # read before its step's copy landed, or after the next one: not this slot's addresses
            wrong.append(f"seed {seed} step {step}: the writer read non-addresses {outside[:2]}")
            return
        land_reference(values, addresses)

    def fire_due(claims: int) -> None:
        due = [r for r in reads if r[0] <= claims]
        reads[:] = [r for r in reads if r[0] > claims]
        for _, read in due:
            read()

    for step in range(steps):
        fire_due(pool.claims)
        gpu.current_device = rng.choice([0, 1])
        gpu.set_current(rng.choice(streams))
        gpu.set_current(rng.choice(other_device))
        if rng.random() < 0.15:
            gpu.frozen = not gpu.frozen
        rows = rng.randint(1, MAX_ROWS)
        live = rng.randint(1, rows)
        a = [step * 1000 + i for i in range(live)]
        b = [-(step * 1000) - i for i in range(live)]
        st = pool.stage(STEP, rows=rows, live=live, stream=rng.choice([*streams, None]))
        st.put("rows", a)
        st.put("pos", b)
        st.flush()
        copied = gpu.new_fence()
        copied.record(st.stream)  # a consumer's own ordering after the copy, as a caller's would be
        limit = pool.claims + num_slots - 1  # the views' lifetime, in claims
        for view, want in (
            (st.views["rows"], np.array(padded(a, rows, 0), dtype=np.int64)),
            (st.views["pos"], np.array(padded(b, rows, -1), dtype=np.int32)),
        ):
            reader = rng.choice([st.stream, *consumers])
            wait = reader is not st.stream
            label = f"seed {seed} step {step} on {reader.name}"

            def read(
                view: torch.Tensor = view,
                want: np.ndarray[Any, Any] = want,
                reader: SimStream = reader,
                wait: bool = wait,
                copied: SimFence = copied,
                label: str = label,
            ) -> None:
                if wait:
                    gpu.stream_wait(reader, copied)
                gpu.enqueue_check(view, want, label, reader)

            # Queued now (before close) or up to num_slots - 1 claims later, as a step's kernels may be.
            due = rng.choice([-1, rng.randint(pool.claims, limit)])
            if due < 0:
                read()
            else:
                reads.append((due, read))
        writer = rng.choice([st.stream, *consumers])
        if writer is not st.stream:
            gpu.stream_wait(writer, copied)
        values = torch.arange(rows, dtype=torch.int64) + 10**6 * (step + 1)
        gpu.submit(writer, functools.partial(writer_kernel, values, st.views["tokens"], step), "kernel")
        gpu.set_current(rng.choice(streams))  # the current stream at close need not be the stage's
        st.close()
        waiting.append((st.landing("tokens"), values[:live].tolist(), step))
        # Read the oldest handles, never more than num_slots - 1 claims old (the lifetime rule).
        while waiting and (len(waiting) >= num_slots or rng.random() < 0.4):
            read_one()
    while waiting:
        read_one()
    fire_due(1 << 60)
    gpu.frozen = False
    gpu.drain()
    assert gpu.errors == [], gpu.errors[:3]  # nothing queued on the other device's streams
    return wrong + gpu.mismatches + gpu.races


PLAN_SEEDS = range(40)


def test_any_mix_of_streams_reads_every_steps_own_values_and_landings() -> None:
    """Catches a layout stage whose views or landing are overwritten by a later step of its slot before
    their readers ran, read before its copy landed, or fenced on the stream current at close."""
    for seed in PLAN_SEEDS:
        wrong = run_layout_plan(seed)
        assert wrong == [], wrong[:3]


def test_control_without_the_hand_off_the_same_plans_read_wrong_values() -> None:
    """Catches a property test too weak to see the cross-stream guard: with the hand-off planted away
    (a slot changing stream no longer waits for its previous stream), it must fail."""
    caught = sum(bool(run_layout_plan(seed, NoHandOffRing)) for seed in PLAN_SEEDS)
    print(f"no hand-off: caught in {caught} of {len(PLAN_SEEDS)} seeds")
    # Measured: 19 of 40 seeds (26 of 40 on the exchange before the port).
    assert caught >= 13, f"caught in only {caught} of {len(PLAN_SEEDS)} seeds"


def test_a_layout_stage_on_an_unchanged_stream_makes_one_copy_and_one_record() -> None:
    """Catches a layout or a landing that costs CUDA calls when nothing changed (a stream wait, a
    second copy, a fence per landing field)."""
    gpu = LaggingGpu(max_lag=3)
    pool = PinnedRingBuffer(
        PoolSettings(device="cpu", num_slots=3, slot_bytes=256, zero_copy=True),
        transport=gpu,  # type: ignore[arg-type]  # a structural Transport
    )
    for i in range(20):
        layout = STEP if i % 2 else OTHER
        with pool.stage(layout, rows=2) as st:
            if layout is STEP:
                st.put("rows", [i, i + 1])
                st.put("pos", [i, i])
            else:
                st.put("temp", [0.5, 1.5])
                st.put("ids", [i, i])
            st.flush()
            first = "rows" if layout is STEP else "ids"
            gpu.enqueue_check(st.views[first], np.array([i, i + 1 if layout is STEP else i]), f"step {i}", st.stream)
            gpu.calls.pop()  # the check's own "kernel" call
    assert gpu.calls == [("cudaMemcpyAsync", "default:0"), ("cudaEventRecord", "default:0")] * 20
    assert gpu.stream_waits == 0
    gpu.drain()
    assert gpu.mismatches == []


# -- the review's cases ------------------------------------------------------------------------
def test_debug_refuses_a_landing_stage_closed_under_an_unregistered_stream() -> None:
    """Catches a landing writer launched on an unregistered side stream going unflagged in debug mode
    (its stores would not be covered by the slot's fence)."""
    from pinpool.exceptions import UnguardedReaderError

    gpu = LaggingGpu(max_lag=0)
    side = gpu.new_stream("side")
    pool = PinnedRingBuffer(
        PoolSettings(device="cpu", num_slots=NUM_SLOTS, slot_bytes=SLOT_BYTES, zero_copy=True, debug=True),
        transport=gpu,  # type: ignore[arg-type]  # a structural Transport
    )
    main = pool.transport.resolve_stream(None)
    st = pool.stage(STEP, rows=2)
    st.put("rows", [1, 2])
    st.put("pos", [1, 2])
    st.flush()
    gpu.set_current(side)
    with pytest.raises(UnguardedReaderError, match="neither the stage's stream"):
        st.close()
    # The refused close moved the ring on: the slot an unguarded writer may still store into
    # is not the next one handed out.
    with pool.stage(OTHER, rows=1, stream=main) as next_one:
        next_one.put("temp", [1.0])
        next_one.put("ids", [1])
        assert next_one.slot != st.slot
    pool.register_consumer_stream(side)
    with pool.stage(STEP, rows=2, stream=main) as st2:  # side registered: accepted
        st2.put("rows", [3, 4])
        st2.put("pos", [0, 0])
        st2.flush()
        land_reference(torch.tensor([5, 6]), st2.views["tokens"].clone())
    gpu.drain()
    assert st2.landing("tokens").tolist() == [5, 6] and st2.views["rows"].tolist() == [3, 4]
