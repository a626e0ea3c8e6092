"""The columnar device layout of a batch's sampling tensors: contiguous, one block, one copy.

A batch of ``bs`` requests lands as one int32 block of ``COLUMN_WORDS * bs`` words:

    [0, bs)      temperature (float32 bits)   -> temperatures [bs, 1]
    [bs, 2bs)    top_p (float32 bits)         -> top_ps [bs]
    [2bs, 3bs)   top_k (int32)                -> top_ks [bs]
    [3bs, 4bs)   min_p (float32 bits)         -> min_ps [bs]
    [4bs, 6bs)   seed (int64)                 -> sampling_seed [bs]

Every tensor is a contiguous view with sglang's shape and dtype (FlashInfer's sampling
ops and other kernels expect contiguous inputs). The host fills the block from the
joined 32-byte records with two numpy copies (a 4-column transpose and the seed column).
"""

from __future__ import annotations

import weakref
from typing import Any

import numpy as np
import torch

from pinpool import PinnedRingBuffer
from pinpool.cache import BoundedCache
from sampling.params import RECORD_DTYPE

#: int32 words per request in the block.
COLUMN_WORDS = 6
_RECORD_BYTES = RECORD_DTYPE.itemsize
_SEED_OFFSET = 16
# The record's first four 32-bit words are temperature, top_p, top_k, min_p; its seed
# is the third 64-bit word. Checked here, as the transpose below relies on it.
assert [RECORD_DTYPE.fields[n][1] for n in ("temperature", "top_p", "top_k", "min_p", "seed")] == [0, 4, 8, 12, 16]  # type: ignore[index]

Columns = tuple[torch.Tensor, torch.Tensor, torch.Tensor, torch.Tensor, torch.Tensor]
#: The block cut into its five int32 pieces (temperature, top_p, top_k, min_p, seed words):
#: ``concat_parts`` joins two batches' pieces in one call.
Parts = tuple[torch.Tensor, torch.Tensor, torch.Tensor, torch.Tensor, torch.Tensor]


def write_columns(host: np.ndarray[Any, Any], joined: bytes | np.ndarray[Any, Any], bs: int) -> None:
    """Fill ``host`` (int32 [6 * bs], 8-byte aligned) from ``bs`` joined records (bytes, or a
    contiguous RECORD_DTYPE array): two strided copies.

    The sources are strided views of the joined bytes made in one call each, so a small
    batch pays few numpy calls: two copies whatever the batch size, where a packed layout
    would need one memmove.
    """
    quad = np.ndarray((4, bs), np.int32, joined, 0, (4, _RECORD_BYTES))  # temperature..min_p, transposed
    seeds = np.ndarray((bs,), np.int64, joined, _SEED_OFFSET, (_RECORD_BYTES,))
    host[: 4 * bs].reshape(4, bs)[:] = quad
    host[4 * bs :].view(np.int64)[:] = seeds


def views(block: torch.Tensor, bs: int) -> Columns:
    """(temperatures [bs, 1], top_ps, top_ks, min_ps, seeds), each a contiguous view of ``block``."""
    return parts_and_views(block, bs)[1]


def parts_and_views(block: torch.Tensor, bs: int) -> tuple[Parts, Columns]:
    """The block's ``Parts`` and its ``views``, cut by one call."""
    # One call cuts the five columns; the dtype views are the dearest calls left.
    parts = block.split_with_sizes((bs, bs, bs, bs, 2 * bs))
    temperature, top_p, top_k, min_p, seeds = parts
    f32 = torch.float32
    return parts, (temperature.view(f32).view(bs, 1), top_p.view(f32), top_k, min_p.view(f32), seeds.view(torch.int64))  # type: ignore[return-value]


# Ring-staged blocks of the same batch size land at the same slot offsets lap after lap:
# their views are the same memory, so they are built once. Keyed by the block's address
# and batch size; only ring memory (owned by the pool for its whole life) is cached,
# never owned buffers, whose addresses the allocator reuses. The table lives as long as
# its pool (weak key) and follows the pool's one cache rule (``BoundedCache``).
_RING_VIEWS: weakref.WeakKeyDictionary[PinnedRingBuffer, BoundedCache[tuple[int, int], tuple[Parts, Columns]]] = (
    weakref.WeakKeyDictionary()
)


def ring_views(block: torch.Tensor, bs: int, pool: PinnedRingBuffer) -> tuple[Parts, Columns]:
    """``parts_and_views`` of a block in a ring slot, reusing the view objects of earlier laps."""
    cache = _RING_VIEWS.get(pool)
    if cache is None:
        cache = _RING_VIEWS[pool] = BoundedCache()
    key = (block.data_ptr(), bs)
    hit = cache.get(key)
    if hit is None:
        hit = cache.put(key, parts_and_views(block, bs))
    return hit


def select_parts(block: torch.Tensor, parts: Parts, bs: int, keep: torch.Tensor) -> tuple[torch.Tensor, Parts, Columns]:
    """A new block of the rows ``keep`` (int64 [k] on the device), given the block's ``Parts``: (the
    new block, its parts, its views); two gathers, no host read. The new block is cut first, and
    the seeds gathered straight into their int64 view (a 1-D int64 gather: half the cost of
    gathering them as int32 word pairs)."""
    # The four 32-bit rows as one strided view (``as_strided``, at the block's own storage
    # offset: a ring block starts inside its slot) rather than a slice and a reshape, which
    # measured several times dearer for these small tensors.
    k = keep.shape[0]
    out = block.new_empty(COLUMN_WORDS * k)  # same dtype and device, without building a device object
    new_parts, new_views = parts_and_views(out, k)
    torch.index_select(block.as_strided((4, bs), (bs, 1)), 1, keep, out=out.as_strided((4, k), (k, 1)))
    torch.index_select(parts[4].view(torch.int64), 0, keep, out=new_views[4])
    return out, new_parts, new_views


def concat_parts(a: Parts, b: Parts) -> torch.Tensor:
    """A new block of a's rows followed by b's, given as their ``Parts``: one join of the ten pieces,
    each column's rows of a then of b."""
    return torch.cat((a[0], b[0], a[1], b[1], a[2], b[2], a[3], b[3], a[4], b[4]))
