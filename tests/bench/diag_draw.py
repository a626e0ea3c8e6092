"""The deterministic draw's device time: today's kernel against the one before the wide noise (a diagnostic).

python3 tests/bench/diag_draw.py > $OUT/diag_draw.txt

Same-run A/B on one GPU: per vocabulary (152k, 32k), batch size (1, 64, 256) and filter set
(none; top-p, top-k and min-p together), ``triton.testing.do_bench`` times the draw kernel
of ``sampling.draw`` (63-bit noise through the complement, the poisoned-row flag) and a copy
of the kernel at 3e5dd9f (23-bit uniform, no flag), on the same sorted probabilities, in
alternating order. Prints median device µs and the ratio new / old. No asserts: lab code.
"""

from __future__ import annotations

import sys
from collections.abc import Callable
from types import SimpleNamespace

import torch
import triton
import triton.language as tl
from triton.language.extra import libdevice

from sampling.draw import BLOCK, _launch_draw

VOCABS = (152_064, 32_000)
BATCH_SIZES = (1, 64, 256)
ROUNDS = 3  # alternating old/new rounds; the median of each side's rounds is printed


# --- the kernel as it was at 3e5dd9f, without its landing branch (kept here, not in the library) ---
@triton.jit
def _old_shr(x, k: tl.constexpr):
    return (x >> k) & ((1 << (64 - k)) - 1)


@triton.jit
def _old_mix(x):
    x = x ^ _old_shr(x, 30)
    x = x * 0x3F58476D1CE4E5B9
    x = x ^ _old_shr(x, 27)
    x = x * 0x14D049BB133111EB
    return x ^ _old_shr(x, 31)


@triton.jit
def _old_draw_kernel(
    probs_ptr,  # float32 [bs, vocab], each row sorted descending
    idx_ptr,  # int64 [bs, vocab]
    top_p_ptr,  # float32 [bs]
    top_k_ptr,  # int32 [bs]
    min_p_ptr,  # float32 [bs]
    seed_ptr,  # int64 [bs]
    pos_ptr,  # int64 [bs]
    out_ptr,  # int64 [bs]
    vocab,
    TOP_P: tl.constexpr,
    TOP_K: tl.constexpr,
    MIN_P: tl.constexpr,
    BLOCK: tl.constexpr,
):
    row = tl.program_id(0).to(tl.int64)
    base = row * vocab
    lanes = tl.zeros([BLOCK], tl.int64)
    seed = tl.load(seed_ptr + row + lanes)
    pos = tl.load(pos_ptr + row + lanes)
    key = _old_mix(seed * 0x5851F42D4C957F2D + pos * 0x14057B7EF767814F)
    top_p = tl.load(top_p_ptr + row)
    top_p = tl.where(top_p >= 1.0, float("inf"), top_p)
    top_k = tl.load(top_k_ptr + row).to(tl.int64)
    floor = tl.load(probs_ptr + base) * tl.load(min_p_ptr + row)
    carry = tl.zeros([BLOCK], tl.float32).sum(0)
    best_score = tl.full([BLOCK], float("-inf"), tl.float32).max(0)
    best_token = tl.full([BLOCK], 1 << 62, tl.int64).min(0)
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
        bits = _old_shr(_old_mix(key + token * 0x2545F4914F6CDD1D), 41)
        u = (bits.to(tl.float32) + 0.5) * (1.0 / 8388608.0)
        log_p = libdevice.log(tl.where(keep, p, 1.0))
        score = tl.where(keep, log_p - libdevice.log(-libdevice.log(u)), float("-inf"))
        block_best = tl.max(score, 0)
        block_token = tl.min(tl.where(keep & (score == block_best), token, 1 << 62), 0)
        better = (block_best > best_score) | ((block_best == best_score) & (block_token < best_token))
        best_token = tl.where(better, block_token, best_token)
        best_score = tl.where(better, block_best, best_score)
        start += BLOCK
    tl.store(out_ptr + row, best_token)


def launchers(vocab: int, bs: int, filters: bool, dev: torch.device) -> tuple[Callable[[], None], Callable[[], None]]:
    """(old, new): bare launches of the two kernels on the same sorted probabilities."""
    gen = torch.Generator(device=dev).manual_seed(vocab + bs)
    logits = torch.randn(bs, vocab, device=dev, generator=gen) * 3.0
    probs_sort, probs_idx = torch.softmax(logits, dim=-1).sort(dim=-1, descending=True, stable=True)
    info = SimpleNamespace(
        top_ps=torch.full((bs,), 0.9 if filters else 1.0, device=dev),
        top_ks=torch.full((bs,), 50 if filters else 1 << 30, dtype=torch.int32, device=dev),
        min_ps=torch.full((bs,), 0.02 if filters else 0.0, device=dev),
        sampling_seed=torch.randint(0, 2**40, (bs,), device=dev, generator=gen),
        vocab_size=vocab,
        need_top_p_sampling=filters,
        need_top_k_sampling=filters,
        need_min_p_sampling=filters,
    )
    positions = torch.arange(bs, dtype=torch.int64, device=dev)
    out = torch.empty(bs, dtype=torch.int64, device=dev)

    def old() -> None:
        _old_draw_kernel[(bs,)](
            probs_sort, probs_idx, info.top_ps, info.top_ks, info.min_ps, info.sampling_seed,
            positions, out, vocab, TOP_P=filters, TOP_K=filters, MIN_P=filters, BLOCK=BLOCK,
        )  # fmt: skip

    def new() -> None:
        _launch_draw(probs_sort, probs_idx, info, positions, out, bs, vocab)  # type: ignore[arg-type]

    return old, new


def main() -> int:
    if not torch.cuda.is_available():
        print("diag_draw: needs a CUDA device (it times the compiled draw kernel); nothing to do on CPU")
        return 0
    dev = torch.device("cuda", 0)
    print(f"# {torch.cuda.get_device_name(dev)}, torch {torch.__version__}, triton {triton.__version__}")
    print(f"{'vocab':>7} {'bs':>4} {'filters':>7} {'old µs':>9} {'new µs':>9} {'new/old':>8}")
    for vocab in VOCABS:
        for bs in BATCH_SIZES:
            for filters in (False, True):
                old, new = launchers(vocab, bs, filters, dev)
                old(), new()  # compile both before timing
                olds, news = [], []
                for _ in range(ROUNDS):
                    olds.append(triton.testing.do_bench(old, warmup=10, rep=40, return_mode="median"))
                    news.append(triton.testing.do_bench(new, warmup=10, rep=40, return_mode="median"))
                o, n = sorted(olds)[ROUNDS // 2] * 1e3, sorted(news)[ROUNDS // 2] * 1e3
                label = "pkm" if filters else "none"
                print(f"{vocab:>7} {bs:>4} {label:>7} {o:>9.1f} {n:>9.1f} {n / o:>8.2f}", flush=True)
    print("# both: bare kernel launches (no launcher checks), the same inputs, alternating rounds")
    return 0


if __name__ == "__main__":
    sys.exit(main())
