"""memcache.HostKVAllocator: KV slots 1..size on a host stack, slot 0 never handed out, and every
refused call (alloc or free) leaves the allocator exactly as it was."""

from __future__ import annotations

import random
from typing import Any

import numpy as np
import pytest
import torch

from memcache import AllocationError
from memcache.host_kv_allocator import HostKVAllocator

SIZE = 64


def in_use(kv: HostKVAllocator) -> set[int]:
    """The slots handed out now, found through the public API only: allocate what is left."""
    rest = kv.alloc(kv.available_size())
    kv.free(rest)
    return set(range(1, kv.size + 1)) - {int(s) for s in rest}


def test_alloc_then_free_round_trip_hands_out_1_to_size_and_never_slot_0() -> None:
    """Catches slot 0 (the padding slot every padded graph row writes) handed to a request, a slot
    handed out twice, or a free that does not give everything back."""
    kv = HostKVAllocator(SIZE)
    assert kv.available_size() == SIZE
    chunks = [kv.alloc(n) for n in (1, 5, 0, 17, 41)]
    assert kv.available_size() == 0
    for chunk, n in zip(chunks, (1, 5, 0, 17, 41), strict=True):
        assert isinstance(chunk, np.ndarray) and chunk.dtype == np.int64 and chunk.shape == (n,)
    taken = np.concatenate(chunks)
    assert sorted(taken.tolist()) == list(range(1, SIZE + 1))  # each slot once, 0 never
    for chunk in reversed(chunks):
        kv.free(chunk)
    assert kv.available_size() == SIZE
    again = kv.alloc(SIZE)
    assert sorted(again.tolist()) == list(range(1, SIZE + 1))


def test_alloc_zero_takes_nothing() -> None:
    kv = HostKVAllocator(4)
    empty = kv.alloc(0)
    assert empty.dtype == np.int64 and empty.shape == (0,)
    assert kv.available_size() == 4
    kv.free(empty)  # an empty free is a no-op
    assert kv.available_size() == 4


def test_alloc_returns_a_fresh_array_the_caller_may_write() -> None:
    """Catches alloc handing out a view of its own stack: the engine writes the array into slot_of
    and a stage, and a later free of a rewritten view would corrupt the free list."""
    kv = HostKVAllocator(8)
    a = kv.alloc(3)
    kept = a.copy()
    a[:] = 0  # the caller scribbles on its array
    b = kv.alloc(5)
    assert set(b.tolist()).isdisjoint(kept.tolist()) and 0 not in b.tolist()
    kv.free(kept)
    kv.free(b)
    assert kv.available_size() == 8 and in_use(kv) == set()


def test_free_then_alloc_reuses_the_freed_slots() -> None:
    """Catches freed slots lost (never handed out again) or handed out while still in use."""
    kv = HostKVAllocator(16)
    a = kv.alloc(10)
    freed = a[2:6].copy()
    kv.free(freed)
    assert kv.available_size() == 16 - 10 + 4
    b = kv.alloc(4)
    assert set(b.tolist()) == set(freed.tolist())  # a stack: the last freed come back first
    assert in_use(kv) == set(a.tolist())


@pytest.mark.parametrize("bad_size", [0, -1, True, 2.0, "8", None])
def test_constructor_refuses_a_bad_size(bad_size: Any) -> None:
    with pytest.raises(AllocationError, match="'size' must be an int >= 1"):
        HostKVAllocator(bad_size)


def test_alloc_too_many_raises_and_takes_nothing() -> None:
    """Catches a partial allocation left behind by a refused call (all or nothing)."""
    kv = HostKVAllocator(SIZE)
    held = kv.alloc(60)
    before = in_use(kv)
    with pytest.raises(AllocationError, match="asks for 5 KV slots but only 4 of 64 are free"):
        kv.alloc(5)
    assert kv.available_size() == 4 and in_use(kv) == before
    last = kv.alloc(4)  # exactly what is left still works
    assert sorted(np.concatenate([held, last]).tolist()) == list(range(1, SIZE + 1))
    with pytest.raises(AllocationError, match="only 0 of 64 are free"):
        kv.alloc(1)


@pytest.mark.parametrize("bad_n", [-1, 2.0, "2", True, False, None, [2], np.zeros(2, np.int64)])
def test_alloc_refuses_a_bad_n_and_takes_nothing(bad_n: Any) -> None:
    kv = HostKVAllocator(8)
    kv.alloc(3)
    with pytest.raises(AllocationError, match="'n' must be an int >= 0"):
        kv.alloc(bad_n)
    assert kv.available_size() == 5


def test_double_free_raises_and_frees_nothing() -> None:
    """Catches a slot freed twice (it would then be handed to two requests)."""
    kv = HostKVAllocator(8)
    a = kv.alloc(4)
    kv.free(a[:2])
    with pytest.raises(AllocationError, match="double free"):
        kv.free(a[:2])  # both already free
    with pytest.raises(AllocationError, match="double free"):
        kv.free(a[1:3])  # one free, one in use: the in-use one must stay in use
    with pytest.raises(AllocationError, match="double free"):
        kv.free(np.array([a[3], a[3]]))  # the same slot twice in one call
    assert kv.available_size() == 6
    assert in_use(kv) == {int(a[2]), int(a[3])}
    kv.free(a[2:])
    assert kv.available_size() == 8


def test_free_of_a_never_allocated_slot_raises() -> None:
    kv = HostKVAllocator(8)
    a = kv.alloc(2)
    never = next(s for s in range(1, 9) if s not in a.tolist())
    with pytest.raises(AllocationError, match="not in use"):
        kv.free(np.array([a[0], never]))
    assert in_use(kv) == set(a.tolist())


@pytest.mark.parametrize("bad", [0, 9, -1, 2**40])
def test_free_out_of_range_raises_and_frees_nothing(bad: int) -> None:
    """Catches slot 0 or a slot past size entering the free list (0 would then be handed out)."""
    kv = HostKVAllocator(8)
    a = kv.alloc(8)
    with pytest.raises(AllocationError, match=r"must lie in \[1, 8\]"):
        kv.free(np.array([a[0], bad], dtype=np.int64))
    assert kv.available_size() == 0
    kv.free(a)
    assert kv.available_size() == 8


@pytest.mark.parametrize(
    "slots",
    [
        np.array([1.0, 2.0]),
        np.array([True, False]),
        np.array([[1, 2]], dtype=np.int64),
        np.array(1, dtype=np.int64),
        [1, 2],
        (1, 2),
        torch.tensor([1, 2]),
        1,
        None,
    ],
    ids=["float", "bool", "2-D", "0-D", "list", "tuple", "tensor", "int", "None"],
)
def test_free_refuses_anything_but_a_1d_integer_numpy_array(slots: Any) -> None:
    kv = HostKVAllocator(8)
    kv.alloc(4)
    with pytest.raises(AllocationError, match="1-D integer numpy array"):
        kv.free(slots)
    assert kv.available_size() == 4


@pytest.mark.parametrize("dtype", [np.int32, np.uint16, np.uint64, np.int64])
def test_free_takes_any_integer_dtype(dtype: Any) -> None:
    kv = HostKVAllocator(8)
    a = kv.alloc(5)
    kv.free(a.astype(dtype))
    assert kv.available_size() == 8
    assert sorted(kv.alloc(8).tolist()) == list(range(1, 9))


def test_free_of_a_strided_view_frees_exactly_its_slots() -> None:
    """The engine frees row slices of its slot table; a non-contiguous view must work too."""
    kv = HostKVAllocator(12)
    a = kv.alloc(12)
    table = a.reshape(3, 4)
    kv.free(table[:, 1])  # strided
    assert kv.available_size() == 3
    assert in_use(kv) == set(a.tolist()) - set(table[:, 1].tolist())


def test_random_alloc_free_sequence_keeps_the_books() -> None:
    """Catches drift between the stack, the in-use marks and available_size over many operations."""
    rng = random.Random(4)
    size = 200
    kv = HostKVAllocator(size)
    held: list[np.ndarray[Any, Any]] = []
    for _ in range(2000):
        if held and rng.random() < 0.45:
            chunk = held.pop(rng.randrange(len(held)))
            if chunk.size > 1 and rng.random() < 0.3:  # free part now, the rest later
                cut = rng.randrange(1, chunk.size)
                held.append(chunk[cut:])
                chunk = chunk[:cut]
            kv.free(chunk)
        else:
            n = rng.randrange(0, 12)
            if n > kv.available_size():
                with pytest.raises(AllocationError):
                    kv.alloc(n)
                continue
            held.append(kv.alloc(n))
        everything = np.concatenate(held) if held else np.zeros(0, np.int64)
        assert kv.available_size() == size - everything.size
        assert np.unique(everything).size == everything.size  # no slot held twice
        assert everything.size == 0 or (everything.min() >= 1 and everything.max() <= size)
    assert in_use(kv) == {int(s) for c in held for s in c}


def test_alloc_into_writes_the_callers_array_and_a_refusal_leaves_it_and_the_books_alone() -> None:
    """Catches alloc_into taking slots without writing them where the caller stages them, handing
    out a slot twice with alloc, or a refused call (too many, wrong array) that takes slots or
    scribbles on the caller's array."""
    kv = HostKVAllocator(10)
    image = np.full((2, 4), -7, dtype=np.int64)
    kv.alloc_into(image[1])
    got = image[1].tolist()
    assert (image[0] == -7).all() and len(set(got)) == 4 and 0 not in got
    rest = kv.alloc(6)
    assert set(got).isdisjoint(rest.tolist())
    before = image.copy()
    with pytest.raises(AllocationError, match="asks for 4"):
        kv.alloc_into(image[0])
    with pytest.raises(AllocationError, match="'out'"):
        kv.alloc_into(np.zeros(2, dtype=np.int32))
    assert (image == before).all() and kv.available_size() == 0
    kv.free(image[1].copy())
    with pytest.raises(AllocationError, match="double free"):
        kv.free(image[1].copy())
    assert kv.available_size() == 4


def test_alloc_into_a_read_only_array_is_refused_with_nothing_taken() -> None:
    kv = HostKVAllocator(4)
    frozen = np.zeros(2, dtype=np.int64)
    frozen.flags.writeable = False
    with pytest.raises(AllocationError, match="writable"):
        kv.alloc_into(frozen)
    assert kv.available_size() == 4
