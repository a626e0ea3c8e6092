"""One decode-loop worker per GPU, each with its own pool on its own device.

    torchrun --nproc-per-node 2 -m engine.distributed

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

from engine.loop import Engine, EngineConfig
from engine.model import ModelConfig
from engine.requests import Request, Workload, make_requests

CFG = ModelConfig()
ENGINE = EngineConfig(max_running=16)


def requests_of(rank: int) -> list[Request]:
    return make_requests(
        Workload(num_requests=24, arrival_gap=0.5, seed=100 + rank), CFG.vocab_size, rid_base=1000 * rank
    )


def main() -> int:
    dist.init_process_group("nccl")
    rank, world = dist.get_rank(), dist.get_world_size()
    device = torch.device("cuda", int(os.environ.get("LOCAL_RANK", rank)))
    torch.cuda.set_device(device)
    engine = Engine(CFG, "pool", device, ENGINE)
    streams = engine.run(requests_of(rank))
    torch.cuda.synchronize()
    own = engine.pool.device_mirror.device == device and engine.cache.k.device == device
    elsewhere = [d for d in range(torch.cuda.device_count()) if d != device.index and torch.cuda.memory_reserved(d)]
    gathered: list[Any] = [None] * world
    dist.all_gather_object(gathered, (streams, own, elsewhere))
    ok = True
    if rank == 0:
        for r, (rank_streams, rank_own, rank_elsewhere) in enumerate(gathered):
            single = Engine(CFG, "pool", device, ENGINE).run(requests_of(r))
            same = single == rank_streams
            tokens = sum(len(v) for v in rank_streams.values())
            print(
                f"rank {r}: {len(rank_streams)} requests, {tokens} tokens; equal to a single-GPU run: {same}; "
                f"pool on its own device: {rank_own}; memory on other GPUs: {rank_elsewhere or 'none'}",
                flush=True,
            )
            ok &= same and rank_own and not rank_elsewhere
        print("TWO-GPU CHECK", "PASSED" if ok else "FAILED", flush=True)
    flag = torch.tensor([int(ok)], device=device)
    dist.broadcast(flag, 0)
    dist.destroy_process_group()
    return 0 if bool(flag.item()) else 1  # sync-ok: end of the run


if __name__ == "__main__":
    sys.exit(main())
