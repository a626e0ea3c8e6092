"""PinnedRingBuffer on the CPU fallback: values, stats, lifecycle and misuse errors."""

from __future__ import annotations

import gc
import threading
import weakref

import numpy as np
import pytest
import structlog
import torch

from pinpool import (
    CapacityError,
    DeviceMismatchError,
    PinnedRingBuffer,
    PoolSettings,
    PoolStateError,
    StagingTypeError,
    StagingValueError,
    StaleLeaseError,
)
from pinpool.exceptions import ThreadOwnershipError


def make_pool(**kw: object) -> PinnedRingBuffer:
    return PinnedRingBuffer(PoolSettings(**{"device": "cpu", "num_slots": 3, "slot_bytes": 1024, **kw}))  # type: ignore[arg-type]


def test_cpu_fallback_returns_exactly_the_values_put() -> None:
    """Catches a put that lands at the wrong offset, dtype or shape (rule 7)."""
    pool = make_pool()
    with pool.stage() as st:
        temps = st.put([0.7, 1.0], torch.float32)
        ks = st.put(np.array([5, 40], np.int32))
        seeds = st.put(torch.tensor([1, 2**40]))
        raw = st.put(b"\x01\x02\x03")
        grid = st.put([[1, 2], [3, 4]], torch.int16)
        halves = st.put(torch.tensor([1.5, -2.25], dtype=torch.bfloat16))
        scalar = st.put(3.5, torch.float64)
    assert temps.tolist() == pytest.approx([0.7, 1.0]) and temps.dtype == torch.float32
    assert ks.tolist() == [5, 40] and ks.dtype == torch.int32
    assert seeds.tolist() == [1, 2**40] and seeds.dtype == torch.int64
    assert raw.tolist() == [1, 2, 3] and raw.dtype == torch.uint8
    assert grid.tolist() == [[1, 2], [3, 4]] and grid.dtype == torch.int16
    assert halves.tolist() == [1.5, -2.25] and halves.dtype == torch.bfloat16
    assert scalar.shape == () and scalar.item() == 3.5
    stats = pool.stats()
    assert (stats.stages, stats.copies, stats.host_allocations) == (1, 1, 1)


def test_puts_are_aligned_and_one_copy_covers_them() -> None:
    """Catches misaligned offsets (a dtype view would fail) and copies of more than the used range."""
    pool = make_pool(alignment=64)
    with pool.stage() as st:
        a = st.put([1], torch.int8)
        b = st.put([2.0], torch.float64)
        used = st.used_bytes
    assert (b.data_ptr() - a.data_ptr()) % 64 == 0
    assert used == 64 + 8
    assert pool.stats().bytes_copied == used


def test_ring_views_stay_valid_until_their_slot_is_recycled() -> None:
    """Catches a slot reused before num_slots stages have passed."""
    pool = make_pool(num_slots=3)
    views = []
    for i in range(3):
        with pool.stage() as st:
            views.append((st, st.put([i] * 4, torch.int32)))
    assert [v.tolist() for _, v in views] == [[0] * 4, [1] * 4, [2] * 4]
    with pool.stage() as st:
        st.put([9] * 4, torch.int32)
    assert not views[0][0].is_live and views[1][0].is_live
    with pytest.raises(StaleLeaseError, match="recycled"):
        views[0][0].check_live()


def test_exception_inside_stage_issues_no_copy_and_keeps_earlier_data() -> None:
    """Catches a half-done stage: a copy issued after an error, or a slot left claimed."""
    pool = make_pool()
    with pool.stage() as st:
        kept = st.put([1.0, 2.0], torch.float32)
    with pytest.raises(RuntimeError, match="scheduler bug"), pool.stage() as st:
        st.put([5.0], torch.float32)
        raise RuntimeError("scheduler bug")
    stats = pool.stats()
    assert (stats.copies, stats.aborted_stages) == (1, 1)
    with pool.stage() as st:
        after = st.put([3.0], torch.float32)
    assert after.tolist() == [3.0]
    assert kept.tolist() == [1.0, 2.0]


def test_put_that_does_not_fit_raises_capacity_error_and_nothing_is_staged() -> None:
    """Catches an overflow that silently truncates or writes past the slot."""
    pool = make_pool(slot_bytes=256)
    with pool.stage() as st:
        first = st.put([1] * 8, torch.int32)
        with pytest.raises(CapacityError) as info:
            st.put([1] * 100, torch.int32)
        after = st.put([7], torch.int32)
    message = str(info.value)
    assert "400 bytes" in message and "256" in message and "slot_bytes" in message
    assert first.tolist() == [1] * 8 and after.tolist() == [7]
    assert pool.stats().copies == 1 and pool.stats().host_allocations == 1


@pytest.mark.parametrize(
    ("values", "dtype", "error", "fragment"),
    [
        ([1.5], torch.int32, StagingValueError, "whole numbers"),
        ([float("nan")], torch.int64, StagingValueError, "finite"),
        ([2**40], torch.int32, StagingValueError, "must fit int32"),
        (np.array([2**40]), torch.int32, StagingValueError, "must fit int32"),
        (np.array([1.0, np.inf]), torch.int32, StagingValueError, "finite"),
        ([1e39], torch.float32, StagingValueError, "must fit float32"),
        (["a"], torch.float32, StagingValueError, "numbers"),
        ([2], torch.bool, StagingValueError, "0/1"),
        ([1], torch.complex64, StagingTypeError, "dtype must be one of"),
        ({"a": 1}, torch.float32, StagingTypeError, "must be a list"),
        ([1, 2], None, StagingTypeError, "explicit dtype"),
        (b"abc", torch.int32, StagingValueError, "whole number of"),
        (np.array(["x"]), torch.int32, StagingTypeError, "numbers"),
    ],
)
def test_bad_values_raise_typed_errors_naming_the_field(
    values: object, dtype: torch.dtype, error: type, fragment: str
) -> None:
    """Catches a value silently changed on its way to the GPU (1.5 -> 1, 2**40 -> 0, NaN -> garbage)."""
    pool = make_pool()
    with pool.stage() as st:
        with pytest.raises(error) as info:
            st.put(values, dtype, name="top_k")
        assert "'top_k'" in str(info.value) and fragment in str(info.value)
        assert st.used_bytes == 0
        ok = st.put([4], torch.int32)
    assert ok.tolist() == [4]


def test_exact_conversions_are_accepted() -> None:
    """Catches a validator so strict that it rejects values that convert exactly."""
    pool = make_pool()
    with pool.stage() as st:
        a = st.put([1.0, -2.0], torch.int32)
        b = st.put(np.array([1, 0], np.int64), torch.bool)
        c = st.put([float("inf"), float("nan")], torch.float32)
        d = st.put(np.array([3, 4], np.int64), torch.int32)
    assert a.tolist() == [1, -2] and b.tolist() == [True, False] and d.tolist() == [3, 4]
    assert c[0].item() == float("inf") and torch.isnan(c[1])


def test_lifecycle_errors_nested_stage_use_after_close_and_double_close() -> None:
    """Catches a nested stage corrupting the open one, and use of freed memory after close()."""
    pool = make_pool()
    with pool.stage() as st:
        with pytest.raises(PoolStateError, match="inside open stage"):
            pool.stage()
        st.put([1], torch.int32)
    with pool.stage() as st:
        pass
    with pytest.raises(PoolStateError, match="closed"):
        st.put([1], torch.int32)
    pool.close()
    pool.close()  # no-op
    with pytest.raises(PoolStateError, match="closed"):
        pool.stage()


def test_tensor_on_another_device_is_refused() -> None:
    """Catches a silent cross-device copy of user data."""
    pool = make_pool()
    meta = torch.empty(2, device="meta")
    with pool.stage() as st, pytest.raises(DeviceMismatchError, match="CPU tensor"):
        st.put(meta)


def test_owned_stage_copies_into_consumer_memory_that_survives_the_ring() -> None:
    """Catches owned data aliasing the ring (rule 4)."""
    pool = make_pool(num_slots=2)
    with pool.stage(owned=64) as st:
        kept = st.put([1.5, 2.5], torch.float32)
    for i in range(5):
        with pool.stage() as st2:
            st2.put([float(i)] * 8, torch.float32)
    assert kept.tolist() == [1.5, 2.5] and st.is_live
    assert pool.stats().owned_stages == 1
    with pool.stage(owned=8) as st3, pytest.raises(CapacityError, match="owned buffer"):
        st3.put([1.0] * 8, torch.float32)  # 32 bytes into 8 (rounded up to 16)


def test_retained_objects_are_released_when_the_slot_is_reclaimed() -> None:
    """Catches a keep-alive list that leaks (never cleared) or drops early (rule 5)."""
    pool = make_pool(num_slots=2)
    sentinel = torch.empty(4)
    alive = weakref.ref(sentinel)
    with pool.stage() as st:
        st.put([1], torch.int32)
        st.retain(sentinel)
    del sentinel
    gc.collect()
    assert alive() is not None, "dropped before its slot was reclaimed"
    for _ in range(2):
        with pool.stage() as st:
            st.put([1], torch.int32)
    gc.collect()
    assert alive() is None, "still held after its slot was reclaimed"


def test_debug_poisons_recycled_region_so_stale_views_show_nan() -> None:
    """Catches a stale raw view that still reads plausible old data in debug mode."""
    pool = make_pool(num_slots=2, debug=True)
    with pool.stage() as st:
        stale = st.put([1.0] * 8, torch.float32)
    for _ in range(2):
        with pool.stage() as st:
            st.put([2.0], torch.float32)
    assert torch.isnan(stale[1:]).all()


def test_debug_refuses_a_second_thread() -> None:
    """Catches two threads sharing one pool (one pool per worker is the model)."""
    pool = make_pool(debug=True)
    errors: list[BaseException] = []

    def use() -> None:
        try:
            pool.stage()
        except BaseException as exc:
            errors.append(exc)

    t = threading.Thread(target=use)
    t.start()
    t.join()
    assert len(errors) == 1 and isinstance(errors[0], ThreadOwnershipError)
    with pool.stage() as st:
        value = st.put([1], torch.int32)
    assert value.tolist() == [1]


def test_reserve_hands_out_a_host_view_that_lands_on_the_device() -> None:
    """Catches reserve() returning views of different regions on the two sides."""
    pool = make_pool()
    with pool.stage() as st:
        host, device = st.reserve(4, torch.int64)
        host[:] = [4, 3, 2, 1]
    assert device.tolist() == [4, 3, 2, 1]


def test_events_have_stable_names() -> None:
    """Catches a renamed log event that dashboards match on."""
    with structlog.testing.capture_logs() as logs:
        pool = make_pool()
        pool.close()
    assert [e["event"] for e in logs] == ["pool.created", "pool.closed"]
    assert logs[0]["num_slots"] == 3 and logs[0]["slot_bytes"] == 1024


def test_an_owned_buffer_is_checked_again_after_its_shape_changed_in_place() -> None:
    """Catches an owned buffer checked once and then trusted: the same object reshaped in place is refused."""
    pool = make_pool()
    owned = torch.zeros(64, dtype=torch.uint8)
    for value in (3, 4):  # the same buffer, staged twice
        with pool.stage(owned=owned) as st:
            st.put([value] * 8, torch.int64)
        assert owned.view(torch.int64)[:8].tolist() == [value] * 8
    owned.resize_(8, 8)  # in place: the same object, now 2-D
    with pytest.raises(PoolStateError, match="contiguous 1-D uint8"):
        pool.stage(owned=owned)
    assert owned.view(torch.int64).flatten()[:8].tolist() == [4] * 8  # nothing was written
    wrong = torch.zeros(64, dtype=torch.int32)
    with pytest.raises(PoolStateError, match="contiguous 1-D uint8"):
        pool.stage(owned=wrong)  # another buffer: the same check
    assert pool.claims == 2  # a refused open claims nothing
    pool.close()


def test_an_array_of_the_target_dtype_is_put_exactly_whatever_its_layout() -> None:
    """The same-dtype memcpy path against strided, byte-swapped and oversized arrays."""
    pool = make_pool()
    base = np.arange(10, dtype=np.int64) * 1_000_000_007
    with pool.stage() as st:
        plain = st.put(base, torch.int64)  # the memcpy path
        strided = st.put(base[::2], torch.int64)  # not contiguous: the converting path
        swapped = st.put(base.astype(">i8"), torch.int64)  # byte-swapped: converted, not copied raw
        floats = st.put(np.array([0.5, -2.25], np.float32), torch.float32)
        after = st.put([7], torch.int64)
    assert plain.tolist() == base.tolist()
    assert strided.tolist() == base[::2].tolist()
    assert swapped.tolist() == base.tolist()
    assert floats.tolist() == [0.5, -2.25]
    assert after.tolist() == [7] and after.data_ptr() % 16 == 0  # the next claim stays aligned
    with pool.stage() as st, pytest.raises(CapacityError):
        st.put(np.zeros(1024, np.int64), torch.int64)  # 8 KiB into a 1 KiB slot
    pool.close()


def test_an_owned_buffer_swapped_in_place_for_another_dtype_is_refused() -> None:
    """Catches a cached view of an owned buffer: ``buf.data = other`` keeps the object but changes its dtype."""
    pool = make_pool()
    owned = torch.zeros(256, dtype=torch.uint8)
    with pool.stage(owned=owned) as st:
        st.put([1, 2], torch.int64)
    owned.data = torch.zeros(64, dtype=torch.float32)  # the same object, now float32
    with pytest.raises(PoolStateError, match="contiguous 1-D uint8"):
        pool.stage(owned=owned)
    assert owned.tolist() == [0.0] * 64  # nothing was written
    pool.close()


def test_the_pool_does_not_keep_an_owned_buffer_alive_after_its_stage() -> None:
    """Catches a pool that holds a caller's owned buffer (a view cache, the open stage) once its stage closed."""
    pool = make_pool()
    owned = torch.zeros(256, dtype=torch.uint8)
    with pool.stage(owned=owned) as st:
        st.put([1], torch.int64)
    with pool.stage(owned=owned) as st:  # a second stage of the same buffer
        st.put([2], torch.int64)
    gone = weakref.ref(owned)
    del owned, st
    gc.collect()
    assert gone() is None
    pool.close()


@pytest.mark.parametrize("placement", ["ring", "owned"])
def test_a_view_read_before_its_stages_copy_is_refused_and_debug_poisons_the_ring_region(placement: str) -> None:
    """Catches the trap of reading a stage's device view inside the stage, before the copy: the view
    still holds older bytes, so ``check_live`` must refuse it until ``flush``; in debug mode the
    recycled ring region reads as poison (-1), never as a believable older value."""
    pool = make_pool(debug=True)
    with pool.stage() as st:  # lap 1 leaves real values in slot 0's device region
        st.put([11, 12], torch.int64)
    for _ in range(2):
        with pool.stage() as other:  # slots 1 and 2: the ring comes round to slot 0 next
            other.put([0], torch.int64)
    kw = {"owned": 64} if placement == "owned" else {}
    st = pool.stage(**kw)  # type: ignore[arg-type]
    view = st.put([5, 6], torch.int64)
    with pytest.raises(StaleLeaseError, match="before its copy was issued"):
        st.check_live()
    assert not st.is_live
    if placement == "ring":
        assert view.tolist() == [-1, -1]  # poisoned at claim, not slot 0's older 11, 12
    st.flush()
    st.check_live()
    assert view.tolist() == [5, 6]
    st.close()
