"""``pinpool bench`` sampling rows against sglang 0.5.23's own ``SamplingBatchInfo``, on sglang's call pattern.

The pattern (sglang's ``Scheduler``): ``from_schedule_batch`` runs once per new batch, in
``prepare_for_extend``, on requests it has just admitted, so every params object is seen
for the first time; the batch then lives across decode steps (an owned build here) and is
edited in place by ``filter_batch`` (requests finish) and ``merge_batch`` (new ones join).

The requests carry sglang's own ``SamplingParams`` class, loaded from ``.sglang/`` when it
and msgspec are here (else a stand-in with its fields, said in the notes), with about 30%
of seeds ``None`` as sglang's default leaves them. Each call gets new objects: every size
has ``COPIES`` sets of distinct objects with the same values, used in turn. pinpool keeps
nothing per object, so nothing is warm but the CPU's caches.

Host µs are per call, with the device drained before each call; sglang's call and
pinpool's alternate in one loop. Every row checks the builds' values are equal.
"""

from __future__ import annotations

import random
import time
from collections.abc import Callable
from functools import partial
from operator import attrgetter
from typing import Any

import numpy as np
import torch

from pinpool import PinnedRingBuffer, PoolSettings
from pinpool.bench.kit import BenchContext, Spread, Table, one_thread_on_cpu
from pinpool.bench.sglang_sampling import SglangBatch, SglangReq, load, load_params_class, set_deterministic
from sampling import sglang_params
from sampling.batch_info import SamplingBatchInfo

#: The issue's batch sizes (1 to 4096), whatever ``--batch-sizes`` says.
SIZES = (1, 64, 256, 1024, 4096)
VOCAB = 32_000
BIAS_SHARE, BIAS_ENTRIES = 0.05, 5
FIELDS = ("temperatures", "top_ps", "top_ks", "min_ps", "sampling_seed", "logit_bias")
#: Calls timed per row (the issue asks for medians of at least 200).
CALLS = 200
#: Distinct object sets per size, used in turn, so a call never meets the last call's objects.
COPIES = 8
#: Requests that join in the merge rows.
JOINING = 4


def make_params(make: Callable[..., Any], bs: int, bias: bool, seed: int) -> list[Any]:
    """``bs`` params objects of class ``make`` (sglang's keywords). With ``bias``, 5% of them (at
    least one) carry ``BIAS_ENTRIES`` string-keyed entries."""
    rng = random.Random(seed)
    out = []
    for i in range(bs):
        lb = None
        if bias and (i == 0 or rng.random() < BIAS_SHARE):
            lb = {str(rng.randrange(VOCAB)): rng.uniform(-5, 5) for _ in range(BIAS_ENTRIES)}
        out.append(
            make(
                temperature=rng.choice([0.0, rng.uniform(0.5, 1.2)]),
                top_p=rng.choice([1.0, 0.9]),
                top_k=rng.choice([-1, 40]),
                min_p=rng.choice([0.0, 0.05]),
                sampling_seed=None if rng.random() < 0.3 else rng.randint(-(2**40), 2**40),
                logit_bias=lb,
            )
        )
    return out


def fresh_batches(make: Callable[..., Any], bs: int, device: torch.device, bias: bool, seed: int) -> list[SglangBatch]:
    """``COPIES`` batches of new objects holding the same values."""
    return [SglangBatch([SglangReq(p) for p in make_params(make, bs, bias, seed)], device) for _ in range(COPIES)]


def equal(ours: SamplingBatchInfo, theirs: Any) -> bool:
    """Whether every tensor of the two builds holds the same values (read after timing, not in it)."""
    for name in FIELDS:
        a, b = getattr(ours, name), getattr(theirs, name)
        if (a is None) != (b is None) or (a is not None and not torch.equal(a, b.to(a.dtype).view(a.shape))):
            return False
    flags = ("is_all_greedy", "is_any_greedy", "need_top_p_sampling", "need_top_k_sampling", "need_min_p_sampling")
    return all(getattr(ours, f) == getattr(theirs, f) for f in flags) and ours.max_top_k == theirs.max_top_k


def timed(ctx: BenchContext, calls: list[Callable[[int], Any]], n: int | None = None) -> list[Spread]:
    """Host µs of each of ``calls``, interleaved: median (p10-p90) over ``n`` laps.

    Each call gets the running call number (warm-up included), so a caller that picks its
    objects by it never meets the objects of the call before. The side that goes first
    rotates from lap to lap.
    """
    n = _calls(ctx) if n is None else n
    samples: list[list[float]] = [[] for _ in calls]
    k = 0
    for lap in range(-3, n):  # three untimed laps warm every path
        first = lap % len(calls)
        for j in (*range(first, len(calls)), *range(first)):
            ctx.synchronize()
            start = time.perf_counter()
            calls[j](k)
            took = (time.perf_counter() - start) * 1e6
            k += 1
            if lap >= 0:
                samples[j].append(took)
    return [_spread(s) for s in samples]


def _filter_lap(batches: list[Any], keep: list[int], keep_device: torch.Tensor, k: int) -> None:
    """Call ``k`` of a four-sided lap filters that lap's own batch."""
    batches[k // 4].filter_batch(keep, keep_device)


def _merge_lap(pairs: list[tuple[Any, Any]], k: int) -> None:
    """Call ``k`` of a four-sided lap merges that lap's own pair."""
    pairs[k // 4][0].merge_batch(pairs[k // 4][1])


def _on_set(pick: Callable[[int], Any], fn: Callable[[Any], Any], k: int) -> Any:
    """``fn`` on object set ``k % COPIES``: consecutive calls never share objects."""
    return fn(pick(k % COPIES))


def _ignore_index(fn: Callable[[Any, None], Any], objs: Any, k: int) -> Any:
    return fn(objs, None)


def _calls(ctx: BenchContext) -> int:
    """Calls per row: the issue's count on a GPU; a CPU run (CI's smoke test) takes ``--iters``."""
    return CALLS if ctx.is_cuda else ctx.iters


def _sizes(ctx: BenchContext) -> tuple[int, ...]:
    """The issue's sizes on a GPU; a CPU run takes ``--batch-sizes``."""
    return SIZES if ctx.is_cuda else tuple(ctx.batch_sizes)


def _spread(samples: list[float]) -> Spread:
    p10, p50, p90 = np.percentile(samples, [10, 50, 90])
    return Spread(float(p10), float(p50), float(p90))


def _x(base: Spread, ours: Spread) -> float:
    return base.median / ours.median


def build_rows(
    ctx: BenchContext, pool: PinnedRingBuffer, sg_build: Any, make: Callable[..., Any], bias: bool
) -> list[tuple[Any, ...]]:
    """First-sight builds, default and deterministic: sglang's, pinpool's ring and owned."""
    rows = []
    build = SamplingBatchInfo.from_schedule_batch
    for deterministic in (False, True):
        set_deterministic(deterministic)
        for bs in _sizes(ctx):
            ctx.progress(f"sglang sampling build bs={bs} bias={bias} deterministic={deterministic}")
            batches = fresh_batches(make, bs, ctx.device, bias, seed=bs)
            pick = batches.__getitem__

            def theirs(i: int, pick: Any = pick) -> Any:
                return sg_build(pick(i % COPIES), VOCAB)

            def ring(i: int, pick: Any = pick, d: bool = deterministic) -> Any:
                return build(pick(i % COPIES), VOCAB, pool, deterministic=d)

            def owned(i: int, pick: Any = pick, d: bool = deterministic) -> Any:
                return build(pick(i % COPIES), VOCAB, pool, owned=True, deterministic=d)

            same = equal(ring(0), theirs(1)) and equal(owned(2), theirs(3))
            sg, rg, ow = timed(ctx, [theirs, ring, owned])
            mode = "deterministic" if deterministic else "default"
            rows.append((bs, mode, sg, rg, ow, _x(sg, rg), _x(sg, ow), same))
    set_deterministic(True)
    return rows


def edit_rows(
    ctx: BenchContext, pool: PinnedRingBuffer, sg_build: Any, make: Callable[..., Any]
) -> list[tuple[Any, ...]]:
    """``filter_batch`` (one request finished) and ``merge_batch`` (``JOINING`` requests join) on long-lived
    batches, sglang's against pinpool's owned ones; both get the same device keep indices."""
    rows = []
    build = SamplingBatchInfo.from_schedule_batch
    for bs in [bs for bs in _sizes(ctx) if bs > 1]:
        ctx.progress(f"sglang sampling filter/merge bs={bs}")
        batch = fresh_batches(make, bs, ctx.device, bias=False, seed=bs)[0]
        joining = SglangBatch([SglangReq(p) for p in make_params(make, JOINING, False, seed=bs + 1)], ctx.device)
        done = random.Random(bs).randrange(bs)
        keep = [i for i in range(bs) if i != done]
        keep_device = torch.tensor(keep, dtype=torch.int64, device=ctx.device)  # sync-ok: set-up, before timing
        n = _calls(ctx)
        # Each call edits a batch in place: one fresh pair per call, built before the timing.
        sg_f = [sg_build(batch, VOCAB) for _ in range(n + 3)]
        pp_f = [build(batch, VOCAB, pool, owned=True, deterministic=True) for _ in range(n + 3)]
        sg_m = [(sg_build(batch, VOCAB), sg_build(joining, VOCAB)) for _ in range(n + 3)]
        pp_m = [
            (
                build(batch, VOCAB, pool, owned=True, deterministic=True),
                build(joining, VOCAB, pool, owned=True, deterministic=True),
            )
            for _ in range(n + 3)
        ]
        spans = timed(
            ctx,
            [
                partial(_filter_lap, sg_f, keep, keep_device),
                partial(_filter_lap, pp_f, keep, keep_device),
                partial(_merge_lap, sg_m),
                partial(_merge_lap, pp_m),
            ],
            n,
        )
        same = equal(pp_f[0], sg_f[0]) and equal(pp_m[0][0], sg_m[0][0])
        sf, pf, sm, pm = spans
        rows.append((bs, sf, pf, _x(sf, pf), sm, pm, _x(sm, pm), same))
    return rows


def phase_rows(
    ctx: BenchContext, pool: PinnedRingBuffer, sg_build: Any, make: Callable[..., Any]
) -> list[tuple[Any, ...]]:
    """Where a first-sight build's host time goes, deterministic mode, no bias: the attribute reads
    alone (the Python floor: one pass for ``sampling_params``, one per field), the packer (reads,
    checks, normalisation, records), the ring build (+ stage, columns, copy, the info object) and
    the owned build (+ the device allocation)."""
    rows = []
    build = SamplingBatchInfo.from_schedule_batch
    getters = [sglang_params._GET[f] for f in sglang_params._FIELDS]
    to_params = attrgetter("sampling_params")
    set_deterministic(True)
    for bs in _sizes(ctx):
        ctx.progress(f"sglang sampling phases bs={bs}")
        pick = fresh_batches(make, bs, ctx.device, False, seed=bs).__getitem__

        def reads(i: int, pick: Any = pick) -> Any:
            params = list(map(to_params, pick(i % COPIES).reqs))
            return [list(map(g, params)) for g in getters]

        spans = timed(
            ctx,
            [
                partial(_on_set, pick, lambda b: sg_build(b, VOCAB)),
                reads,
                partial(_on_set, pick, lambda b: sglang_params.pack_foreign(list(map(to_params, b.reqs)))),
                partial(_on_set, pick, lambda b: build(b, VOCAB, pool, deterministic=True)),
                partial(_on_set, pick, lambda b: build(b, VOCAB, pool, owned=True, deterministic=True)),
            ],
        )
        sg, rd, pk, rg, ow = (x.median for x in spans)
        rows.append((bs, sg, rd, pk - rd, rg - pk, ow - rg, rg, ow, sg / rd))
    return rows


def packer_rows(ctx: BenchContext, make: Callable[..., Any]) -> list[tuple[Any, ...]]:
    """The small-batch packer against the vectorised one, same objects, same run (the fast path's A/B)."""
    rows = []
    # Sizes past SMALL_BATCH too: where the two cross on this machine says where the threshold belongs.
    for bs in (1, 4, sglang_params.SMALL_BATCH, 32, 64, 128):
        objs = make_params(make, bs, bias=False, seed=bs)
        small, vec = timed(
            ctx,
            [
                partial(_ignore_index, sglang_params._pack_small, objs),
                partial(_ignore_index, sglang_params._pack_vectorised, objs),
            ],
        )
        rows.append((bs, small, vec, vec.median / small.median))
    return rows


def bias_device_table(ctx: BenchContext, pool: PinnedRingBuffer, sg_build: Any, make: Callable[..., Any]) -> Table:
    """Device µs to add the bias to [bs, vocab] logits: sglang's dense add against the sparse kernel."""
    from triton.testing import do_bench

    rows = []
    for bs in _sizes(ctx):
        batch = fresh_batches(make, bs, ctx.device, bias=True, seed=bs)[0]
        info = SamplingBatchInfo.from_schedule_batch(batch, VOCAB, pool, owned=True)
        dense = sg_build(batch, VOCAB).logit_bias
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
    with one_thread_on_cpu(ctx):
        return _tables(ctx)


def _tables(ctx: BenchContext) -> list[Table]:
    sg_build, source = load()
    make, params_source = load_params_class()
    pool = PinnedRingBuffer(PoolSettings.from_env(device=ctx.device, num_slots=8, slot_bytes=1 << 20))
    common = (
        f"sglang side: {source}",
        f"requests: {params_source}; about 30% of seeds None; new objects every call ({COPIES} sets in turn)",
        f"host µs per call, median (p10-p90) of {_calls(ctx)} calls, device drained before each (so a ring "
        "build never waits on a slot's fence); the sides' calls alternate, the one going first rotating; "
        "x = sglang µs / pinpool µs",
        "ring: from_schedule_batch (tensors in a ring slot, live for the ring's claims); owned: owned=True "
        "(one device allocation and one copy, for a batch that lives across decode steps, as sglang's does)",
        *(() if ctx.is_cuda else ("CPU: one torch thread (as the memcache rows), host work only",)),
    )
    tables = []
    for bias in (False, True):
        what = f"{BIAS_SHARE:.0%} of requests with {BIAS_ENTRIES} logit-bias entries" if bias else "no logit bias"
        tables.append(
            Table(
                f"sampling: first-sight build vs sglang's from_schedule_batch, {what}",
                ("bs", "mode", "sglang µs", "ring µs", "owned µs", "x ring", "x owned", "equal"),
                tuple(build_rows(ctx, pool, sg_build, make, bias)),
                common,
            )
        )
    if hasattr(sg_build, "__self__"):  # sglang's own class: its filter_batch / merge_batch to compare with
        tables.append(
            Table(
                f"sampling: long-lived batch edits vs sglang's, filter (one finished) and merge ({JOINING} join)",
                (
                    "bs",
                    "sglang filter µs",
                    "pool filter µs",
                    "x filter",
                    "sglang merge µs",
                    "pool merge µs",
                    "x merge",
                    "equal",
                ),
                tuple(edit_rows(ctx, pool, sg_build, make)),
                (
                    *common[:3],
                    "both get the same keep indices on the device, as sglang's ScheduleBatch passes them; "
                    "pinpool's batches are owned builds",
                ),
            )
        )
    tables.append(
        Table(
            "sampling: first-sight build by phase, host µs (deterministic, no bias; medians)",
            ("bs", "sglang", "reads", "checks+pack", "stage+copy", "allocation", "ring", "owned", "sglang/reads"),
            tuple(phase_rows(ctx, pool, sg_build, make)),
            (
                "reads: the attribute reads alone (one pass for sampling_params, one per field): no build can "
                "read less; sglang/reads is the most any build could gain over sglang",
                "checks+pack = packer - reads; stage+copy = ring build - packer; allocation = owned - ring",
            ),
        )
    )
    tables.append(
        Table(
            "sampling: small-batch packer A/B (the fast path below SMALL_BATCH against the vectorised packer)",
            ("bs", "small µs", "vectorised µs", "vectorised / small"),
            tuple(packer_rows(ctx, make)),
            (f"sglang_params.SMALL_BATCH = {sglang_params.SMALL_BATCH}; same objects, host µs per call",),
        )
    )
    if ctx.is_cuda:
        tables.append(bias_device_table(ctx, pool, sg_build, make))
    pool.close()
    return tables
