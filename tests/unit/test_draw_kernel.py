"""The deterministic draw's Triton kernel (interpreted on CPU) against its torch reference."""

from __future__ import annotations

import random
from types import SimpleNamespace

import pytest
import torch

from pinpool import PinnedRingBuffer, PoolSettings
from sampling import BatchMismatchError, SamplingBatchInfo, SamplingParams, draw_reference, launch_draw_sorted
from sampling.draw import BLOCK, NOISE_BITS, POISONED_TOKEN, exponential_from_bits
from sampling.sampler import _landed
from tests.fakes import Batch, Req


def batch(rng: random.Random, bs: int, vocab: int, flags: str) -> SamplingBatchInfo:
    params = [
        SamplingParams(
            temperature=rng.uniform(0.4, 1.5),
            top_p=rng.uniform(0.3, 0.95) if "p" in flags else 1.0,
            top_k=rng.randint(1, vocab + 5) if "k" in flags else -1,
            min_p=rng.uniform(0.0, 0.2) if "m" in flags else 0.0,
            seed=rng.randrange(2**40),
        )
        for _ in range(bs)
    ]
    pool = PinnedRingBuffer(PoolSettings(device="cpu", num_slots=2, slot_bytes=1 << 16))
    return SamplingBatchInfo.from_schedule_batch(
        Batch([Req(p) for p in params]), vocab, pool, owned=True, deterministic=True
    )


def sorted_probs(info: SamplingBatchInfo, seed: int) -> tuple[torch.Tensor, torch.Tensor]:
    gen = torch.Generator().manual_seed(seed)
    logits = torch.randn(len(info), info.vocab_size, generator=gen) * 3.0
    probs = torch.softmax(logits / info.temperatures, dim=-1)
    return probs.sort(dim=-1, descending=True, stable=True)


@pytest.mark.parametrize("flags", ["", "p", "k", "m", "pkm"])
@pytest.mark.parametrize(("bs", "vocab"), [(1, 7), (6, 300), (3, 2 * BLOCK + 17)])
def test_kernel_draws_the_reference_token(flags: str, bs: int, vocab: int) -> None:
    """Catches a kernel whose hash, filters, running top-p mass across blocks or tie rule differ."""
    rng = random.Random(hash((flags, bs, vocab)) % 1000)
    info = batch(rng, bs, vocab, flags)
    probs_sort, probs_idx = sorted_probs(info, seed=bs + vocab)
    positions = torch.tensor([rng.randrange(4096) for _ in range(bs)], dtype=torch.int64)
    want = draw_reference(probs_sort, probs_idx, info, positions)
    got = launch_draw_sorted(probs_sort, probs_idx, info, positions)
    assert got.tolist() == want.tolist()


def test_kernel_keeps_only_what_the_filters_allow() -> None:
    """Catches a kernel that ignores top-k: with top_k=1 every draw is the most likely token."""
    rng = random.Random(5)
    params = [SamplingParams(temperature=1.0, top_k=1, seed=s) for s in range(8)]
    pool = PinnedRingBuffer(PoolSettings(device="cpu", num_slots=2, slot_bytes=1 << 16))
    info = SamplingBatchInfo.from_schedule_batch(
        Batch([Req(p) for p in params]), 40, pool, owned=True, deterministic=True
    )
    probs_sort, probs_idx = sorted_probs(info, seed=rng.randrange(100))
    got = launch_draw_sorted(probs_sort, probs_idx, info, torch.arange(8))
    assert got.tolist() == probs_idx[:, 0].tolist()


def test_kernel_depends_on_seed_and_position() -> None:
    """Catches noise that ignores the seed or the position (every step would draw alike)."""
    rng = random.Random(9)
    info = batch(rng, 1, 500, "")
    probs = torch.full((1, 500), 1 / 500)  # uniform: the noise alone decides
    idx = torch.arange(500).view(1, 500)
    tokens = {launch_draw_sorted(probs, idx, info, torch.tensor([pos])).item() for pos in range(20)}
    assert len(tokens) > 10


@pytest.mark.parametrize("use_kernel", [True, False], ids=["draw-kernel", "reference-then-land"])
def test_land_to_stores_each_rows_token_at_its_address_and_skips_zero(use_kernel: bool) -> None:
    """Catches a landing that stores another row's token, writes through a padding row's 0, or
    changes the returned tokens (the kernel's LAND path and the sampler's land-after-draw path)."""
    rng = random.Random(4)
    info = batch(rng, 5, 300, "pkm")
    probs_sort, probs_idx = sorted_probs(info, seed=2)
    positions = torch.tensor([rng.randrange(4096) for _ in range(5)], dtype=torch.int64)
    want = draw_reference(probs_sort, probs_idx, info, positions)
    host = torch.full((5,), -1, dtype=torch.int64)
    land_to = torch.tensor([0 if i == 2 else host.data_ptr() + 8 * i for i in range(5)], dtype=torch.int64)
    if use_kernel:
        got = launch_draw_sorted(probs_sort, probs_idx, info, positions, land_to)
    else:
        got = _landed(draw_reference(probs_sort, probs_idx, info, positions), land_to)
    assert got.tolist() == want.tolist()
    assert host.tolist() == [t if i != 2 else -1 for i, t in enumerate(want.tolist())]
    with pytest.raises(BatchMismatchError, match=r"'land_to' must be torch\.int64"):
        launch_draw_sorted(probs_sort, probs_idx, info, positions, land_to[:4])


def test_launcher_refuses_bad_inputs_naming_them() -> None:
    """Catches a launch on mismatched tensors (a kernel would read out of bounds, not raise)."""
    rng = random.Random(1)
    info = batch(rng, 2, 30, "p")
    probs_sort, probs_idx = sorted_probs(info, seed=0)
    pos = torch.zeros(2, dtype=torch.int64)
    with pytest.raises(BatchMismatchError, match="'probs_sort' must be contiguous float32"):
        launch_draw_sorted(probs_sort.double(), probs_idx, info, pos)
    with pytest.raises(BatchMismatchError, match="'probs_idx' must be contiguous int64"):
        launch_draw_sorted(probs_sort, probs_idx[:, :10], info, pos)
    with pytest.raises(BatchMismatchError, match=r"'positions' must be torch.int64 \(2,\)"):
        launch_draw_sorted(probs_sort, probs_idx, info, torch.zeros(3, dtype=torch.int64))
    with pytest.raises(BatchMismatchError, match=r"'positions' must be torch\.int64"):
        launch_draw_sorted(probs_sort, probs_idx, info, pos.int())


def test_kernel_reads_strided_columns_and_positions() -> None:
    """Catches a kernel that assumes unit strides (a caller's columns may be record fields or padded rows)."""
    rng = random.Random(2)
    info = batch(rng, 5, 90, "pkm")
    assert info.top_ps.stride(0) == 1  # the batch's own columns are contiguous ...

    def strided(t: torch.Tensor) -> torch.Tensor:
        return torch.stack([t, torch.zeros_like(t)], dim=1)[:, 0]

    assert info.sampling_seed is not None
    wide = SimpleNamespace(  # ... so build a batch whose columns are not
        top_ps=strided(info.top_ps),
        top_ks=strided(info.top_ks),
        min_ps=strided(info.min_ps),
        sampling_seed=strided(info.sampling_seed),
        vocab_size=info.vocab_size,
        need_top_p_sampling=True,
        need_top_k_sampling=True,
        need_min_p_sampling=True,
    )
    assert wide.top_ps.stride(0) == 2
    probs_sort, probs_idx = sorted_probs(info, seed=4)
    positions = torch.arange(10, dtype=torch.int64)[::2]
    want = draw_reference(probs_sort, probs_idx, info, positions)
    got = launch_draw_sorted(probs_sort, probs_idx, wide, positions)  # type: ignore[arg-type]
    assert got.tolist() == want.tolist()


def test_noise_stays_finite_at_the_extremes() -> None:
    """Catches a noise value that is infinite (a uniform rounding to 1.0, or v to 1.0 or 0): on a
    filtered token (log 0 = -inf) the score is then NaN, which argmax takes as the maximum."""
    top = (1 << NOISE_BITS) - 1
    bits = torch.tensor([0, 1, 2**40, 2**62, top - 2**38, top - 1, top], dtype=torch.int64)
    e = exponential_from_bits(bits)
    assert (e > 0).all() and torch.isfinite(e).all()
    gumbel = -torch.log(e)
    assert torch.isfinite(gumbel).all()
    assert gumbel[0].item() > 44.0  # the widest noise: v = 2**-64


def test_kernel_draws_the_reference_token_on_heavy_tailed_rows() -> None:
    """Catches a kernel whose noise differs from the reference's where it matters most: on rows
    with a dominant token the winner is decided by the largest noise values (v near 0), where a
    fused multiply-add, a dropped compensation term or another rounding of the bits shows."""
    gen = torch.Generator().manual_seed(11)
    rng = random.Random(11)
    info = batch(rng, 48, 600, "")
    logits = torch.randn(48, 600, generator=gen)
    logits[:, 0] += torch.linspace(0.0, 14.0, 48)  # head 0 to 14 nats above a 600-token tail
    probs = torch.softmax(logits, dim=-1)
    probs_sort, probs_idx = probs.sort(dim=-1, descending=True, stable=True)
    positions = torch.tensor([rng.randrange(4096) for _ in range(48)], dtype=torch.int64)
    want = draw_reference(probs_sort, probs_idx, info, positions)
    got = launch_draw_sorted(probs_sort, probs_idx, info, positions)
    assert got.tolist() == want.tolist()
    assert len(set(want.tolist())) > 5  # the tail won some rows: the noise really decided


def poisoned_probs(vocab: int) -> tuple[torch.Tensor, list[bool]]:
    """Rows of sorted probabilities: softmax of healthy, NaN, +inf and all -inf logits, then the
    rows a direct caller could pass (one NaN, +inf, -inf or zero-only probabilities)."""
    logits = torch.randn(5, vocab, generator=torch.Generator().manual_seed(vocab)) * 2.0
    logits[1, 7] = float("nan")
    logits[2, 7] = float("inf")
    logits[3] = float("-inf")
    softmaxed = torch.softmax(logits, dim=-1)
    direct = softmaxed[[0, 0, 0, 4, 0]].clone()
    direct[0, 9] = float("nan")
    direct[1, 9] = float("inf")
    direct[2, vocab - 1] = float("-inf")
    direct[3] = 0.0
    return torch.cat([softmaxed, direct]), [False, True, True, True, False, True, True, True, True, False]


@pytest.mark.filterwarnings("ignore:invalid value encountered:RuntimeWarning")  # the interpreter's NaN arithmetic
@pytest.mark.parametrize("use_kernel", [True, False], ids=["draw-kernel", "reference"])
@pytest.mark.parametrize("landed", [False, True], ids=["returned", "landed"])
@pytest.mark.parametrize("flags", ["", "pkm"])
def test_poisoned_rows_draw_token_zero_in_the_kernel_the_reference_and_the_landing(
    use_kernel: bool, landed: bool, flags: str
) -> None:
    """Catches the kernel's 'no token' placeholder (1 << 62) returned or landed for a row whose
    probabilities are NaN (a NaN or +inf logit, all -inf logits) or hold an inf, or a kernel and a
    reference that answer such rows differently: both must draw token 0 (sampling/draw.py's rule)."""
    vocab = 2 * BLOCK + 5  # several blocks: a poison in a later block must still flag the row
    probs, poisoned = poisoned_probs(vocab)
    bs = len(poisoned)
    info = batch(random.Random(6), bs, vocab, flags)
    probs_sort, probs_idx = probs.sort(dim=-1, descending=True, stable=True)
    positions = torch.arange(bs, dtype=torch.int64)
    host = torch.full((bs,), -1, dtype=torch.int64)
    land_to = torch.tensor([host.data_ptr() + 8 * i for i in range(bs)]) if landed else None
    if use_kernel:
        got = launch_draw_sorted(probs_sort, probs_idx, info, positions, land_to)
    else:
        got = _landed(draw_reference(probs_sort, probs_idx, info, positions), land_to)
    tokens = got.tolist()
    assert all(0 <= t < vocab for t in tokens), tokens
    assert [t for t, bad in zip(tokens, poisoned, strict=True) if bad] == [POISONED_TOKEN] * sum(poisoned)
    assert tokens == draw_reference(probs_sort, probs_idx, info, positions).tolist()
    assert tokens[0] != POISONED_TOKEN or tokens[4] != POISONED_TOKEN  # healthy rows really drew
    if landed:
        assert host.tolist() == tokens
