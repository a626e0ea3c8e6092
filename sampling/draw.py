"""The deterministic draw: filter sorted probabilities, add hashed Gumbel noise, take the argmax.

``draw_sorted`` is one Triton program per request that walks the row's probabilities in
sorted order, applies top-p, top-k and min-p as ``filter_sorted_probs`` does, hashes
(seed, position, token id) into Gumbel noise and keeps the best token. Eagerly, the same
draw is about thirty launches (scatter, the hash's shifts and multiplies, two logs, an
argmax): on a decode step that is host time the GPU waits for. ``draw_reference`` is
that torch path, kept for CPU tensors and as the kernel's oracle.

Poisoned rows: **a row with any non-finite probability draws token 0**, in the kernel, the
reference and the landing. Softmax makes a whole row NaN when a logit is NaN or +inf or
every logit is -inf, so such a row has no distribution to sample; token 0 is a fixed,
in-range answer that costs the healthy rows nothing (the sampler's other paths follow the
same rule, ``sampling.sampler``). A row whose filters leave nothing (all-zero input) also
draws token 0.

Noise: 63 hash bits make ``v``, the complement of the uniform, in float32 (dense near 0,
where the largest noise comes from); ``E = -log(1 - v)`` is taken with the rounding error
of ``1 - v`` added back, and the Gumbel noise is ``-log(E)``. It reaches about 44 and
follows the Gumbel tail to float32 precision up to there, so a token 30 nats below the
top still wins at its probability. Built only from IEEE adds, multiplies and ``log``, the
kernel and the reference compute the same values.

Ties: both pick the smallest token id among equal scores. The two may still differ where
a float sum lands within a rounding step of a top-p threshold below 1, because the
kernel's running sum adds in a different order than torch's cumsum.

Batch-independence: a row with ``top_p == 1`` keeps every token. Its float32 running sum
can pass 1.0 before the tail (rounding), so comparing it with 1.0 would drop tail tokens
once a neighbour turns the top-p filter on for the batch; both paths skip the comparison
for such rows, and a row's support never depends on its neighbours.
"""

from __future__ import annotations

import os
from typing import Protocol

import torch
import triton
import triton.language as tl
from triton.language.extra import libdevice

from pinpool.landing import store_landed
from sampling.bias_kernel import on_device
from sampling.exceptions import BatchMismatchError


class SamplingTensors(Protocol):
    """What the sampler reads: ``SamplingBatchInfo`` or any batch with the same tensors."""

    temperatures: torch.Tensor  # float32 [bs, 1]
    top_ps: torch.Tensor  # float32 [bs]
    top_ks: torch.Tensor  # int32 [bs]
    min_ps: torch.Tensor  # float32 [bs]
    sampling_seed: torch.Tensor | None  # int64 [bs]
    vocab_size: int
    deterministic: bool
    is_all_greedy: bool
    need_top_p_sampling: bool
    need_top_k_sampling: bool
    need_min_p_sampling: bool

    def __len__(self) -> int: ...

    @property
    def logit_bias(self) -> torch.Tensor | None: ...  # float32 [bs, vocab] (dense) or None

    @property
    def device(self) -> torch.device: ...

    def check_live(self) -> None: ...


BLOCK = 1024
NOISE_BITS = 63  # hash bits per noise value; see exponential_from_bits
V_SCALE = 2.0**-NOISE_BITS  # a power of two: the scaling is exact in float32
V_MAX = 1.0 - 2.0**-24  # the largest float32 below 1
POISONED_TOKEN = 0  # what a row with a non-finite probability draws (module doc)
_NO_TOKEN = tl.constexpr(1 << 62)  # constexpr: a jit function may read only constexpr globals
_POISONED_TOKEN = tl.constexpr(POISONED_TOKEN)

# Odd 63-bit multipliers for the counter hash (int64 arithmetic wraps identically on
# CPU and CUDA, so the noise is the same function on both).
_SEED_MUL = 0x5851F42D4C957F2D
_POS_MUL = 0x14057B7EF767814F
_TOKEN_MUL = 0x2545F4914F6CDD1D
_MIX_A = 0x3F58476D1CE4E5B9
_MIX_B = 0x14D049BB133111EB


def _shr(x: torch.Tensor, k: int) -> torch.Tensor:
    """Logical right shift of int64 (torch's >> is arithmetic)."""
    return (x >> k) & ((1 << (64 - k)) - 1)


def _mix(x: torch.Tensor) -> torch.Tensor:
    x = x ^ _shr(x, 30)
    x = x * _MIX_A
    x = x ^ _shr(x, 27)
    x = x * _MIX_B
    return x ^ _shr(x, 31)


def hashed_bits(seeds: torch.Tensor, positions: torch.Tensor, vocab_size: int) -> torch.Tensor:
    """int64 [bs, vocab] in [0, 2**63): a pure function of (seed, position, token id)."""
    key = _mix(seeds.to(torch.int64) * _SEED_MUL + positions.to(torch.int64) * _POS_MUL)
    tokens = torch.arange(vocab_size, device=seeds.device, dtype=torch.int64) * _TOKEN_MUL
    return _shr(_mix(key[:, None] + tokens[None, :]), 64 - NOISE_BITS)


def exponential_from_bits(bits: torch.Tensor) -> torch.Tensor:
    """float32 Exp(1) draws ``E = -log(1 - v)`` from bits uniform in [0, 2**63).

    The largest Gumbel noise, ``-log(E)``, comes from ``u = 1 - v`` near 1, where float32
    has no resolution (a 23-bit uniform capped the noise at 16.6). So build ``v`` instead:
    float32 is dense near 0, and ``(bits + 0.5) * 2**-63`` keeps about 24 significant bits
    down to 2**-64, noise up to about 44. ``u = 1 - v`` then rounds, but its rounding
    error ``(1 - u) - v`` is exact (``u`` lies in [0.5, 1], so ``1 - u`` is exact, and
    the Fast2Sum error term is), and ``log(1 - v) = log(u) + ((1 - u) - v)`` up to a
    relative error of about 2**-25: a compensated log1p without a division, whose
    rounding Triton and torch share. ``v`` is capped below 1 (bits within 2**-25 of the
    top round to 1.0, whose log is -inf); that moves a 2**-25 slice of the lowest noise
    by a hundredth, which no draw can see.
    """
    v = ((bits.to(torch.float32) + 0.5) * V_SCALE).clamp_(max=V_MAX)
    u = 1.0 - v
    return -(torch.log(u) + ((1.0 - u) - v))


def hashed_gumbel(seeds: torch.Tensor, positions: torch.Tensor, vocab_size: int) -> torch.Tensor:
    """float32 [bs, vocab]: the draw's Gumbel noise ``-log(E)``, finite, about -2.8 to 44."""
    return -torch.log(exponential_from_bits(hashed_bits(seeds, positions, vocab_size)))


def hashed_uniform(seeds: torch.Tensor, positions: torch.Tensor, vocab_size: int) -> torch.Tensor:
    """float64 [bs, vocab]: the uniform ``u = exp(-E)`` behind ``hashed_gumbel``, for diagnostics.

    ``-log(-log(u))`` gives the draw's noise to float64 precision; near ``u = 1`` (noise
    above about 30) that precision runs out, so the draw itself never goes through ``u``.
    """
    return torch.exp(-exponential_from_bits(hashed_bits(seeds, positions, vocab_size)).double())


def filter_sorted_probs(probs: torch.Tensor, info: SamplingTensors) -> tuple[torch.Tensor, torch.Tensor]:
    """Sort each row descending and zero what top-k, top-p and min-p exclude.

    Returns (filtered sorted probabilities, their token ids).
    """
    probs_sort, probs_idx = probs.sort(dim=-1, descending=True, stable=True)
    return mask_sorted_probs(probs_sort, info), probs_idx


def mask_sorted_probs(probs_sort: torch.Tensor, info: SamplingTensors) -> torch.Tensor:
    """Zero what top-k, top-p and min-p exclude from rows sorted descending.

    The top token always survives: top-p keeps a token whose preceding mass is <= top_p,
    min-p compares with the top probability, and top_k >= 1.
    """
    if info.need_top_p_sampling:
        mass_before = probs_sort.cumsum(dim=-1) - probs_sort
        # top_p == 1 rows keep everything: their rounded cumsum may exceed 1.0 (module doc).
        cut = (mass_before > info.top_ps[:, None]) & (info.top_ps < 1.0)[:, None]
        probs_sort = probs_sort.masked_fill(cut, 0.0)
    if info.need_top_k_sampling:
        ranks = torch.arange(probs_sort.shape[-1], device=probs_sort.device)
        probs_sort = probs_sort.masked_fill(ranks[None, :] >= info.top_ks[:, None], 0.0)
    if info.need_min_p_sampling:
        floor = probs_sort[:, :1] * info.min_ps[:, None]
        probs_sort = probs_sort.masked_fill(probs_sort < floor, 0.0)
    return probs_sort


def draw_reference(
    probs_sort: torch.Tensor, probs_idx: torch.Tensor, info: SamplingTensors, positions: torch.Tensor
) -> torch.Tensor:
    """int64 [bs]: the draw in plain torch (``probs_sort``/``probs_idx`` as ``sort`` returns them)."""
    assert info.sampling_seed is not None
    kept = mask_sorted_probs(probs_sort, info)
    dense = torch.zeros_like(kept).scatter_(1, probs_idx, kept)
    score = torch.log(dense) + hashed_gumbel(info.sampling_seed, positions, info.vocab_size)
    # The kernel keeps only p > 0: NaN and negative inputs must not reach argmax (NaN wins it).
    score = score.masked_fill_(~(dense > 0.0), float("-inf"))
    poisoned = ~torch.isfinite(probs_sort).all(dim=-1)
    return score.argmax(dim=-1).masked_fill_(poisoned, POISONED_TOKEN)


@triton.jit
def _log_compiled(x):
    # libdevice's logf, the function torch.log runs on CUDA. tl.log lowers to the
    # approximate lg2, whose absolute error near 1 swamps -log(u) for u close to 1: the
    # largest Gumbel draws, the ones that win. Measured: tokens differed from torch's.
    return libdevice.log(x)


@triton.jit
def _log_interpreted(x):
    return tl.log(x)  # the interpreter runs numpy's log (libdevice has no interpreter twin)


# Chosen once at import, as @triton.jit reads TRITON_INTERPRET at decoration time.
_log = _log_interpreted if os.environ.get("TRITON_INTERPRET", "0") == "1" else _log_compiled


@triton.jit
def _shr_tl(x, k: tl.constexpr):
    return (x >> k) & ((1 << (64 - k)) - 1)


@triton.jit
def _mix_tl(x):
    x = x ^ _shr_tl(x, 30)
    x = x * 0x3F58476D1CE4E5B9
    x = x ^ _shr_tl(x, 27)
    x = x * 0x14D049BB133111EB
    return x ^ _shr_tl(x, 31)


@triton.jit
def _draw_sorted_kernel(
    probs_ptr,  # float32 [bs, vocab], each row sorted descending
    idx_ptr,  # int64 [bs, vocab]: token id of each sorted probability
    top_p_ptr,  # float32 [bs], stride top_p_stride (a column of the packed records)
    top_k_ptr,  # int32 [bs], stride top_k_stride
    min_p_ptr,  # float32 [bs], stride min_p_stride
    seed_ptr,  # int64 [bs], stride seed_stride
    pos_ptr,  # int64 [bs], stride pos_stride
    out_ptr,  # int64 [bs]
    land_ptr,  # int64 [bs]: pinned host address each row's token is also stored at (0: none); LAND only
    vocab,
    top_p_stride,
    top_k_stride,
    min_p_stride,
    seed_stride,
    pos_stride,
    TOP_P: tl.constexpr,
    TOP_K: tl.constexpr,
    MIN_P: tl.constexpr,
    LAND: tl.constexpr,
    BLOCK: tl.constexpr,
):
    row = tl.program_id(0).to(tl.int64)
    base = row * vocab
    # Loaded as vectors so the hash's wrapping int64 products are array arithmetic in the
    # interpreter too (scalar numpy products warn on overflow).
    lanes = tl.zeros([BLOCK], tl.int64)
    seed = tl.load(seed_ptr + row * seed_stride + lanes)
    pos = tl.load(pos_ptr + row * pos_stride + lanes)
    key = _mix_tl(seed * 0x5851F42D4C957F2D + pos * 0x14057B7EF767814F)
    top_p = tl.load(top_p_ptr + row * top_p_stride)
    top_p = tl.where(top_p >= 1.0, float("inf"), top_p)  # top_p 1 keeps every token (module doc)
    top_k = tl.load(top_k_ptr + row * top_k_stride).to(tl.int64)
    floor = tl.load(probs_ptr + base) * tl.load(min_p_ptr + row * min_p_stride)
    carry = tl.zeros([BLOCK], tl.float32).sum(0)  # mass of the blocks before this one
    best_score = tl.full([BLOCK], float("-inf"), tl.float32).max(0)
    best_token = tl.full([BLOCK], _NO_TOKEN, tl.int64).min(0)
    poisoned = tl.zeros([BLOCK], tl.int32).max(0)
    # A while-loop with a runtime bound: Triton 3.6's interpreter (CI) needs it that way.
    start = vocab * 0
    while start < vocab:
        offs = start + tl.arange(0, BLOCK)
        inside = offs < vocab
        p = tl.load(probs_ptr + base + offs, mask=inside, other=0.0)
        token = tl.load(idx_ptr + base + offs, mask=inside, other=0)
        keep = inside & (p > 0.0)
        if TOP_P:
            mass_before = carry + tl.cumsum(p, 0) - p
            keep = keep & (mass_before <= top_p)
            carry += tl.sum(p, 0)
        if TOP_K:
            keep = keep & (offs < top_k)
        if MIN_P:
            keep = keep & (p >= floor)
        # Non-finite inputs flag the row (module doc); the padding lanes load 0.0.
        poisoned = tl.maximum(poisoned, tl.max(tl.where(tl.abs(p) < float("inf"), 0, 1), 0))
        # As exponential_from_bits, op for op: v from the top NOISE_BITS = 63 bits, then the
        # compensated -log(1 - v); no product of ours feeds an add, so no FMA forms where torch rounds twice.
        bits = _shr_tl(_mix_tl(key + token * 0x2545F4914F6CDD1D), 1)
        v = tl.minimum((bits.to(tl.float32) + 0.5) * 1.0842021724855044e-19, 0.9999999403953552)
        u = 1.0 - v
        e = -(_log(u) + ((1.0 - u) - v))
        score = tl.where(keep, _log(tl.where(keep, p, 1.0)) - _log(e), float("-inf"))
        block_best = tl.max(score, 0)
        block_token = tl.min(tl.where(keep & (score == block_best), token, _NO_TOKEN), 0)
        better = (block_best > best_score) | ((block_best == best_score) & (block_token < best_token))
        best_token = tl.where(better, block_token, best_token)
        best_score = tl.where(better, block_best, best_score)
        start += BLOCK
    # Rule of the module doc: a poisoned row, or one whose filters left nothing, draws token 0.
    best_token = tl.where((poisoned > 0) | (best_token == _NO_TOKEN), _POISONED_TOKEN, best_token)
    tl.store(out_ptr + row, best_token)
    if LAND:
        # A landing (``pinpool.Stage.land``): the token also goes straight into the step's
        # pinned slot, so no device-to-host copy is queued after the sampler.
        store_landed(tl.load(land_ptr + row), best_token, best_token == best_token)  # mask: always true


def launch_draw_sorted(
    probs_sort: torch.Tensor,
    probs_idx: torch.Tensor,
    info: SamplingTensors,
    positions: torch.Tensor,
    land_to: torch.Tensor | None = None,
) -> torch.Tensor:
    """Validate shapes, dtypes, devices and contiguity, then launch one program per request.

    ``land_to``: int64 [bs] pinned host addresses (``pinpool.Stage.land``) where each row's
    token is stored as well, by the same kernel.
    """
    if probs_sort.dtype != torch.float32 or probs_sort.dim() != 2 or not probs_sort.is_contiguous():
        raise BatchMismatchError(
            f"'probs_sort' must be contiguous float32 [bs, vocab] (got {probs_sort.dtype} {tuple(probs_sort.shape)})"
        )
    bs, vocab = probs_sort.shape
    if probs_idx.dtype != torch.int64 or probs_idx.shape != probs_sort.shape or not probs_idx.is_contiguous():
        raise BatchMismatchError(
            f"'probs_idx' must be contiguous int64 {tuple(probs_sort.shape)} (got {probs_idx.dtype} "
            f"{tuple(probs_idx.shape)})"
        )
    if info.sampling_seed is None:
        raise BatchMismatchError("'info.sampling_seed' must be set for the deterministic draw (got None)")
    rows: tuple[tuple[str, torch.Tensor, torch.dtype], ...] = (
        ("info.top_ps", info.top_ps, torch.float32),
        ("info.top_ks", info.top_ks, torch.int32),
        ("info.min_ps", info.min_ps, torch.float32),
        ("info.sampling_seed", info.sampling_seed, torch.int64),
        ("positions", positions, torch.int64),
    )
    if land_to is not None:
        rows += (("land_to", land_to, torch.int64),)
        if not land_to.is_contiguous():
            raise BatchMismatchError("'land_to' must be contiguous")
    for name, t, dtype in rows:
        if t.dtype != dtype or t.shape != (bs,) or t.device != probs_sort.device:
            raise BatchMismatchError(
                f"'{name}' must be {dtype} ({bs},) on {probs_sort.device} (got {t.dtype} "
                f"{tuple(t.shape)} on {t.device})"
            )
    out = torch.empty(bs, dtype=torch.int64, device=probs_sort.device)
    if bs == 0:
        return out
    with on_device(probs_sort.device):
        _launch_draw(probs_sort, probs_idx, info, positions, out, bs, vocab, land_to)
    return out


def _launch_draw(
    probs_sort: torch.Tensor,
    probs_idx: torch.Tensor,
    info: SamplingTensors,
    positions: torch.Tensor,
    out: torch.Tensor,
    bs: int,
    vocab: int,
    land_to: torch.Tensor | None = None,
) -> None:
    assert info.sampling_seed is not None  # checked by launch_draw_sorted
    _draw_sorted_kernel[(bs,)](
        probs_sort,
        probs_idx,
        info.top_ps,
        info.top_ks,
        info.min_ps,
        info.sampling_seed,
        positions,
        out,
        out if land_to is None else land_to,  # never read without LAND
        vocab,
        info.top_ps.stride(0),
        info.top_ks.stride(0),
        info.min_ps.stride(0),
        info.sampling_seed.stride(0),
        positions.stride(0),
        TOP_P=info.need_top_p_sampling,
        TOP_K=info.need_top_k_sampling,
        MIN_P=info.need_min_p_sampling,
        LAND=land_to is not None,
        BLOCK=BLOCK,
    )
