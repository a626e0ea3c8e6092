"""``Sampler``: next-token ids from logits and a ``SamplingBatchInfo``, with no host sync.

Semantics follow sglang's torch sampling path: divide by temperature, softmax, then
top-k, top-p and min-p applied together on the sorted probabilities. Random draws use
the exponential race (argmax of p / Exp(1)), which needs no renormalisation and no
``multinomial`` (whose CUDA path can validate on the host). Deterministic sampling uses
Gumbel-max with noise hashed from (seed, position, token id): a request's token depends
only on its own seed, position and probabilities, never on its batch neighbours.

Poisoned rows: every path returns token 0 for a row with no distribution, that is a NaN
or +inf logit, or every logit -inf (after bias and temperature): the rule of
``sampling.draw``, held here for the greedy and unseeded paths too. Each path checks one
value per row that is non-finite exactly then (the greedy argmax's logit, where argmax
takes NaN as the largest; the top sorted probability, as softmax makes such a row NaN), so
healthy rows pay a [bs]-sized select, not another pass over the vocabulary.
"""

from __future__ import annotations

import torch

from pinpool.landing import land
from sampling.batch_info import SamplingBatchInfo
from sampling.draw import POISONED_TOKEN, SamplingTensors, draw_reference, filter_sorted_probs, launch_draw_sorted
from sampling.exceptions import BatchMismatchError


class Sampler:
    """Picks one token per row. Stateless apart from an optional torch Generator."""

    def __init__(self, generator: torch.Generator | None = None, *, use_kernel: bool = True) -> None:
        self.generator = generator
        #: Deterministic draws on CUDA go through one Triton kernel (``sampling.draw``);
        #: False keeps the eager torch path, for comparison.
        self.use_kernel = use_kernel

    def __call__(
        self,
        logits: torch.Tensor,
        info: SamplingTensors,
        positions: torch.Tensor | None = None,
        *,
        land_to: torch.Tensor | None = None,
    ) -> torch.Tensor:
        """int64 [bs] token ids. ``positions`` (int64 [bs]) is required when ``info.deterministic``.

        ``land_to``: int64 [bs] pinned host addresses from a stage's landing
        (``pinpool.Stage.land``): each token is also stored there, so the caller reads it
        after the stage's fence with no read-back copy. The draw kernel stores it itself;
        the other paths launch ``pinpool.landing.land`` after the draw.
        """
        bs = len(info)
        if logits.dim() != 2 or logits.shape != (bs, info.vocab_size):
            raise BatchMismatchError(f"'logits' must be shape ({bs}, {info.vocab_size}) (got {tuple(logits.shape)})")
        if logits.device != info.device:
            raise BatchMismatchError(f"'logits' must be on {info.device} (got {logits.device})")
        if info.deterministic and (positions is None or positions.shape != (bs,)):
            got = None if positions is None else tuple(positions.shape)
            raise BatchMismatchError(f"'positions' must be shape ({bs},) for deterministic sampling (got {got})")
        if land_to is not None and (
            land_to.dtype != torch.int64
            or land_to.shape != (bs,)
            or land_to.device != logits.device
            or not land_to.is_contiguous()
        ):
            raise BatchMismatchError(
                f"'land_to' must be contiguous torch.int64 ({bs},) on {logits.device} (got {land_to.dtype} "
                f"{tuple(land_to.shape)} on {land_to.device})"
            )
        info.check_live()
        if isinstance(info, SamplingBatchInfo) and info.sparse_logit_bias is not None:
            # Sparse entries, one kernel, on a float32 copy (the caller's logits stay as they are).
            logits = info.sparse_logit_bias.apply(logits.to(torch.float32, copy=True))
        elif info.logit_bias is not None:
            logits = logits.float() + info.logit_bias
        else:
            logits = logits.float()
        if info.is_all_greedy:
            top = logits.argmax(dim=-1, keepdim=True)
            return _landed(_poisoned_to_token(top.squeeze(1), logits.gather(1, top).squeeze(1)), land_to)
        probs = torch.softmax(logits / info.temperatures, dim=-1)
        if info.sampling_seed is not None:
            assert positions is not None
            probs_sort, probs_idx = probs.sort(dim=-1, descending=True, stable=True)
            if probs.is_cuda and self.use_kernel:
                return launch_draw_sorted(probs_sort, probs_idx, info, positions, land_to)
            return _landed(draw_reference(probs_sort, probs_idx, info, positions), land_to)
        probs_sort, probs_idx = filter_sorted_probs(probs, info)
        race = torch.empty_like(probs_sort).exponential_(generator=self.generator)
        rank = (probs_sort / race).argmax(dim=-1, keepdim=True)
        return _landed(_poisoned_to_token(probs_idx.gather(1, rank).squeeze(1), probs[:, 0]), land_to)


def _poisoned_to_token(tokens: torch.Tensor, witness: torch.Tensor) -> torch.Tensor:
    """``tokens`` with ``POISONED_TOKEN`` where the row's ``witness`` value is not finite (module doc)."""
    return tokens.masked_fill_(~torch.isfinite(witness), POISONED_TOKEN)


def _landed(tokens: torch.Tensor, land_to: torch.Tensor | None) -> torch.Tensor:
    if land_to is not None:
        land(tokens, land_to)  # validates land_to against the tokens (typed errors)
    return tokens
