"""A request's filtered support and seeded token do not depend on its batch neighbours.

The hazard: once any row turns the batch's top-p filter on, a ``top_p = 1`` row went
through the cumsum comparison too, and float32 rounding of its running mass (which can
pass 1.0 before the tail) dropped its tail tokens. sglang shows the same effect.
"""

from __future__ import annotations

import os

import pytest
import torch

from pinpool import PinnedRingBuffer, PoolSettings
from sampling import Sampler, SamplingBatchInfo, SamplingParams, draw_reference, launch_draw_sorted, mask_sorted_probs
from tests.fakes import Batch, Req

VOCAB = 4097
TARGET = SamplingParams(temperature=1.0, seed=-77)  # top_p 1, no top-k, no min-p; a negative seed
NEIGHBOURS = {
    "top-p": SamplingParams(top_p=0.5, seed=1),
    "top-k": SamplingParams(top_k=5, seed=2),
    "min-p": SamplingParams(min_p=0.1, seed=3),
    "all three": SamplingParams(top_p=0.3, top_k=9, min_p=0.05, seed=4),
}
needs_interpreter = pytest.mark.skipif(
    os.environ.get("TRITON_INTERPRET") != "1",
    reason="Triton compiles for the GPU on this machine; tests/gpu checks the kernel on the device",
)


def build(params: list[SamplingParams]) -> SamplingBatchInfo:
    pool = PinnedRingBuffer(PoolSettings(device="cpu", num_slots=2, slot_bytes=1 << 18))
    return SamplingBatchInfo.from_schedule_batch(
        Batch([Req(p) for p in params]), VOCAB, pool, owned=True, deterministic=True
    )


def rounding_row() -> torch.Tensor:
    """Logits whose float32 sorted cumsum passes 1.0 before the last tokens (checked below)."""
    return torch.randn(VOCAB, generator=torch.Generator().manual_seed(3)) * 2.0


def test_the_row_really_trips_the_rounding() -> None:
    """Guards the tests below: without a row whose running mass passes 1.0 they could not fail."""
    probs = torch.softmax(rounding_row(), -1).sort(descending=True).values
    assert int(((probs.cumsum(-1) - probs) > 1.0).sum()) > 0


@pytest.mark.parametrize("neighbour", list(NEIGHBOURS))
def test_support_and_token_alone_equal_those_next_to_a_filtering_neighbour(neighbour: str) -> None:
    """Catches a top_p = 1 row losing tail tokens (or drawing another token) once a neighbour
    turns a filter on for the batch."""
    alone = build([TARGET])
    mixed = build([NEIGHBOURS[neighbour], TARGET])
    logits = rounding_row()
    batch_logits = torch.stack([torch.randn(VOCAB, generator=torch.Generator().manual_seed(9)), logits])
    probs_sort = torch.softmax(logits, -1).sort(descending=True, stable=True).values
    support_alone = mask_sorted_probs(probs_sort[None], alone)[0]
    batch_sort = torch.softmax(batch_logits, -1).sort(dim=-1, descending=True, stable=True).values
    support_mixed = mask_sorted_probs(batch_sort, mixed)[1]
    assert torch.equal(support_alone > 0, support_mixed > 0)
    assert int((support_mixed > 0).sum()) == int((probs_sort > 0).sum())  # every token kept
    for pos in range(8):
        a = Sampler()(logits[None], alone, torch.tensor([pos]))
        m = Sampler()(batch_logits, mixed, torch.tensor([0, pos]))
        assert int(a[0]) == int(m[1])


@needs_interpreter
@pytest.mark.parametrize("draw", ["kernel", "reference"])
def test_top_p_one_keeps_every_token_whatever_the_running_sum(draw: str) -> None:
    """Catches the draw kernel (or its reference) cutting a top_p = 1 row where its running sum
    passes 1.0: here 300 equal probabilities of 1.0 each, so every token must stay a candidate
    and the seeded token must not change when a top-p neighbour turns the filter on."""
    vocab = 300
    probs_sort = torch.ones(2, vocab)
    probs_idx = torch.stack([torch.randperm(vocab, generator=torch.Generator().manual_seed(r)) for r in range(2)])
    pool = PinnedRingBuffer(PoolSettings(device="cpu", num_slots=2, slot_bytes=1 << 16))

    def info(first: SamplingParams) -> SamplingBatchInfo:
        reqs = Batch([Req(first), Req(TARGET)])
        return SamplingBatchInfo.from_schedule_batch(reqs, vocab, pool, owned=True, deterministic=True)

    run = launch_draw_sorted if draw == "kernel" else draw_reference
    quiet, filtering = info(SamplingParams(seed=5)), info(SamplingParams(top_p=0.5, seed=5))
    assert not quiet.need_top_p_sampling and filtering.need_top_p_sampling
    tokens = set()
    for pos in range(12):
        positions = torch.tensor([0, pos])
        want = run(probs_sort, probs_idx, quiet, positions)[1]
        got = run(probs_sort, probs_idx, filtering, positions)[1]
        assert int(want) == int(got)
        tokens.add(int(got))
    # Cut after the first two sorted positions, the row could only draw those two token ids.
    assert len(tokens - set(probs_idx[1, :2].tolist())) > 0
