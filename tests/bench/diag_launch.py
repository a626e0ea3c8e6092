"""Where a ``write_cache_indices`` call's host time goes, and what a Triton launch costs (a diagnostic).

python3 tests/bench/diag_launch.py > $OUT/diag_launch.txt

Per batch size: the whole call, its metadata build (checks included), the stage (claim,
reserve, memcpy, copy) and the kernel launch, each timed alone in a loop (medians of
blocks, the device drained at block ends); then one launch through Triton's JIT entry
(``kernel[grid](...)``: binding, specialization key, cache lookup) against the compiled
kernel's own runner (``compiled[grid](...)``).
"""

from __future__ import annotations

import logging
import statistics
import time
from collections.abc import Callable
from typing import Any

import structlog
import torch

from memcache import write_cache as wc
from memcache.req_to_token import ReqToTokenPool
from memcache.write_kernel import BLOCK, META_ROWS, _write_req_to_token_kernel, launch_checked
from pinpool import PinnedRingBuffer, PoolSettings
from pinpool.bench.memcache_vs_sglang import make_case

dev = torch.device("cuda:0" if torch.cuda.is_available() else "cpu")


def _sync() -> None:
    if dev.type == "cuda":
        torch.cuda.synchronize()


def _us(fn: Callable[[], Any], n: int = 200, rounds: int = 5) -> float:
    for _ in range(20):
        fn()
    blocks = []
    for _ in range(rounds):
        _sync()
        start = time.perf_counter()
        for _ in range(n):
            fn()
        _sync()
        blocks.append((time.perf_counter() - start) / n * 1e6)
    return statistics.median(blocks)


def _row(bs: int, pool: PinnedRingBuffer) -> list[float]:
    case = make_case(bs, dev, seed=bs)
    rtt = ReqToTokenPool(bs, 256, dev)
    lengths = tuple(case[k] for k in ("req_pool_indices", "prefix_lens", "seq_lens", "extend_lens"))
    loc, tensors = case["out_cache_loc"], case["prefix_tensors"]
    n = 20 if bs >= 1024 else 200

    def whole() -> None:
        wc.write_cache_indices(req_to_token_pool=rtt, pool=pool, **case)

    def meta() -> Any:
        small = wc._small_batch_packed(lengths, bs, loc, tensors, rtt) if bs <= wc.SMALL_BATCH else None
        return small if small is not None else wc._batch_meta(lengths, bs, loc, tensors, rtt)

    src, _ = meta()
    nbytes = META_ROWS * bs

    def stage() -> torch.Tensor:
        with pool.stage() as st:
            host, dev_meta = st.reserve(nbytes, torch.int64)
            if isinstance(src, bytes):
                host.data.cast("B")[:] = src
            else:
                host[:] = src
        return dev_meta

    dev_meta = stage()
    _sync()

    def launch() -> None:
        launch_checked(rtt.req_to_token, dev_meta, loc, bs, dev)

    row = [_us(whole, n), _us(meta, n), _us(stage, n)]
    if dev.type == "cuda":
        row.append(_us(launch, n))
        args = (rtt.req_to_token, dev_meta, loc, bs, rtt.req_to_token.stride(0))
        compiled = _write_req_to_token_kernel[(bs,)](*args, BLOCK=BLOCK)
        runner = compiled[(bs, 1, 1)]
        row.append(_us(lambda: _write_req_to_token_kernel[(bs,)](*args, BLOCK=BLOCK), n))
        try:
            row.append(_us(lambda: runner(*args, BLOCK), n))
        except Exception as err:  # the runner's calling convention differs by Triton release
            print(f"runner launch failed: {type(err).__name__}: {err}")
            row.append(float("nan"))
    return row


def main() -> None:
    structlog.configure(wrapper_class=structlog.make_filtering_bound_logger(logging.WARNING))
    pool = PinnedRingBuffer(PoolSettings(device=dev, num_slots=8, slot_bytes=1 << 20))
    print("   bs  whole µs  meta µs  stage µs  launch µs  jit-launch µs  runner-launch µs")
    for bs in (1, 64, 256, 1024, 4096):
        row = _row(bs, pool)
        print(f"{bs:5d} " + "  ".join(f"{v:9.1f}" for v in row), flush=True)
    pool.close()


if __name__ == "__main__":
    main()
