"""Where the host time of sglang's first-sight calls goes on a GPU machine (a diagnostic, not a test).

python3 tests/bench/diag_first_sight.py > $OUT/diag_first_sight.txt

sglang's own ``SamplingParams`` objects (from ``.sglang/``), new objects every call as in the
``sampling_sglang`` bench: cProfile of a ring build, an owned build, ``filter_batch`` and
``write_cache_indices`` with fresh prefix tensors, at bs 64; then the host µs of the single
CUDA-facing calls those paths make, on this machine.
"""

from __future__ import annotations

import cProfile
import io
import logging
import pstats
import time
from collections.abc import Callable
from itertools import cycle
from typing import Any

import structlog
import torch

from memcache.req_to_token import ReqToTokenPool
from memcache.write_cache import write_cache_indices
from pinpool import PinnedRingBuffer, PoolSettings
from pinpool.bench.memcache_vs_sglang import _lists, fresh_prefixes, make_case
from pinpool.bench.sampling_vs_sglang import fresh_batches
from pinpool.bench.sglang_sampling import load_params_class
from sampling.batch_info import SamplingBatchInfo

CALLS = 400
CUDA = torch.cuda.is_available()  # without: a smoke run of the script on CPU


def sync() -> None:
    if CUDA:
        torch.cuda.synchronize()


def profile(label: str, fn: Callable[[], Any], calls: int = CALLS) -> None:
    for _ in range(50):  # first launches load kernels and compile: not what a steady engine pays
        fn()
    sync()
    prof = cProfile.Profile()
    start = time.perf_counter()
    prof.enable()
    for _ in range(calls):
        fn()
    prof.disable()
    sync()
    per_call = (time.perf_counter() - start) / calls * 1e6
    out = io.StringIO()
    pstats.Stats(prof, stream=out).sort_stats("tottime").print_stats(18)
    print(f"\n######## {label} ({calls} calls, {per_call:.1f} µs per call under cProfile)\n{out.getvalue()}")


def host_us(label: str, fn: Callable[[], Any], calls: int = 2000) -> None:
    for _ in range(100):
        fn()
    sync()
    samples = []
    for _ in range(calls):
        start = time.perf_counter()
        fn()
        samples.append(time.perf_counter() - start)
    sync()
    samples.sort()
    print(f"{label:<48} {samples[len(samples) // 2] * 1e6:8.2f} µs")


def main() -> None:
    structlog.configure(wrapper_class=structlog.make_filtering_bound_logger(logging.WARNING))
    dev = torch.device("cuda", 0) if CUDA else torch.device("cpu")
    pool = PinnedRingBuffer(PoolSettings(device=dev, num_slots=8, slot_bytes=1 << 20))
    make, source = load_params_class()
    print("requests:", source)
    bs = 64
    batches = cycle(fresh_batches(make, bs, dev, False, seed=bs))
    for owned in (False, True):
        profile(
            f"from_schedule_batch bs={bs} deterministic owned={owned}",
            lambda owned=owned: SamplingBatchInfo.from_schedule_batch(
                next(batches), 32000, pool, owned=owned, deterministic=True
            ),
        )
    built = [SamplingBatchInfo.from_schedule_batch(next(batches), 32000, pool, owned=True) for _ in range(CALLS + 50)]
    keep = [i for i in range(bs) if i != bs // 2]
    keep_device = torch.tensor(keep, dtype=torch.int64, device=dev)
    edits = iter(built)
    profile(
        f"filter_batch bs={bs}, one finished, keep on the device", lambda: next(edits).filter_batch(keep, keep_device)
    )
    joining = [SamplingBatchInfo.from_schedule_batch(next(batches), 32000, pool, owned=True) for _ in range(CALLS + 50)]
    pairs = zip(built[::-1], joining, strict=True)
    profile(f"merge_batch bs={bs} + {bs}", lambda: (lambda a, b: a.merge_batch(b))(*next(pairs)))
    case = make_case(bs, dev)
    rtt = ReqToTokenPool(bs, 256, dev)
    prefixes = iter([fresh_prefixes(case) for _ in range(CALLS + 50)])
    args = _lists(case)
    profile(
        f"write_cache_indices bs={bs}, fresh prefixes",
        lambda: write_cache_indices(req_to_token_pool=rtt, pool=pool, prefix_tensors=next(prefixes), **args),
    )
    if not CUDA:
        return
    print("\n######## single calls, host µs (median of 2000)")
    stream = torch.cuda.current_stream()
    event = torch.cuda.Event()
    src = torch.empty(4096, dtype=torch.uint8, pin_memory=True)
    dst = torch.empty(4096, dtype=torch.uint8, device=dev)
    host_us("torch.cuda.current_stream()", torch.cuda.current_stream)
    host_us("torch.cuda.is_current_stream_capturing()", torch.cuda.is_current_stream_capturing)
    host_us("event.record(stream)", lambda: event.record(stream))
    host_us("event.query()", event.query)
    host_us("dst.copy_(pinned src, non_blocking=True)", lambda: dst.copy_(src, non_blocking=True))
    host_us("torch.empty(4096 B, device)", lambda: torch.empty(4096, dtype=torch.uint8, device=dev))
    host_us("dst.view(torch.int32)", lambda: dst.view(torch.int32))
    host_us("dst.split_with_sizes((64, 64, 64, 64, 128))", lambda: dst.split_with_sizes((64, 64, 64, 64, 128, 3712)))
    host_us("dst.as_strided((4, 64), (64, 1))", lambda: dst.as_strided((4, 64), (64, 1)))
    host_us("dst.new_empty(384)", lambda: dst.new_empty(384))
    idx = torch.arange(63, device=dev)
    host_us("dst[idx] (index on device)", lambda: dst[idx])
    quad, out = dst.as_strided((4, 64), (64, 1)), torch.empty((4, 63), dtype=torch.uint8, device=dev)
    host_us("torch.index_select(quad, 1, idx, out=out)", lambda: torch.index_select(quad, 1, idx, out=out))
    host_us("torch.cat of 10 pieces", lambda: torch.cat([dst[:64]] * 10))
    host_us("torch.tensor(64).to(dev, non_blocking)", lambda: torch.tensor([0.5] * 64).to(dev, non_blocking=True))
    print("pool stalls:", pool.stats().stalls)


if __name__ == "__main__":
    main()
