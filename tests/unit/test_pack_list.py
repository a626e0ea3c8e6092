"""The struct fast path for number lists: exact ints, numpy-equal floats; every refusal falls back to the checks."""

from __future__ import annotations

import numpy as np
import pytest
import torch

from pinpool import PinnedRingBuffer, PoolSettings, StagingValueError


def pool() -> PinnedRingBuffer:
    return PinnedRingBuffer(PoolSettings(device="cpu", num_slots=2, slot_bytes=1 << 12))


@pytest.mark.parametrize(
    ("dtype", "values"),
    [
        (torch.int64, [0, -1, 2**63 - 1, -(2**63), 7]),
        (torch.int32, [0, -1, 2**31 - 1, -(2**31), 7]),
        (torch.int64, [True, False, np.int64(5), np.int32(-3)]),
        (torch.int32, []),
    ],
)
def test_int_lists_land_exactly(dtype: torch.dtype, values: list[object]) -> None:
    """Catches a packing code, byte order or offset that shifts or truncates values."""
    p = pool()
    with p.stage() as st:
        st.put([1.5, 2.5], torch.float32)  # an unaligned start for the next field
        got = st.put(values, dtype)
    assert got.tolist() == [int(v) for v in values]  # type: ignore[call-overload]


@pytest.mark.parametrize(
    ("dtype", "values", "fragment"),
    [
        (torch.int64, [1, 2.5, 3], "'rows'"),
        (torch.int32, [1, 2**31], "'rows'"),
        (torch.int64, [1, 2**63], "'rows'"),
        (torch.int64, [1, float("nan")], "'rows'"),
    ],
)
def test_refused_lists_raise_typed_errors_and_leave_the_stage_usable(
    dtype: torch.dtype, values: list[object], fragment: str
) -> None:
    """Catches a value struct refuses being written anyway, or a stage left half-advanced."""
    p = pool()
    with p.stage() as st:
        first = st.put([10, 20], dtype)
        used = st.used_bytes
        with pytest.raises(StagingValueError, match=fragment):
            st.put(values, dtype, name="rows")
        assert st.used_bytes == used
        after = st.put([30, 40, 50], dtype)
    assert first.tolist() == [10, 20]
    assert after.tolist() == [30, 40, 50]


@pytest.mark.parametrize(
    ("dtype", "values"),
    [
        (torch.int64, np.array([1.0, 2.0**63])),
        (torch.int32, np.array([1.0, 2.0**31])),
        (torch.uint8, np.array([1.0, 256.0])),
        (torch.int64, np.array([1, 2**63], dtype=np.uint64)),
    ],
)
def test_arrays_just_past_the_integer_range_are_refused(dtype: torch.dtype, values: np.ndarray) -> None:
    """Catches 2**63 (float64 rounds int64's max up to it) cast into int64 as its minimum."""
    p = pool()
    with p.stage() as st, pytest.raises(StagingValueError, match="must fit"):
        st.put(values, dtype)


@pytest.mark.parametrize("dtype", [torch.float32, torch.float64])
def test_float_lists_land_as_numpy_would_round_them(dtype: torch.dtype) -> None:
    """Catches a float packing code that rounds, orders or places values differently from numpy's cast."""
    rng = np.random.default_rng(3)
    values = [*rng.standard_normal(37).tolist(), 0.1, -0.0, 1e-45, 3.4028234e38, 7, True, float("inf"), float("nan")]
    p = pool()
    with p.stage() as st:
        st.put([1], torch.int32)  # an unaligned start for the next field
        got = st.put(values, dtype)
    want = np.array(values, dtype=np.float64).astype({torch.float32: np.float32, torch.float64: np.float64}[dtype])
    np.testing.assert_array_equal(got.numpy(), want)


def test_a_float_too_large_for_float32_is_refused_not_written_as_inf() -> None:
    """Catches 1e39 landing as inf in a float32 field (struct refuses it; the typed check must then raise)."""
    p = pool()
    with p.stage() as st, pytest.raises(StagingValueError, match="must fit float32"):
        st.put([1.0, 1e39], torch.float32)


@pytest.mark.parametrize("dtype", [torch.int64, torch.int32, torch.float32, torch.float64, torch.int8])
def test_the_fast_paths_land_what_the_general_path_lands(dtype: torch.dtype) -> None:
    """Catches the struct fast path for lists drifting from the general path (numpy's converting write of a
    tuple, a contiguous array, a strided one) on the same values."""
    rng = np.random.default_rng(0)
    np_dtype = torch.empty(0, dtype=dtype).numpy().dtype
    values = (rng.integers(-100, 100, 37) if np_dtype.kind in "iu" else rng.normal(size=37)).astype(np_dtype)
    strided = np.repeat(values, 2)[::2]
    assert not strided.flags.c_contiguous
    p = pool()
    with p.stage() as st:
        landed = [
            st.put(values.tolist(), dtype),  # struct, where struct has the dtype
            st.put(tuple(values.tolist()), dtype),  # numpy's list parse
            st.put(values, dtype),  # numpy's copy
            st.put(strided, dtype),  # numpy's converting copy
        ]
    first = landed[0].clone()
    for other in landed[1:]:
        assert torch.equal(other, first)
    assert first.numpy().tobytes() == values.tobytes()


@pytest.mark.parametrize("rows", [7, 5], ids=["padded", "every-row-live"])
@pytest.mark.parametrize("dtype", [torch.int64, torch.int32, torch.float32, torch.float64, torch.int8])
def test_a_layout_field_lands_the_same_from_its_packer_and_from_the_general_path(
    dtype: torch.dtype, rows: int, monkeypatch: pytest.MonkeyPatch
) -> None:
    """Catches ``Stage.put``'s packer for a layout field's list drifting from the general path (a tuple, an
    array) on the same values, either writing the padding rows or another field's bytes, or the list not
    taking the packer at all where struct has the dtype (int8 has none: the general path, as a control).
    Both packers: the live count's (padded) and the one the placed layout keeps for every row."""
    from pinpool import Field, Layout
    from pinpool.encode import packer_for
    from pinpool.placed import Placed

    general = Placed.put
    calls: list[str] = []

    def counted(placed: Placed, name: str, values: object, live: int) -> int:
        calls.append(type(values).__name__)
        return general(placed, name, values, live)

    monkeypatch.setattr(Placed, "put", counted)
    rng = np.random.default_rng(1)
    np_dtype = torch.empty(0, dtype=dtype).numpy().dtype
    values = (rng.integers(-100, 100, 5) if np_dtype.kind in "iu" else rng.normal(size=5)).astype(np_dtype)
    layout = Layout([Field("before", torch.int8, pad=-1), Field("x", dtype, pad=3), Field("after", torch.int64)], 8)
    p = pool()
    landed = []
    for form in (values.tolist(), tuple(values.tolist()), values):
        with p.stage(layout, rows=rows, live=5) as st:
            st.put("before", np.ones(5, np.int8))
            st.put("x", form)
            st.put("after", [2] * 5)
        landed.append({name: view.clone() for name, view in st.views.items()})
    for other in landed[1:]:
        assert all(torch.equal(other[name], landed[0][name]) for name in landed[0])
    assert landed[0]["x"][:5].numpy().tobytes() == values.tobytes()
    pads = rows - 5
    assert landed[0]["x"][5:].tolist() == [3] * pads and landed[0]["before"].tolist() == [1] * 5 + [-1] * pads
    assert landed[0]["after"].tolist() == [2] * 5 + [0] * pads
    packed = packer_for(dtype, 5) is not None
    # The general path saw the arrays and the tuple, and the list only where struct lacks the dtype.
    assert calls.count("list") == (0 if packed else 1) and calls.count("tuple") == 1
