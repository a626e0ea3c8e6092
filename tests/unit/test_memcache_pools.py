"""ReqToTokenPool and TokenToKVPoolAllocator: allocation, frees, and all-or-nothing failures."""

from __future__ import annotations

import pytest
import torch

from memcache import AllocationError, ReqToTokenPool, TokenToKVPoolAllocator, allocate_extend


def test_rows_alloc_and_free_round_trip() -> None:
    """Catches a row handed out twice or lost from the free list."""
    pool = ReqToTokenPool(4, 16, "cpu")
    rows = pool.alloc(3)
    assert len(set(rows)) == 3
    assert pool.available_size() == 1
    pool.free(rows[1:])
    again = pool.alloc(3)
    assert set(again).isdisjoint({rows[0]})
    assert pool.req_to_token.shape == (4, 16)
    assert pool.req_to_token.dtype == torch.int32


def test_row_exhaustion_names_asked_and_free() -> None:
    """Catches an allocator that silently returns fewer rows than asked."""
    pool = ReqToTokenPool(2, 8, "cpu")
    pool.alloc(1)
    with pytest.raises(AllocationError, match="asks for 2 request rows but only 1 of 2 are free"):
        pool.alloc(2)
    assert pool.available_size() == 1


def test_double_free_is_an_error_and_frees_nothing() -> None:
    """Catches a double free that would hand one row to two requests later."""
    pool = ReqToTokenPool(4, 8, "cpu")
    a, b = pool.alloc(2)
    pool.free(a)
    with pytest.raises(AllocationError, match=f"row {a}, which is already free"):
        pool.free([b, a])
    with pytest.raises(AllocationError, match="already free"):
        pool.free([b, b])
    with pytest.raises(AllocationError, match=r"in \[0, 4\)"):
        pool.free([7])
    assert pool.available_size() == 3  # b is still allocated
    pool.free(b)
    assert pool.available_size() == 4


def test_kv_alloc_reserves_slot_zero_and_counts_on_host() -> None:
    """Catches slot 0 (the padding slot) handed to a request."""
    kv = TokenToKVPoolAllocator(8, "cpu")
    slots = kv.alloc(8)
    assert sorted(slots.tolist()) == list(range(1, 9))
    assert kv.available_size() == 0
    with pytest.raises(AllocationError, match="asks for 1 KV slots but only 0 of 8 are free"):
        kv.alloc(1)
    kv.free(slots[:3])
    assert kv.available_size() == 3
    with pytest.raises(AllocationError, match="only 5 are in use"):
        kv.free(torch.arange(1, 7))
    with pytest.raises(AllocationError, match="1-D"):
        kv.free(torch.zeros(2, 2, dtype=torch.int64))


def test_batch_allocation_is_all_or_nothing() -> None:
    """Catches a batch that takes rows and then fails on KV slots, leaking the rows."""
    rows = ReqToTokenPool(4, 8, "cpu")
    kv = TokenToKVPoolAllocator(10, "cpu")
    with pytest.raises(AllocationError, match="nothing was allocated"):
        allocate_extend(rows, kv, 2, 11)
    with pytest.raises(AllocationError, match="nothing was allocated"):
        allocate_extend(rows, kv, 5, 1)
    assert (rows.available_size(), kv.available_size()) == (4, 10)
    # Counts the KV allocator would refuse only after the rows were taken: refused first.
    for bad in (-1, True, 2.0):
        with pytest.raises(AllocationError, match="'num_tokens' must be an int >= 0"):
            allocate_extend(rows, kv, 2, bad)  # type: ignore[arg-type]
        with pytest.raises(AllocationError, match="'num_reqs' must be an int >= 0"):
            allocate_extend(rows, kv, bad, 2)  # type: ignore[arg-type]
    assert (rows.available_size(), kv.available_size()) == (4, 10)
    got_rows, slots = allocate_extend(rows, kv, 2, 10)
    assert (len(got_rows), slots.numel()) == (2, 10)
