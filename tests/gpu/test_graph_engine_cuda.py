"""CUDA-graph decode (engine.graph_loop) on the GPU: captured graphs sample the plain calls'
tokens in every staging mode, the modes agree, pool mode stays correct when the host runs far
ahead of a lagging device (block copy on either stream, tokens landed by the replay or read
back), the engine works with another device current, and a steady pool-mode decode step makes
no host sync, exactly one host-to-device copy, and no copy back when the replay lands its tokens.

One workload (``WL``) serves the comparisons; its token streams per (mode, capture) on cuda:0
are computed once (``tokens``) and shared between tests.
"""

from __future__ import annotations

import functools
import gc
from collections import Counter
from typing import Literal

import attrs
import pytest
import torch
from torch.profiler import ProfilerActivity, profile

from pinpool.bench.engine import EngineConfig, ModelConfig, Workload, make_requests
from pinpool.bench.engine.graph_loop import GRAPH_MODES, GraphConfig, GraphEngine, GraphMode
from pinpool.bench.engine.requests import Request

DEV = torch.device("cuda", 0)
CFG = ModelConfig(max_context_len=160)
ECFG = EngineConfig(max_running=16, kv_slots=8192)
#: Arrivals spread over the run: prefills land between decodes, requests finish at different steps.
WL = Workload(num_requests=24, arrival_gap=0.5, new_tokens=(8, 30), seed=5)
#: Up to this many cycles (~1 ms) of GPU sleep before each replay: the host runs ahead of the device.
LAG = 2_000_000
TWO_GPUS = torch.cuda.device_count() >= 2
needs_two = pytest.mark.skipif(not TWO_GPUS, reason="needs two CUDA devices")

Outputs = dict[int, list[int]]
UploadStream = Literal["schedule", "forward"]


def run(mode: GraphMode, graph_cfg: GraphConfig, device: torch.device = DEV) -> tuple[Outputs, GraphEngine]:
    engine = GraphEngine(CFG, mode, device, ECFG, graph_cfg)
    outputs = engine.run(make_requests(WL, CFG.vocab_size))
    torch.cuda.synchronize(device)
    assert not engine.busy and engine.replays > 0
    if graph_cfg.capture:
        assert len(engine.graphs._graphs) == len(engine.graphs.sizes), "every size must have a captured graph"
    return outputs, engine


@functools.cache
def tokens(mode: GraphMode, capture: bool) -> Outputs:
    """``WL``'s token streams in ``mode`` on cuda:0 with cuda:0 current (computed once per session)."""
    outputs, _ = run(mode, GraphConfig(capture=capture))
    return outputs


def assert_same(got: Outputs, want: Outputs, what: str) -> None:
    differ = sorted(rid for rid in want if got.get(rid) != want[rid])
    assert got.keys() == want.keys() and not differ, f"{what}: requests {differ} sampled other tokens"


def check_step_log(engine: GraphEngine) -> None:
    """Each replay read the block of its own step (``GraphConfig(check_steps=True)``, pool mode)."""
    torch.cuda.synchronize(engine.device)
    n = engine.replays
    assert engine.graphs.seen_steps[1 : n + 1].tolist() == list(range(1, n + 1))
    assert engine.graphs.seen_positions[1 : n + 1].tolist() == engine.expected_positions
    assert len(engine.expected_positions) == n
    assert int(engine.graphs.seen_steps[n + 1]) == -1


# -- captured vs plain, and mode vs mode ----------------------------------------------------


@pytest.mark.parametrize("mode", GRAPH_MODES)
def test_captured_graphs_sample_the_plain_calls_tokens(mode: GraphMode) -> None:
    """Catches a graph that reads an address other than the one its mode writes (a view made
    after capture, a temporary freed and reused), or a host branch frozen at capture."""
    captured = tokens(mode, True)
    assert sum(len(v) for v in captured.values()) > 4 * WL.num_requests
    assert_same(captured, tokens(mode, False), f"{mode}: captured vs plain calls")


def test_every_graph_mode_samples_the_same_tokens() -> None:
    """Catches a staging mode whose graph inputs differ from the others' on the device."""
    want = tokens("pool", True)
    for mode in GRAPH_MODES:
        assert_same(tokens(mode, True), want, f"{mode} vs pool")


# -- pool mode with a lagging device --------------------------------------------------------


@pytest.mark.parametrize("land_tokens", [True, False], ids=["landed", "read-back"])
@pytest.mark.parametrize("upload_stream", ["schedule", "forward"])
def test_pool_mode_under_lag_replays_exactly_the_step_it_staged(upload_stream: UploadStream, land_tokens: bool) -> None:
    """Catches a block copy that overtakes the replay still reading the previous step's block, or
    a replay that starts before its step's copy landed: with the host far ahead, either makes a
    replay log another step's number or position (and usually changes tokens). "schedule": the
    copy on the scheduler's stream, the forward stream a registered reader of the block;
    "forward": copy and replays ordered by one stream. "landed": the replay stores its tokens in
    the step's slot, and a fence that did not follow the replay (on the forward stream, when the
    stage's stream is the scheduler's) would let the host read a slot the replay has not written."""
    cfg = GraphConfig(lag_cycles=LAG, check_steps=True, upload_stream=upload_stream, land_tokens=land_tokens)
    outputs, engine = run("pool", cfg)
    assert engine.land_tokens == land_tokens
    readers = engine.graphs.block.readers
    if upload_stream == "schedule":
        assert engine.upload_stream is engine.schedule_stream
        assert engine.schedule_stream is not None and engine.forward_stream is not None
        assert engine.schedule_stream.stream_id != engine.forward_stream.stream_id
        assert [r.stream_id for r in readers] == [engine.forward_stream.stream_id]
    else:
        assert engine.upload_stream is engine.forward_stream and not readers
    assert_same(outputs, tokens("pool", True), f"lagged, copy on the {upload_stream} stream")
    check_step_log(engine)
    reads, stalls = engine.reader.waits, engine.pool.stats().stalls
    print(f"{upload_stream}: {engine.replays} replays; token reads that waited {reads}, ring stalls {stalls}")
    assert reads + stalls > 0, "the lag must put the host ahead of the device (a read or a ring claim waited)"


# -- devices --------------------------------------------------------------------------------


@needs_two
@pytest.mark.parametrize("mode", GRAPH_MODES)
def test_engine_on_cuda0_runs_with_cuda1_current(mode: GraphMode) -> None:
    """Catches work (a capture, a replay, an upload, a read-back event, a sampler kernel) issued
    on the current device instead of the engine's, or a tensor allocated there."""
    want = tokens(mode, True)
    gc.collect()
    torch.cuda.synchronize(1)
    before = torch.cuda.memory_allocated(1)
    with torch.cuda.device(1):
        outputs, engine = run(mode, GraphConfig(check_steps=True), DEV)
        assert torch.cuda.current_device() == 1
        after = torch.cuda.memory_allocated(1)
        assert after == before, f"the engine allocated {after - before} bytes on the current device, cuda:1"
    assert_same(outputs, want, f"{mode} with cuda:1 current")
    if mode == "pool":
        check_step_log(engine)


@needs_two
@pytest.mark.parametrize("mode", GRAPH_MODES)
def test_engine_on_cuda1_runs_with_cuda0_current(mode: GraphMode) -> None:
    """The other way round. Tokens are compared with cuda:0's: the devices are the same model, so
    the same kernels compute the same values."""
    want = tokens(mode, True)
    gc.collect()
    torch.cuda.synchronize(0)
    before = torch.cuda.memory_allocated(0)
    assert torch.cuda.current_device() == 0
    outputs, engine = run(mode, GraphConfig(check_steps=True), torch.device("cuda", 1))
    assert torch.cuda.current_device() == 0
    after = torch.cuda.memory_allocated(0)
    assert after == before, f"the engine allocated {after - before} bytes on the current device, cuda:0"
    assert engine.graphs.tokens_by_row.device == torch.device("cuda", 1)
    assert_same(outputs, want, f"{mode} on cuda:1")
    if mode == "pool":
        check_step_log(engine)


# -- the steady pool-mode decode step: no sync, one upload copy -----------------------------


def steady_engine(running: int, new_tokens: int, land_tokens: bool = True) -> tuple[GraphEngine, list[Request]]:
    """A pool-mode engine in steady decode: one prefill admitted everything, nobody stops early."""
    cfg = GraphConfig(land_tokens=land_tokens)
    engine = GraphEngine(CFG, "pool", DEV, EngineConfig(max_running=16, kv_slots=8192), cfg)
    assert engine.land_tokens == land_tokens
    wl = Workload(num_requests=running, arrival_gap=0, new_tokens=(new_tokens, new_tokens), seed=3)
    reqs = make_requests(wl, CFG.vocab_size)
    for r in reqs:
        r.sampling_params = attrs.evolve(r.sampling_params, stop_token_ids=())
    engine.submit(reqs)
    while engine.step() != "decode" or engine.iteration < 6:
        pass
    assert len(engine.running) == running
    torch.cuda.synchronize()
    return engine, reqs


@pytest.mark.parametrize("land_tokens", [True, False], ids=["landed", "read-back"])
def test_steady_pool_decode_step_makes_no_host_sync_and_no_pinned_allocation(land_tokens: bool) -> None:
    """Catches a sync in the graph decode step (a blocking copy, an ``item()``, a stream or
    device synchronize in staging, replay, read-back or the host free list), or a pinned
    allocation per step.

    torch's sync debug mode does not see an event wait (``cudaEventSynchronize``): the read of
    step N-1's tokens may wait on its event when the GPU is behind, which is the loop's one
    deliberate wait. First window: the device is drained before each step, so that read never
    waits and the step must make no wait of any kind. Second window: steps back to back (the
    overlapped steady state); torch-visible syncs are still refused, and the token reads' event
    waits are counted and printed.
    """
    engine, _ = steady_engine(running=10, new_tokens=60, land_tokens=land_tokens)
    rows = engine.graphs.padded(10)
    assert rows == 12  # padded: the pads are part of the step
    previous = torch.cuda.get_sync_debug_mode()
    stats0, reader_waits0 = engine.pool.stats(), engine.reader.waits
    host_allocs0 = torch.cuda.host_memory_stats()["num_host_alloc"]
    for _ in range(6):
        torch.cuda.synchronize()  # outside the window: step N-1's tokens have landed
        torch.cuda.set_sync_debug_mode("error")
        try:
            assert engine.step() == "decode"
        finally:
            torch.cuda.set_sync_debug_mode(previous)
    stats1 = engine.pool.stats()
    assert engine.reader.waits == reader_waits0
    assert stats1.readback_waits == stats0.readback_waits and stats1.stalls == stats0.stalls
    torch.cuda.set_sync_debug_mode("error")
    try:
        for _ in range(12):
            assert engine.step() == "decode"
    finally:
        torch.cuda.set_sync_debug_mode(previous)
    stats2 = engine.pool.stats()
    waits = engine.reader.waits - reader_waits0
    print(f"back to back: 12 decode steps, {waits} token reads waited on their event ({rows} padded rows)")
    assert waits <= 12  # at most the one read per step
    assert stats2.stalls == stats0.stalls, "the ring never waits: the host is at most one step ahead"
    assert stats2.copies - stats0.copies == 18
    assert stats2.readbacks - stats0.readbacks == (0 if land_tokens else 18)
    assert len(engine.running) == 10
    torch.cuda.synchronize()
    assert torch.cuda.host_memory_stats()["num_host_alloc"] == host_allocs0
    while engine.busy:
        engine.step()


@pytest.mark.parametrize("land_tokens", [True, False], ids=["landed", "read-back"])
def test_steady_pool_decode_step_is_one_host_to_device_copy(land_tokens: bool) -> None:
    """Catches a decode step that uploads more than the block (a per-field copy, a padding fill
    from the host, a sampling-info stage) or reads back more than its tokens: per step exactly one
    cudaMemcpyAsync up (the block), and one HtoD copy on the device; with the tokens landed by the
    replay no copy back at all, else one cudaMemcpyAsync and one DtoH copy."""
    engine, _ = steady_engine(running=10, new_tokens=40, land_tokens=land_tokens)
    back = 0 if land_tokens else 1
    steps = 8
    with profile(activities=[ProfilerActivity.CPU, ProfilerActivity.CUDA]) as prof:
        for _ in range(steps):
            assert engine.step() == "decode"
        torch.cuda.synchronize()  # the window's device work, all of it, lands in the trace
    events = list(prof.events())
    calls = Counter(e.name for e in events if e.name.startswith("cudaMemcpy"))
    htod = [(e.name, str(e.device_type)) for e in events if "HtoD" in e.name]
    dtoh = [(e.name, str(e.device_type)) for e in events if "DtoH" in e.name]
    print(f"runtime memcpy calls over {steps} steps: {dict(calls)}")
    print(f"HtoD events matched ({len(htod)}): {sorted(Counter(htod).items())}")
    print(f"DtoH events matched ({len(dtoh)}): {sorted(Counter(dtoh).items())}")
    assert sum(n for name, n in calls.items() if name.startswith("cudaMemcpyAsync")) == (1 + back) * steps
    assert sum(calls.values()) == (1 + back) * steps  # no other memcpy call (cudaMemcpy: a blocking one)
    assert len(htod) == steps, "exactly one host-to-device copy per decode step: the block"
    assert len(dtoh) == back * steps, "device-to-host copies per decode step: the tokens' read-back, or none"
    while engine.busy:
        engine.step()
