"""Where ``write_cache_indices``' host time goes with fresh prefix tensors, beside sglang's caller path.

Run: ``python tests/bench/diag_write_cache.py [--device cuda] [--sizes 1,64,256,1024,4096]``.

Per batch size, medians of ``CALLS`` calls, each phase timed alone on prefix tensors it has
never seen (made as ``pinpool.bench.memcache_vs_sglang`` makes them, kept alive until the row ends so
no release is timed), on an idle device:

- pool: ``meta`` (the length rules, the gather of the requests with a prefix and their
  batched check: ``_small_batch_packed`` or ``_batch_meta``), ``prefix check``
  (``tagged_addresses`` alone), ``whole`` (the call); stage + launch = whole - meta.
- sglang: ``uploads`` (its four pinned int64 uploads), ``pointers`` (its list of
  ``data_ptr()`` and their pinned upload), ``whole`` (its caller path); the launch is the rest.
- ``release``: dropping one batch's prefix list (its tensors' last reference), which sglang's
  ``alloc_for_extend`` does on return and the pool's ring does when it reclaims the slot.
- per rule: each C-level pass of the batched check alone, ns a tensor, fresh and warm.

On CPU the kernels cannot run; both launches are no-ops, as in the bench's CPU rows.
"""

from __future__ import annotations

import argparse
import statistics
import time
from collections.abc import Callable
from functools import partial
from operator import attrgetter
from typing import Any

import numpy as np
import torch

from memcache import bench_sglang, prefix_check, write_cache
from memcache.req_to_token import ReqToTokenPool
from pinpool import PinnedRingBuffer, PoolSettings
from pinpool.bench.sglang_memcache import _pin, load

CALLS = 200
_T = torch.Tensor
RULES: dict[str, Callable[[list[torch.Tensor]], Any]] = {
    "data_ptr (sglang's floor)": lambda ts: [t.data_ptr() for t in ts],
    "data_ptr map->numpy": lambda ts: np.fromiter(map(_T.data_ptr, ts), np.int64, len(ts)),
    "dtype->tag map->numpy": lambda ts: np.fromiter(
        map(prefix_check._TAGS.__getitem__, map(attrgetter("dtype"), ts)), np.int64, len(ts)
    ),
    "get_device set": lambda ts: set(map(_T.get_device, ts)),
    "device set (objects)": lambda ts: set(map(attrgetter("device"), ts)),
    "is_cpu all": lambda ts: all(map(attrgetter("is_cpu"), ts)),
    "dim set": lambda ts: set(map(_T.dim, ts)),
    "is_contiguous all": lambda ts: all(map(_T.is_contiguous, ts)),
    "stride set": lambda ts: set(map(_T.stride, ts)),
    "numel map->numpy": lambda ts: np.fromiter(map(_T.numel, ts), np.int64, len(ts)),
    "storage_offset map": lambda ts: list(map(_T.storage_offset, ts)),
}


def median_us(
    ctx_sync: Callable[[], None], fn: Callable[[Any], Any], make: Callable[[], Any], calls: int = CALLS
) -> float:
    held, samples = [], []
    for _ in range(calls):
        given = make()
        ctx_sync()
        start = time.perf_counter_ns()
        fn(given)
        samples.append((time.perf_counter_ns() - start) / 1e3)
        held.append(given)
    return statistics.median(samples)


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--device", default="cuda" if torch.cuda.is_available() else "cpu")
    parser.add_argument("--sizes", default="1,64,256,1024,4096")
    args = parser.parse_args()
    device = torch.device(args.device)
    cuda = device.type == "cuda"
    torch.set_num_threads(1)  # see pinpool.bench.memcache_vs_sglang: the CPU pool's copy wakes torch's thread pool

    def sync() -> None:
        if cuda:
            torch.cuda.synchronize(device)

    write, source = load()
    print(f"sglang side: {source}; device {device}; medians of {CALLS} calls, µs")
    pool = PinnedRingBuffer(PoolSettings.from_env(device=device, num_slots=8, slot_bytes=1 << 20))
    head = ("bs", "pool meta", "pool check", "pool whole", "sg uploads", "sg pointers", "sg whole", "release")
    print("".join(f"{h:>13}" for h in head))
    rule_rows: list[tuple[int, str, float, float]] = []
    with bench_sglang._no_launches(write) if not cuda else bench_sglang._nothing():
        for bs in [int(s) for s in args.sizes.split(",")]:
            figures = _row(bs, device, write, pool, sync, rule_rows)
            print(f"{bs:>13}" + "".join(f"{v:>13.1f}" for v in figures), flush=True)
    pool.close()
    print("\nper rule, ns a tensor (tensors with a prefix only): fresh / warm")
    for bs, name, fresh_ns, warm_ns in rule_rows:
        print(f"{bs:>6}  {name:28s} {fresh_ns:8.1f} {warm_ns:8.1f}")


def _row(
    bs: int,
    device: torch.device,
    write: Any,
    pool: PinnedRingBuffer,
    sync: Callable[[], None],
    rule_rows: list[tuple[int, str, float, float]],
) -> list[float]:
    case = bench_sglang.make_case(bs, device, seed=bs)
    rtt = ReqToTokenPool(bs, bench_sglang.MAX_LEN, device)
    ref = ReqToTokenPool(bs, bench_sglang.MAX_LEN, device)
    lists = ("req_pool_indices", "prefix_lens", "seq_lens", "extend_lens")
    lengths = tuple(case[k] for k in lists)
    prefix = case["prefix_lens"]
    rows = [i for i, p in enumerate(prefix) if p]
    needs = [prefix[i] for i in rows]
    build = write_cache._small_batch_packed if bs <= write_cache.SMALL_BATCH else write_cache._batch_meta

    def new() -> list[torch.Tensor]:
        return bench_sglang.fresh_prefixes(case)

    def meta(ts: list[torch.Tensor]) -> None:
        build(lengths, bs, case["out_cache_loc"], ts, rtt)

    def check(ts: list[torch.Tensor]) -> None:
        prefix_check.tagged_addresses([ts[i] for i in rows], rows, needs, device)

    def uploads(ts: list[torch.Tensor]) -> None:
        cpu = [torch.tensor(case[k], dtype=torch.int64, pin_memory=_pin(device)) for k in lists]
        [t.to(device, non_blocking=True) for t in cpu]

    def pointers(ts: list[torch.Tensor]) -> None:
        up = torch.tensor([t.data_ptr() for t in ts], dtype=torch.uint64, pin_memory=_pin(device))
        up.to(device, non_blocking=True)

    figures = [
        median_us(sync, meta, new),
        median_us(sync, check, new),
        median_us(sync, partial(bench_sglang._ours, case, rtt, pool), new),
        median_us(sync, uploads, new),
        median_us(sync, pointers, new),
        median_us(sync, partial(bench_sglang._theirs, write, case, ref), new),
        median_us(sync, list.clear, new),
    ]
    if len(rows) >= 500:

        def kept_new() -> list[torch.Tensor]:
            ts = new()
            return [ts[i] for i in rows]

        warm = kept_new()
        for name, rule in RULES.items():
            fresh_ns = median_us(sync, rule, kept_new, 50) * 1e3 / len(rows)
            warm_ns = median_us(sync, rule, lambda: warm, 50) * 1e3 / len(rows)
            rule_rows.append((bs, name, fresh_ns, warm_ns))
    return figures


if __name__ == "__main__":
    main()
