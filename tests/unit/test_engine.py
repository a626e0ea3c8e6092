"""The reference decode loop on CPU: the four modes agree, the KV cache is really used,
and every row and KV slot comes back."""

from __future__ import annotations

import torch

from engine import MODES, Engine, EngineConfig, ModelConfig, Workload, make_requests
from engine.model import KVCache, TinyDecoder

CFG = ModelConfig(vocab_size=500, hidden=64, layers=2, heads=4, ffn=128, max_context_len=96)
CPU = torch.device("cpu")


def run(mode: str, wl: Workload, max_running: int = 6) -> tuple[dict[int, list[int]], Engine]:
    engine = Engine(CFG, mode, CPU, EngineConfig(max_running=max_running, kv_slots=2048))  # type: ignore[arg-type]
    return engine.run(make_requests(wl, CFG.vocab_size)), engine


def test_all_four_modes_give_identical_token_streams() -> None:
    """Catches a staging mode that lands different values (or a schedule that depends on the mode)."""
    wl = Workload(num_requests=14, arrival_gap=0.7, seed=3)
    streams = {mode: run(mode, wl)[0] for mode in MODES}
    assert all(streams[mode] == streams["sync"] for mode in MODES)
    assert sum(len(v) for v in streams["pool"].values()) > 14


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
