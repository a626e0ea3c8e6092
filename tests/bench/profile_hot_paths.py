"""Where host time goes in the hot paths on a GPU machine (cProfile; a diagnostic, not a test).

python3 tests/bench/profile_hot_paths.py > $OUT/profile.txt
"""

from __future__ import annotations

import cProfile
import io
import logging
import pstats
from collections.abc import Callable
from functools import partial
from typing import Any

import structlog
import torch

from memcache.req_to_token import ReqToTokenPool
from memcache.write_cache import write_cache_indices
from pinpool import PinnedRingBuffer, PoolSettings
from pinpool.bench.memcache_bench import make_case
from pinpool.bench.sampling_bench import make_batch
from pinpool.bench.staging import make_step
from sampling.batch_info import SamplingBatchInfo


def profile(label: str, fn: Callable[[], Any], calls: int = 2000) -> None:
    for _ in range(200):
        fn()
    torch.cuda.synchronize()
    prof = cProfile.Profile()
    prof.enable()
    for _ in range(calls):
        fn()
    prof.disable()
    torch.cuda.synchronize()
    out = io.StringIO()
    pstats.Stats(prof, stream=out).sort_stats("tottime").print_stats(14)
    print(f"\n######## {label} ({calls} calls)\n{out.getvalue()}")


def main() -> None:
    structlog.configure(wrapper_class=structlog.make_filtering_bound_logger(logging.WARNING))
    dev = torch.device("cuda", 0)
    pool = PinnedRingBuffer(PoolSettings(device=dev, num_slots=8, slot_bytes=1 << 20))
    for bs in (1, 64, 1024):
        case = make_case(bs, dev)
        rtt = ReqToTokenPool(bs, 256, dev)
        profile(f"write_cache_indices bs={bs}", partial(write_cache_indices, req_to_token_pool=rtt, pool=pool, **case))
    batch = make_batch(1, dev)
    profile(
        "from_schedule_batch owned bs=1", partial(SamplingBatchInfo.from_schedule_batch, batch, 32000, pool, owned=True)
    )
    profile("staging pool bs=1", make_step("pool", 1, dev, pool))
    print("stalls:", pool.stats().stalls)


if __name__ == "__main__":
    main()
