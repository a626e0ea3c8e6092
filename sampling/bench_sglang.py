"""``pinpool bench`` sampling rows against sglang 0.5.23's ``from_schedule_batch``, with and without logit bias.

The requests carry sglang-shaped params (``sampling.sglang_ref.SglangParams``: sglang's
field names, string bias keys, negative seeds), and both builds take the same batch. The
sglang side is its own code when ``.sglang/`` holds it, else the rebuild, as each table's
notes say (``sampling.sglang_ref``). Every row checks the two builds' values are equal.
"""

from __future__ import annotations

import random
from collections.abc import Callable
from functools import partial
from typing import Any

import numpy as np
import torch

from pinpool import PinnedRingBuffer, PoolSettings
from pinpool.bench.kit import BenchContext, Spread, Table, host_us_spread
from sampling.batch_info import SamplingBatchInfo
from sampling.params import SamplingParams
from sampling.sglang_params import FOREIGN_PARAMS
from sampling.sglang_ref import SglangBatch, SglangParams, SglangReq, load

#: The issue's batch sizes (1 to 4096), whatever ``--batch-sizes`` says.
SIZES = (1, 64, 256, 1024, 4096)
VOCAB = 32_000
BIAS_SHARE, BIAS_ENTRIES = 0.05, 5
FIELDS = ("temperatures", "top_ps", "top_ks", "min_ps", "sampling_seed", "logit_bias")


def make_batches(bs: int, device: torch.device, bias: bool, seed: int = 0) -> tuple[SglangBatch, Any]:
    """(sglang-shaped batch, the same settings as pinpool ``SamplingParams``). With ``bias``, 5% of
    the requests (at least one) carry ``BIAS_ENTRIES`` string-keyed entries."""
    rng = random.Random(seed)
    sg, native = [], []
    for i in range(bs):
        temperature, top_p = rng.choice([0.0, rng.uniform(0.5, 1.2)]), rng.choice([1.0, 0.9])
        top_k, min_p = rng.choice([-1, 40]), rng.choice([0.0, 0.05])
        seed_i = rng.randint(-(2**40), 2**40)
        lb = None
        if bias and (i == 0 or rng.random() < BIAS_SHARE):
            lb = {rng.randrange(VOCAB): rng.uniform(-5, 5) for _ in range(BIAS_ENTRIES)}
        sg.append(SglangReq(SglangParams(temperature, top_p, top_k, min_p, seed_i, _str_keys(lb))))
        native.append(
            _Req(
                SamplingParams(
                    temperature=temperature, top_p=top_p, top_k=top_k, min_p=min_p, seed=seed_i, logit_bias=lb
                )
            )
        )
    return SglangBatch(sg, device), SglangBatch(native, device)  # type: ignore[arg-type]


def _str_keys(bias: dict[int, float] | None) -> dict[str, float] | None:
    return None if bias is None else {str(k): v for k, v in bias.items()}


class _Req:
    __slots__ = ("sampling_params",)

    def __init__(self, params: SamplingParams) -> None:
        self.sampling_params = params


def equal(ours: SamplingBatchInfo, theirs: Any) -> bool:
    """Whether every tensor of the two builds holds the same values (read after timing, not in it)."""
    for name in FIELDS:
        a, b = getattr(ours, name), getattr(theirs, name)
        if (a is None) != (b is None) or (a is not None and not torch.equal(a, b.to(a.dtype).view(a.shape))):
            return False
    return bool(ours.is_all_greedy == theirs.is_all_greedy and ours.need_top_p_sampling == theirs.need_top_p_sampling)


def packed_build(batch: Any, pool: PinnedRingBuffer) -> tuple[torch.Tensor, ...]:
    """The earlier packed layout, for the same-run cost of the columnar one: a memmove of the joined
    32-byte records into the slot, the columns as stride-8 views."""
    reqs = batch.reqs
    bs = len(reqs)
    joined = b"".join([r.sampling_params.record for r in reqs])
    flags = np.frombuffer(joined, np.uint16)[12::16]
    _ = (int(np.bitwise_or.reduce(flags)), int(np.bitwise_and.reduce(flags)))
    with pool.stage() as st:
        host, records = st.reserve(32 * bs, torch.uint8, name="packed records")
        host[:] = np.frombuffer(joined, np.uint8)
    f32 = records.view(torch.float32).view(bs, 8)
    return f32[:, 0:1], f32[:, 1], records.view(torch.int32).view(bs, 8)[:, 2], f32[:, 3]


def _x(base: Spread, ours: Spread) -> float:
    return base.median / ours.median


def _rows(ctx: BenchContext, pool: PinnedRingBuffer, sg_build: Callable[..., Any], bias: bool) -> list[tuple[Any, ...]]:
    rows = []
    build = SamplingBatchInfo.from_schedule_batch
    for bs in SIZES:
        ctx.progress(f"sglang sampling bs={bs} bias={bias}")
        batch, native = make_batches(bs, ctx.device, bias, seed=bs)
        same = equal(build(batch, VOCAB, pool, deterministic=True), sg_build(batch, VOCAB))
        theirs = host_us_spread(ctx, partial(sg_build, batch, VOCAB))
        ours = host_us_spread(ctx, partial(build, batch, VOCAB, pool, deterministic=True))

        def cold(batch: SglangBatch = batch) -> None:
            FOREIGN_PARAMS.clear()  # every request seen for the first time, as in sglang's prefill
            build(batch, VOCAB, pool, deterministic=True)

        first = host_us_spread(ctx, cold)
        row: tuple[Any, ...] = (bs, theirs, ours, first, _x(theirs, ours), _x(theirs, first))
        if not bias:
            own = host_us_spread(ctx, partial(build, native, VOCAB, pool, deterministic=True))
            packed = host_us_spread(ctx, partial(packed_build, native, pool))
            row += (own, packed)
        rows.append((*row, same))
    return rows


def bias_device_table(ctx: BenchContext, pool: PinnedRingBuffer) -> Table:
    """Device µs to add the bias to [bs, vocab] logits: sglang's dense add against the sparse kernel."""
    from triton.testing import do_bench

    rows = []
    for bs in SIZES:
        batch, _ = make_batches(bs, ctx.device, bias=True, seed=bs)
        info = SamplingBatchInfo.from_schedule_batch(batch, VOCAB, pool, owned=True)
        dense = info.logit_bias
        assert dense is not None
        logits = torch.randn(bs, VOCAB, device=ctx.device)
        theirs = do_bench(lambda logits=logits, dense=dense: logits.add_(dense), return_mode="median") * 1e3
        ours = do_bench(partial(info.apply_logits_bias, logits), return_mode="median") * 1e3
        rows.append((bs, theirs, ours, theirs / ours))
    notes = (
        f"vocab {VOCAB}, {BIAS_SHARE:.0%} of requests (at least one) with {BIAS_ENTRIES} entries; do_bench medians",
    )
    return Table(
        "sampling: logit bias applied, device µs", ("bs", "dense add µs", "sparse kernel µs", "x"), tuple(rows), notes
    )


def workload(ctx: BenchContext) -> list[Table]:
    sg_build, source = load()
    pool = PinnedRingBuffer(PoolSettings.from_env(device=ctx.device, num_slots=8, slot_bytes=1 << 20))
    common = [
        f"sglang side: {source}",
        "pool µs: sglang-shaped requests, records cached per params object (a request seen before); "
        "cold µs: the cache cleared before every call (each request packed on first sight, as in sglang's prefill)",
        "x = sglang µs / pool µs (medians); host µs per build, median (min-max) over the repeats",
    ]
    plain = _rows(ctx, pool, sg_build, bias=False)
    tables = [
        Table(
            "sampling: SamplingBatchInfo build vs sglang's from_schedule_batch, no logit bias",
            ("bs", "sglang µs", "pool µs", "cold µs", "x", "x cold", "native µs", "packed µs", "equal"),
            tuple(plain),
            (
                *common,
                "native µs: pinpool SamplingParams (columnar, contiguous); packed µs: the earlier layout "
                "(one memmove, stride-8 columns), same run: their ratio is the columnar layout's cost",
            ),
        )
    ]
    biased = _rows(ctx, pool, sg_build, bias=True)
    tables.append(
        Table(
            f"sampling: build with logit bias ({BIAS_SHARE:.0%} of requests, at least one, {BIAS_ENTRIES} entries)",
            ("bs", "sglang µs", "pool µs", "cold µs", "x", "x cold", "equal"),
            tuple(biased),
            (*common, "pool: sparse entries in the build's one copy; sglang: dense [bs, vocab] zeros + index_put"),
        )
    )
    if ctx.is_cuda:
        tables.append(bias_device_table(ctx, pool))
    pool.close()
    return tables
