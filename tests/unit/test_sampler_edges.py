"""The sampler's documented edge choices (docs/sampler.md): poisoned rows, top-k ties, the
filter on non-finite rows, the empty bias, and the seeded noise's tail."""

from __future__ import annotations

import math
import random
from types import SimpleNamespace

import numpy as np
import pytest
import torch

from pinpool import PinnedRingBuffer, PoolSettings
from sampling import (
    TOP_K_ALL,
    Sampler,
    SamplingBatchInfo,
    SamplingParams,
    draw_reference,
    filter_sorted_probs,
    launch_draw_sorted,
)
from sampling.draw import NOISE_BITS, POISONED_TOKEN, exponential_from_bits, hashed_bits
from tests.fakes import Batch, Req

#: Allowed deviation of an empirical count from its expectation, in binomial standard
#: deviations (the issue's bar): a false alarm about once in 16,000 runs per check.
SIGMAS = 4.0
NAN, INF = float("nan"), float("inf")


def build(params: list[SamplingParams], vocab: int, deterministic: bool = False) -> SamplingBatchInfo:
    pool = PinnedRingBuffer(PoolSettings(device="cpu", num_slots=4, slot_bytes=1 << 20))
    return SamplingBatchInfo.from_schedule_batch(
        Batch([Req(p) for p in params]), vocab, pool, owned=True, deterministic=deterministic
    )


def poisoned_logits(vocab: int, device: torch.device | str = "cpu") -> tuple[torch.Tensor, list[bool]]:
    """Rows: healthy, a NaN logit, a +inf logit, all -inf, all NaN, healthy with -inf holes.

    The poison sits at token 7, never at token 0, so a path that returns the poisoned
    logit's own id (as argmax does) cannot pass for the rule.
    """
    gen = torch.Generator().manual_seed(vocab)
    logits = torch.randn(6, vocab, generator=gen) * 2.0
    logits[1, 7] = NAN
    logits[2, 7] = INF
    logits[3] = -INF
    logits[4] = NAN
    logits[5, ::3] = -INF  # -inf holes are ordinary: those tokens have probability 0
    return logits.to(device), [False, True, True, True, True, False]


@pytest.mark.parametrize("path", ["greedy", "unseeded", "seeded"])
@pytest.mark.parametrize("landed", [False, True], ids=["returned", "landed"])
def test_every_sampler_path_draws_token_zero_for_poisoned_rows(path: str, landed: bool) -> None:
    """Catches a path that hands the engine an id past the vocabulary, or the poisoned logit's own
    id, for a row with a NaN or +inf logit or only -inf ones, or one whose poisoned neighbour changes
    a healthy row's token (the rule of sampling/draw.py, on the sampler's three paths)."""
    vocab = 300
    logits, poisoned = poisoned_logits(vocab)
    temperature = 0.0 if path == "greedy" else 0.9
    seed = None if path == "unseeded" else 5
    info = build([SamplingParams(temperature=temperature, top_p=0.9, seed=seed)] * 6, vocab, path == "seeded")
    assert info.is_all_greedy == (path == "greedy")
    positions = torch.arange(6, dtype=torch.int64)
    host = torch.full((6,), -1, dtype=torch.int64)
    land_to = torch.tensor([host.data_ptr() + 8 * i for i in range(6)]) if landed else None
    tokens = Sampler(torch.Generator().manual_seed(3))(logits, info, positions, land_to=land_to)
    assert all(0 <= t < vocab for t in tokens.tolist())
    assert [t for t, bad in zip(tokens.tolist(), poisoned, strict=True) if bad] == [POISONED_TOKEN] * 4
    healthy = build([SamplingParams(temperature=temperature, top_p=0.9, seed=seed)] * 2, vocab, path == "seeded")
    alone = Sampler(torch.Generator().manual_seed(3))(logits[[0, 5]], healthy, positions[[0, 5]])
    if path != "unseeded":  # the unseeded race draws its noise per batch; the others must agree
        assert [tokens[0].item(), tokens[5].item()] == alone.tolist()
    if landed:
        assert host.tolist() == tokens.tolist()


def test_filter_passes_a_poisoned_row_through_as_nan_and_leaves_its_neighbours() -> None:
    """Catches a filter that repairs a poisoned row (a nan_to_num would make up a distribution from
    garbage and sample it) or lets it change a healthy neighbour's filtered probabilities."""
    vocab = 50
    logits, poisoned = poisoned_logits(vocab)
    info = build([SamplingParams(temperature=1.0, top_p=0.8, top_k=10, min_p=0.05)] * 6, vocab)
    probs = torch.softmax(logits / info.temperatures, dim=-1)
    filtered, _ = filter_sorted_probs(probs, info)
    for row, bad in enumerate(poisoned):
        nan = filtered[row].isnan()
        assert bool(nan.any()) == bad, row
        if bad:  # NaN wherever a filter keeps it (top-k zeros past k): no made-up probability
            assert bool(nan[0]) and bool((nan | (filtered[row] == 0)).all()), row
    alone, _ = filter_sorted_probs(
        probs[[0, 5]], build([SamplingParams(temperature=1.0, top_p=0.8, top_k=10, min_p=0.05)] * 2, vocab)
    )
    assert torch.equal(filtered[[0, 5]], alone)


def tied_logits(rows: int, vocab: int = 40) -> torch.Tensor:
    """Tokens 3, 5 and 9 tied on top, token 1 next, the rest far below."""
    logits = torch.full((rows, vocab), -8.0)
    logits[:, [3, 5, 9]] = 2.0
    logits[:, 1] = 1.0
    return logits


@pytest.mark.parametrize("path", ["unseeded", "seeded-reference", "seeded-kernel"])
def test_top_k_keeps_exactly_k_of_the_tied_tokens_lowest_ids_first(path: str) -> None:
    """Catches a top-k that keeps every token tied at the cut (newer sglang's choice, not
    pinpool's), keeps other tied tokens than the lowest ids, or keeps fewer than k."""
    n, vocab = (2000, 40) if path == "unseeded" else (64, 40)
    logits = tied_logits(n, vocab)
    params = [SamplingParams(temperature=1.0, top_k=2, seed=s) for s in range(n)]
    if path == "unseeded":
        tokens = Sampler(torch.Generator().manual_seed(1))(logits, build(params, vocab))
    else:
        info = build(params, vocab, deterministic=True)
        probs_sort, probs_idx = torch.softmax(logits, dim=-1).sort(dim=-1, descending=True, stable=True)
        draw = draw_reference if path == "seeded-reference" else launch_draw_sorted
        tokens = draw(probs_sort, probs_idx, info, torch.full((n,), 4, dtype=torch.int64))
    counts = np.bincount(tokens.numpy(), minlength=vocab)
    assert set(np.flatnonzero(counts).tolist()) == {3, 5}
    sigma = math.sqrt(n * 0.25)  # each of the two kept tokens has probability 1/2
    assert abs(counts[3] - n / 2) <= SIGMAS * sigma, counts[[3, 5, 9]]


def test_empty_logit_bias_is_no_bias() -> None:
    """Catches `logit_bias={}` turning into a bias that is applied (a dense zero row, a sparse entry
    or a different token): it is the same request as one without a bias, bit for bit."""
    vocab = 64
    logits = torch.randn(3, vocab, generator=torch.Generator().manual_seed(2))
    empty = build([SamplingParams(temperature=0.8, seed=9, logit_bias={})] * 3, vocab, deterministic=True)
    none = build([SamplingParams(temperature=0.8, seed=9)] * 3, vocab, deterministic=True)
    assert empty.logit_bias is None and empty.sparse_logit_bias is None
    applied = logits.clone()
    empty.apply_logits_bias(applied)
    assert torch.equal(applied, logits)
    assert torch.equal(applied, logits + torch.zeros(3, vocab))  # sglang's zero tensor: the same numbers
    positions = torch.arange(3, dtype=torch.int64)
    assert torch.equal(Sampler()(logits, empty, positions), Sampler()(logits, none, positions))
    mixed = build(
        [SamplingParams(temperature=0.8, seed=9, logit_bias={}), SamplingParams(logit_bias={4: 2.5})], vocab, True
    )
    assert mixed.logit_bias is not None
    assert mixed.logit_bias[0].abs().sum().item() == 0.0 and mixed.logit_bias[1, 4].item() == 2.5


def gumbel_tail(t: float) -> float:
    """P(G > t) for a standard Gumbel G, in float64 without cancellation."""
    return -math.expm1(-math.exp(-t))


def bits_above(t: float) -> int:
    """How many of the 2**63 bit patterns give noise -log(E) above ``t`` (the map is monotone)."""
    lo, hi = 0, 1 << NOISE_BITS  # noise(lo) > t >= noise(hi), noise decreasing in the bits
    while hi - lo > 1:
        mid = (lo + hi) // 2
        g = -torch.log(exponential_from_bits(torch.tensor([mid], dtype=torch.int64))).item()
        lo, hi = (mid, hi) if g > t else (lo, mid)
    return hi


@pytest.mark.parametrize("t", [-2.0, -1.0, 0.0, 2.0, 8.0, 16.0, 16.7, 20.0, 25.0, 30.0, 33.0, 35.0])
def test_noise_follows_the_gumbel_tail_far_past_30_nats(t: float) -> None:
    """Catches noise that cannot reach a 30-nat gap at its probability: with uniform hash bits the
    share of bit patterns whose noise passes t is P(noise > t), which must be the Gumbel tail. The
    23-bit uniform this replaces had no pattern past 16.64, so P(noise > 16.7) was 0."""
    share = bits_above(t) / 2.0**NOISE_BITS
    want = gumbel_tail(t)
    assert share == pytest.approx(want, rel=1e-3), (share, want)


def test_hash_bits_are_uniform_down_to_their_smallest_values() -> None:
    """Catches hash bits whose leading bits are not uniform (a sign bit, a shift that keeps the
    low bits, a weak mix): the noise's tail is the share of bits below 2**(63 - k), which must be
    2**-k for each k the sample can resolve."""
    seeds = torch.arange(1024, dtype=torch.int64) * 7919
    bits = hashed_bits(seeds, torch.arange(1024, dtype=torch.int64), 4096).flatten()
    n = bits.numel()
    assert int(bits.min()) >= 0
    for k in range(1, 19):  # n * 2**-18 = 16 expected at the deepest level
        below = int((bits < (1 << (NOISE_BITS - k))).sum())
        p = 2.0**-k
        assert abs(below - n * p) <= SIGMAS * math.sqrt(n * p * (1 - p)), (k, below, n * p)


def tail_info(seeds: torch.Tensor, vocab: int) -> SimpleNamespace:
    """A batch-like object for the draw with every filter off (``SamplingTensors``'s draw fields)."""
    bs = seeds.numel()
    return SimpleNamespace(
        top_ps=torch.ones(bs, device=seeds.device),
        top_ks=torch.full((bs,), TOP_K_ALL, dtype=torch.int32, device=seeds.device),
        min_ps=torch.zeros(bs, device=seeds.device),
        sampling_seed=seeds,
        vocab_size=vocab,
        need_top_p_sampling=False,
        need_top_k_sampling=False,
        need_min_p_sampling=False,
    )


def tail_hits(n_tail: int, gap: float, draws: int, chunk: int, device: torch.device, kernel: bool) -> tuple[int, float]:
    """Seeded draws over token 0 ``gap`` nats above ``n_tail`` equal tokens: (tail tokens drawn,
    the count expected from the float32 probabilities the draw saw)."""
    logp = torch.full((n_tail + 1,), -gap, dtype=torch.float64)
    logp[0] = 0.0
    probs = torch.softmax(logp, dim=0).float()  # head first, then the tail: already sorted
    share = float(probs[1:].double().sum() / probs.double().sum())
    rows = min(chunk, draws)
    probs_sort = probs.to(device).expand(rows, -1).contiguous()
    probs_idx = torch.arange(n_tail + 1, device=device).expand(rows, -1).contiguous()
    hits = 0
    for start in range(0, draws, rows):
        bs = min(rows, draws - start)
        seeds = torch.arange(start, start + bs, dtype=torch.int64, device=device) * 1_000_003 + 17
        info = tail_info(seeds, n_tail + 1)
        draw = launch_draw_sorted if kernel else draw_reference
        tokens = draw(probs_sort[:bs], probs_idx[:bs], info, torch.full((bs,), 3, dtype=torch.int64, device=device))  # type: ignore[arg-type]
        hits += int((tokens != 0).sum())
    return hits, draws * share


@pytest.mark.parametrize(
    ("n_tail", "gap", "draws"),
    [(200_000, 30.0, 32), (10_000, 8.0, 400)],
    ids=["30-nats-200k-tail", "8-nats-10k-tail"],
)
def test_seeded_draw_samples_a_heavy_tail_at_its_probability(n_tail: int, gap: float, draws: int) -> None:
    """Catches a seeded draw whose tail share is off: noise too narrow starves the tail, noise that
    overflows to infinity floods it. CI runs few draws (the torch reference, chunked); the GPU test
    runs 200,000 draws of the compiled kernel, where a 21-nat gap separates the two noises."""
    hits, expected = tail_hits(n_tail, gap, draws, chunk=4_000_000 // n_tail, device=torch.device("cpu"), kernel=False)
    p = expected / draws
    assert abs(hits - expected) <= SIGMAS * math.sqrt(draws * p * (1 - p)) + 1e-9, (hits, expected)


def test_poisoned_rows_never_leak_into_healthy_rows_of_a_random_batch() -> None:
    """Catches a poisoned-row fix applied per batch (a global isfinite check, a shared fallback):
    random batches with random poisoned rows must keep every healthy row's seeded token."""
    rng = random.Random(8)
    vocab = 200
    gen = torch.Generator().manual_seed(8)
    for _ in range(5):
        bs = rng.randint(2, 9)
        params = [
            SamplingParams(temperature=rng.uniform(0.5, 1.2), top_p=rng.uniform(0.5, 1.0), seed=rng.randrange(99))
            for _ in range(bs)
        ]
        logits = torch.randn(bs, vocab, generator=gen)
        positions = torch.tensor([rng.randrange(100) for _ in range(bs)])
        clean = Sampler()(logits, build(params, vocab, True), positions)
        bad = rng.sample(range(bs), rng.randint(1, bs - 1))
        for row in bad:
            logits[row, rng.randrange(vocab)] = rng.choice([NAN, INF])
        tokens = Sampler()(logits, build(params, vocab, True), positions)
        assert all(tokens[r].item() == POISONED_TOKEN for r in bad)
        assert all(tokens[r].item() == clean[r].item() for r in range(bs) if r not in bad)
