"""``Sampler``: next-token ids from logits and a ``SamplingBatchInfo``, with no host sync.

Semantics follow sglang's torch sampling path: divide by temperature, softmax, then
top-k, top-p and min-p applied together on the sorted probabilities. Random draws use
the exponential race (argmax of p / Exp(1)), which needs no renormalisation and no
``multinomial`` (whose CUDA path can validate on the host). Deterministic sampling uses
Gumbel-max with noise hashed from (seed, position, token id): a request's token depends
only on its own seed, position and probabilities, never on its batch neighbours.
"""

from __future__ import annotations

from typing import Protocol

import torch

from sampling.exceptions import BatchMismatchError


class SamplingTensors(Protocol):
    """What the sampler reads: ``SamplingBatchInfo`` or any batch with the same tensors."""

    temperatures: torch.Tensor  # float32 [bs, 1]
    top_ps: torch.Tensor  # float32 [bs]
    top_ks: torch.Tensor  # int32 [bs]
    min_ps: torch.Tensor  # float32 [bs]
    sampling_seed: torch.Tensor | None  # int64 [bs]
    logit_bias: torch.Tensor | None  # float32 [bs, vocab]
    vocab_size: int
    deterministic: bool
    is_all_greedy: bool
    need_top_p_sampling: bool
    need_top_k_sampling: bool
    need_min_p_sampling: bool

    def __len__(self) -> int: ...

    @property
    def device(self) -> torch.device: ...

    def check_live(self) -> None: ...


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


def hashed_uniform(seeds: torch.Tensor, positions: torch.Tensor, vocab_size: int) -> torch.Tensor:
    """float32 [bs, vocab] in (0, 1): a pure function of (seed, position, token id)."""
    key = _mix(seeds.to(torch.int64) * _SEED_MUL + positions.to(torch.int64) * _POS_MUL)
    tokens = torch.arange(vocab_size, device=seeds.device, dtype=torch.int64) * _TOKEN_MUL
    bits = _shr(_mix(key[:, None] + tokens[None, :]), 40)  # top 24 bits: exact in float32
    return (bits.to(torch.float32) + 0.5) * (1.0 / (1 << 24))


def filter_sorted_probs(probs: torch.Tensor, info: SamplingTensors) -> tuple[torch.Tensor, torch.Tensor]:
    """Sort each row descending and zero what top-k, top-p and min-p exclude.

    Returns (filtered sorted probabilities, their token ids). The top token always
    survives: top-p keeps a token whose preceding mass is <= top_p, min-p compares with
    the top probability, and top_k >= 1.
    """
    probs_sort, probs_idx = probs.sort(dim=-1, descending=True, stable=True)
    if info.need_top_p_sampling:
        mass_before = probs_sort.cumsum(dim=-1) - probs_sort
        probs_sort = probs_sort.masked_fill(mass_before > info.top_ps[:, None], 0.0)
    if info.need_top_k_sampling:
        ranks = torch.arange(probs.shape[-1], device=probs.device)
        probs_sort = probs_sort.masked_fill(ranks[None, :] >= info.top_ks[:, None], 0.0)
    if info.need_min_p_sampling:
        floor = probs_sort[:, :1] * info.min_ps[:, None]
        probs_sort = probs_sort.masked_fill(probs_sort < floor, 0.0)
    return probs_sort, probs_idx


class Sampler:
    """Picks one token per row. Stateless apart from an optional torch Generator."""

    def __init__(self, generator: torch.Generator | None = None) -> None:
        self.generator = generator

    def __call__(
        self, logits: torch.Tensor, info: SamplingTensors, positions: torch.Tensor | None = None
    ) -> torch.Tensor:
        """int64 [bs] token ids. ``positions`` (int64 [bs]) is required when ``info.deterministic``."""
        bs = len(info)
        if logits.dim() != 2 or logits.shape != (bs, info.vocab_size):
            raise BatchMismatchError(f"'logits' must be shape ({bs}, {info.vocab_size}) (got {tuple(logits.shape)})")
        if logits.device != info.device:
            raise BatchMismatchError(f"'logits' must be on {info.device} (got {logits.device})")
        if info.deterministic and (positions is None or positions.shape != (bs,)):
            got = None if positions is None else tuple(positions.shape)
            raise BatchMismatchError(f"'positions' must be shape ({bs},) for deterministic sampling (got {got})")
        info.check_live()
        logits = logits.float()
        if info.logit_bias is not None:
            logits = logits + info.logit_bias
        if info.is_all_greedy:
            return logits.argmax(dim=-1)
        probs = torch.softmax(logits / info.temperatures, dim=-1)
        probs_sort, probs_idx = filter_sorted_probs(probs, info)
        if info.sampling_seed is not None:
            assert positions is not None
            dense = torch.zeros_like(probs).scatter_(1, probs_idx, probs_sort)
            noise = hashed_uniform(info.sampling_seed, positions, info.vocab_size)
            gumbel = -torch.log(-torch.log(noise))
            return (torch.log(dense) + gumbel).argmax(dim=-1)
        race = torch.empty_like(probs_sort).exponential_(generator=self.generator)
        rank = (probs_sort / race).argmax(dim=-1, keepdim=True)
        return probs_idx.gather(1, rank).squeeze(1)
