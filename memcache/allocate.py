"""Allocating a whole batch from both pools at once: both or neither."""

from __future__ import annotations

import torch

from memcache.exceptions import AllocationError
from memcache.kv_allocator import TokenToKVPoolAllocator
from memcache.req_to_token import ReqToTokenPool


def allocate_extend(
    req_to_token_pool: ReqToTokenPool, kv_allocator: TokenToKVPoolAllocator, num_reqs: int, num_tokens: int
) -> tuple[list[int], torch.Tensor]:
    """Rows for ``num_reqs`` requests and ``num_tokens`` KV slots.

    Both counts are checked before either pool changes, so a batch that cannot be
    served leaves no half-allocated state behind.
    """
    # The counts' types and signs first: each pool checks its own, but a refusal by the
    # second one would come after the first had already handed out its rows.
    for name, value in (("num_reqs", num_reqs), ("num_tokens", num_tokens)):
        if isinstance(value, bool) or not isinstance(value, int) or value < 0:
            raise AllocationError(f"'{name}' must be an int >= 0 (got {value!r}); nothing was allocated")
    rows_free, slots_free = req_to_token_pool.available_size(), kv_allocator.available_size()
    if num_reqs > rows_free or num_tokens > slots_free:
        raise AllocationError(
            f"batch needs {num_reqs} rows and {num_tokens} KV slots but {rows_free} rows and {slots_free} "
            "slots are free; nothing was allocated"
        )
    return req_to_token_pool.alloc(num_reqs), kv_allocator.alloc(num_tokens)
