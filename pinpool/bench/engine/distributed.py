"""One decode-loop worker per GPU, each with its own pool on its own device.

    torchrun --nproc-per-node 2 -m pinpool.bench.engine.distributed

Every rank serves its own requests; rank 0 then replays each rank's requests alone on one
GPU and checks the token streams are equal, and every rank checks that nothing of its
pool (mirror, pinned slab's context, events) landed on another device.
"""

from __future__ import annotations

import os
import sys
from typing import Any

import torch
import torch.distributed as dist

from pinpool.bench.engine.loop import Engine, EngineConfig
from pinpool.bench.engine.model import ModelConfig
from pinpool.bench.engine.requests import Request, Workload, make_requests

ENGINE = EngineConfig(max_running=16)
#: The CPU rehearsal (gloo, no GPU) runs a smaller model so CI can afford it.
SMALL = ModelConfig(vocab_size=2000, hidden=64, layers=2, heads=4, ffn=128, max_context_len=128)


def requests_of(rank: int, cfg: ModelConfig) -> list[Request]:
    return make_requests(
        Workload(num_requests=24, arrival_gap=0.5, seed=100 + rank), cfg.vocab_size, rid_base=1000 * rank
    )


def main() -> int:
    cuda = torch.cuda.is_available()
    dist.init_process_group("nccl" if cuda else "gloo")
    rank, world = dist.get_rank(), dist.get_world_size()
    cfg = ModelConfig() if cuda else SMALL
    if cuda:
        device = torch.device("cuda", int(os.environ.get("LOCAL_RANK", rank)))
        torch.cuda.set_device(device)
    else:
        device = torch.device("cpu")
    engine = Engine(cfg, "pool", device, ENGINE)
    streams = engine.run(requests_of(rank, cfg))
    own = engine.pool.device_mirror.device == device and engine.cache.k.device == device
    elsewhere = []
    if cuda:
        torch.cuda.synchronize()  # sync-ok: end of the rank's run, before reading memory stats
        elsewhere = [d for d in range(torch.cuda.device_count()) if d != device.index and torch.cuda.memory_reserved(d)]
    gathered: list[Any] = [None] * world
    dist.all_gather_object(gathered, (streams, own, elsewhere))
    ok = True
    if rank == 0:
        for r, (rank_streams, rank_own, rank_elsewhere) in enumerate(gathered):
            single = Engine(cfg, "pool", device, ENGINE).run(requests_of(r, cfg))
            same = single == rank_streams
            tokens = sum(len(v) for v in rank_streams.values())
            print(
                f"rank {r}: {len(rank_streams)} requests, {tokens} tokens; equal to a single-device run: {same}; "
                f"pool on its own device: {rank_own}; memory on other GPUs: {rank_elsewhere or 'none'}",
                flush=True,
            )
            ok &= same and rank_own and not rank_elsewhere
        print("TWO-GPU CHECK" if cuda else "TWO-WORKER CHECK (CPU)", "PASSED" if ok else "FAILED", flush=True)
    flag = torch.tensor([int(ok)], device=device)
    dist.broadcast(flag, 0)
    dist.destroy_process_group()
    return 0 if bool(flag.item()) else 1  # sync-ok: end of the run


if __name__ == "__main__":
    sys.exit(main())
