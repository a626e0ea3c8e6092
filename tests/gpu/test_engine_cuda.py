"""The reference decode loop on CUDA: modes agree (pool-zc where the platform allows
zero-copy), pool-mode decode steps make no host sync, and pinned allocations stay flat over
1000 steps."""

from __future__ import annotations

import pytest
import torch

from pinpool.bench.engine import MODES, Engine, EngineConfig, ModelConfig, Workload, make_requests
from pinpool.bench.engine.bench import zero_copy_refusal
from pinpool.testing import no_sync

DEV = torch.device("cuda", 0)
CFG = ModelConfig()
#: Why zero-copy stages are refused on this host (the pool's start-up check), or None.
ZERO_COPY_REFUSAL = zero_copy_refusal(DEV) if torch.cuda.is_available() else "no CUDA"


def test_every_mode_identical_token_streams_on_gpu() -> None:
    """Catches a mode whose staged values differ (they would change sampled tokens), pool-zc's
    in-place rows and positions included."""
    wl = Workload(num_requests=40, arrival_gap=0.5, seed=11)
    modes = [m for m in MODES if m != "pool-zc" or ZERO_COPY_REFUSAL is None]
    streams: dict[str, dict[int, list[int]]] = {}
    for mode in modes:
        engine = Engine(CFG, mode, DEV, EngineConfig(max_running=16))
        assert engine.land_tokens == (mode in ("pool", "pool-zc")), "pool modes land their tokens by default"
        streams[mode] = engine.run(make_requests(wl, CFG.vocab_size))
    for mode in ("pool", "pool-zc"):  # the read-back copy instead of the sampler's landing
        if mode in modes:
            engine = Engine(CFG, mode, DEV, EngineConfig(max_running=16, land_tokens=False))
            streams[f"{mode} read-back"] = engine.run(make_requests(wl, CFG.vocab_size))
    assert all(tokens == streams["sync"] for tokens in streams.values())


@pytest.mark.parametrize("land_tokens", [True, False], ids=["landed", "read-back"])
@pytest.mark.parametrize("mode", ["pool", "pool-zc"])
def test_pool_decode_steps_make_no_host_sync_and_read_only_landed_tokens(mode: str, land_tokens: bool) -> None:
    """Catches a sync in the decode step, or a token read that waits on the GPU (pool-zc: also a
    zero-copy exchange that issues an upload copy; landed: also a read-back copy queued anyway)."""
    if mode == "pool-zc" and ZERO_COPY_REFUSAL is not None:
        pytest.skip(f"zero-copy refused on this host: {ZERO_COPY_REFUSAL}")
    engine = Engine(CFG, mode, DEV, EngineConfig(max_running=16, land_tokens=land_tokens))  # type: ignore[arg-type]
    assert engine.land_tokens == land_tokens
    engine.submit(make_requests(Workload(num_requests=16, arrival_gap=0, new_tokens=(10, 30), seed=3), CFG.vocab_size))
    while engine.step() != "decode" or engine.iteration < 6:
        pass
    torch.cuda.synchronize()
    zero_copy_before, readbacks_before = engine.pool.stats().zero_copy_stages, engine.pool.stats().readbacks
    with no_sync():  # a blocking read raises here: Event.synchronize is refused inside
        for _ in range(12):
            assert engine.step() == "decode"
    assert engine.pool.stats().readback_waits == 0
    assert engine.pool.stats().readbacks - readbacks_before == (0 if land_tokens else 12)
    assert engine.pool.stats().zero_copy_stages - zero_copy_before == (12 if mode == "pool-zc" else 0)
    assert len(engine.running) < 16, "requests must leave during the window, so filtering ran under no_sync"
    while engine.busy:
        engine.step()


def test_pinned_allocations_flat_over_1000_decode_steps() -> None:
    """Catches per-step pinned allocations creeping back into the pool-mode loop."""
    engine = Engine(CFG, "pool", DEV, EngineConfig(max_running=32))
    engine.submit(make_requests(Workload(num_requests=1200, arrival_gap=1.5, seed=5), CFG.vocab_size))
    decodes = 0
    while decodes < 50:
        decodes += engine.step() == "decode"
    torch.cuda.synchronize()
    before = torch.cuda.host_memory_stats()["num_host_alloc"]
    while decodes < 1050 and engine.busy:
        decodes += engine.step() == "decode"
    torch.cuda.synchronize()
    assert decodes == 1050
    assert torch.cuda.host_memory_stats()["num_host_alloc"] == before
