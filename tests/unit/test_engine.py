"""The reference decode loop on CPU: every mode agrees (pool-zc included), the KV cache is
really used, and every row and KV slot comes back."""

from __future__ import annotations

import pytest
import torch

from pinpool import PlatformReport
from pinpool.bench.engine import MODES, Engine, EngineConfig, ModelConfig, Workload, make_requests
from pinpool.bench.engine.model import KVCache, TinyDecoder
from pinpool.exceptions import PlatformError
from pinpool.transport import HostTransport

CFG = ModelConfig(vocab_size=500, hidden=64, layers=2, heads=4, ffn=128, max_context_len=96)
CPU = torch.device("cpu")


def run(mode: str, wl: Workload, max_running: int = 6) -> tuple[dict[int, list[int]], Engine]:
    engine = Engine(CFG, mode, CPU, EngineConfig(max_running=max_running, kv_slots=2048))  # type: ignore[arg-type]
    return engine.run(make_requests(wl, CFG.vocab_size)), engine


def test_every_mode_gives_identical_token_streams() -> None:
    """Catches a staging mode that lands different values (or a schedule that depends on the mode)."""
    wl = Workload(num_requests=14, arrival_gap=0.7, seed=3)
    streams = {mode: run(mode, wl)[0] for mode in MODES}
    assert "pool-zc" in streams
    assert all(streams[mode] == streams["sync"] for mode in MODES)
    assert sum(len(v) for v in streams["pool"].values()) > 14


@pytest.mark.parametrize("mode", ["pool", "pool-zc"])
@pytest.mark.parametrize("land_tokens", [True, False], ids=["landed", "read-back"])
def test_pool_modes_decode_through_their_exchanges_and_match_sync_token_for_token(mode: str, land_tokens: bool) -> None:
    """Catches pool-zc falling back to copy exchanges, a landed decode step that still queues a
    read-back copy (or a read-back step that queues none), or in-place rows/positions, landed
    tokens or the in-stage read-back giving other tokens than sync mode, across prefills,
    filters and shared prefixes."""
    wl = Workload(num_requests=16, arrival_gap=0.6, shared_prefixes=2, shared_len=6, seed=9)
    want, _ = run("sync", wl, max_running=5)
    engine = Engine(CFG, mode, CPU, EngineConfig(max_running=5, kv_slots=2048, land_tokens=land_tokens))  # type: ignore[arg-type]
    assert engine.land_tokens == land_tokens  # the host path passes the platform check
    engine.submit(make_requests(wl, CFG.vocab_size))
    kinds = []
    while engine.busy:
        kinds.append(engine.step())
    decodes, prefills = kinds.count("decode"), kinds.count("prefill")
    assert engine.finished_outputs == want
    stats = engine.pool.stats()
    assert decodes > 20
    assert stats.zero_copy_stages == (decodes if mode == "pool-zc" else 0)  # one zero-copy exchange per decode step
    # Each decode's tokens come back through its exchange's slot: stored there by the sampler
    # (no read-back), or copied by a read-back; each prefill's by a read-back of its own.
    assert stats.readbacks == prefills + (0 if land_tokens else decodes)


def test_pool_zc_is_refused_at_creation_where_the_platform_refused(monkeypatch: pytest.MonkeyPatch) -> None:
    """Catches pool-zc starting on a platform whose check failed: it would fail mid-decode instead
    of saying why up front."""

    def refuse(self: HostTransport, host_slab: torch.Tensor) -> tuple[PlatformReport, torch.Tensor | None]:
        return PlatformReport(checked=True, zero_copy_ok=False, reason="the slab is not page-locked"), None

    monkeypatch.setattr(HostTransport, "check_zero_copy", refuse)
    with pytest.raises(PlatformError, match="not page-locked"):
        Engine(CFG, "pool-zc", CPU, EngineConfig())
    Engine(CFG, "pool", CPU, EngineConfig())  # the copy modes still start


def test_resources_return_to_the_pools() -> None:
    """Catches a row or KV slot leaked by a finished request (including the overlap step's slot)."""
    wl = Workload(num_requests=12, arrival_gap=0.5, shared_prefixes=2, shared_len=8, seed=5)
    _, engine = run("pool", wl, max_running=4)
    assert engine.rtt.available_size() == engine.rtt.size
    cached = sum(t.numel() for t in engine.prefix_cache.values())
    assert engine.kv.available_size() == 2048 - cached
    assert not engine.running


def reference_greedy(prompt: list[int], new_tokens: int) -> list[int]:
    """Recompute every step from scratch in a fresh cache: no reuse, no batching."""
    model = TinyDecoder(CFG, CPU)
    seq = list(prompt)
    out = []
    for _ in range(new_tokens):
        n = len(seq)
        cache = KVCache(CFG, n, CPU)
        rtt = torch.zeros(1, CFG.max_context_len, dtype=torch.int32)
        rtt[0, :n] = torch.arange(1, n + 1, dtype=torch.int32)
        logits = model.forward(
            torch.tensor(seq),
            torch.arange(n),
            torch.zeros(n, dtype=torch.int64),
            torch.arange(1, n + 1),
            torch.tensor([n - 1]),
            rtt,
            cache,
            n,
        )
        out.append(int(logits.argmax()))
        seq.append(out[-1])
    return out


def test_greedy_requests_match_a_recompute_without_cache() -> None:
    """Catches KV written to the wrong slot, a wrong req_to_token row, or a shared prefix mis-reused."""
    wl = Workload(num_requests=10, arrival_gap=0.5, greedy_share=1.0, shared_prefixes=2, shared_len=10, seed=7)
    reqs = make_requests(wl, CFG.vocab_size)
    engine = Engine(CFG, "pool", CPU, EngineConfig(max_running=4, kv_slots=2048))
    engine.run(reqs)
    reused = [r for r in reqs if r.prefix_group is not None and r.owned_from == r.shared_len]
    assert reused, "the workload must reuse a cached prefix"
    for r in reqs:
        assert r.output == reference_greedy(r.prompt, len(r.output))[: len(r.output)], r.rid
