"""The CUDA-graph decode loop (engine.graph_loop) on CPU, where each "graph" is the same padded
step run as plain calls (``GraphConfig(capture=False)``): every staging mode samples the eager
loop's tokens, a decode step lands its live rows and then padding in the padded size's views,
pool mode's decode step is one block copy and one token read-back, every KV slot and request row
comes back, and ``check_steps`` logs what each replay read. tests/gpu checks capture."""

from __future__ import annotations

from collections.abc import Callable
from typing import Any

import attrs
import numpy as np
import pytest
import torch

from memcache.host_kv_allocator import HostKVAllocator
from pinpool import Stage
from pinpool.bench.engine import Engine, EngineConfig, Mode, ModelConfig, Workload, make_requests
from pinpool.bench.engine.graph import DEFAULT_SIZES, graph_sizes
from pinpool.bench.engine.graph_loop import GRAPH_MODES, GraphConfig, GraphEngine, GraphMode
from pinpool.bench.engine.requests import Request
from sampling import RECORD_DTYPE, SAMPLING_FIELDS, sampling_columns

CFG = ModelConfig(max_context_len=96)
CPU = torch.device("cpu")
ECFG = EngineConfig(max_running=8, kv_slots=4096)
PLAIN = GraphConfig(capture=False)
SEEDS = (0, 1, 2)

Outputs = dict[int, list[int]]


def workload(seed: int) -> Workload:
    """Arrivals spread so prefills land between decodes, and requests finish at different steps
    (at max_new_tokens or a stop token); shared prefixes so the prefix cache is used."""
    return Workload(num_requests=12, arrival_gap=0.7, prompt_len=(8, 30), new_tokens=(6, 18), seed=seed)


def graph_engine(mode: GraphMode, graph_cfg: GraphConfig = PLAIN, cfg: EngineConfig = ECFG) -> GraphEngine:
    return GraphEngine(CFG, mode, CPU, cfg, graph_cfg)


def drive(
    engine: Engine, wl: Workload, after_step: Callable[[str], None] | None = None
) -> tuple[Outputs, list[str], list[Request]]:
    """Run ``wl`` step by step: (outputs by rid, each step's kind, the requests)."""
    reqs = make_requests(wl, CFG.vocab_size)
    engine.submit(reqs)
    kinds: list[str] = []
    while engine.busy:
        kinds.append(engine.step())
        if after_step is not None:
            after_step(kinds[-1])
    return {r.rid: r.output for r in reqs}, kinds, reqs


def assert_same(got: Outputs, want: Outputs, what: str) -> None:
    differ = sorted(rid for rid in want if got.get(rid) != want[rid])
    assert got.keys() == want.keys() and not differ, f"{what}: requests {differ} sampled other tokens"


def cached_slots(engine: Engine) -> int:
    return sum(int(t.numel()) for t in engine.prefix_cache.values())


# -- token streams ------------------------------------------------------------------------


@pytest.mark.parametrize("seed", SEEDS)
def test_every_graph_mode_samples_the_eager_loops_tokens(seed: int) -> None:
    """Catches a staging mode that lands other values in the graph inputs (a stale position, a
    wrong KV slot, a padding row read as live, sampling parameters of another request), or a
    graph step that samples differently from the eager loop, across prefills joining the batch
    and requests leaving it."""
    wl = workload(seed)
    streams: dict[str, Outputs] = {}
    for mode in GRAPH_MODES:
        engine = graph_engine(mode)
        streams[mode], kinds, _ = drive(engine, wl)
        assert engine.replays == kinds.count("decode")  # one padded step per decode
        first_decode = kinds.index("decode")
        assert "prefill" in kinds[first_decode:], "the workload must prefill between decodes"
    eager_modes: tuple[Mode, ...] = ("pool", "pinned")
    for eager in eager_modes:
        streams[f"eager {eager}"] = Engine(CFG, eager, CPU, ECFG).run(make_requests(wl, CFG.vocab_size))
    for name, got in streams.items():
        assert_same(got, streams["pool"], name)
    lengths = [len(v) for v in streams["pool"].values()]
    assert len(set(lengths)) > 2, "requests must finish at different steps"


# -- padding ------------------------------------------------------------------------------


def test_graph_sizes_keep_the_sizes_below_max_rows_and_max_rows_itself() -> None:
    """Catches a batch of max_rows (or of more than the largest default size) with no graph."""
    assert graph_sizes(8) == (1, 2, 4, 8)
    assert graph_sizes(10) == (1, 2, 4, 8, 10)
    assert graph_sizes(1) == (1,)
    assert graph_sizes(256) == DEFAULT_SIZES
    assert graph_sizes(300) == (*DEFAULT_SIZES, 300)
    assert graph_sizes(6, (4, 2, 2, 9, 0, -3, 6)) == (2, 4, 6)  # sorted, once each, out-of-range dropped
    assert graph_sizes(6, ()) == (6,)


@pytest.mark.parametrize(
    ("max_running", "sizes", "want"),
    [
        (8, DEFAULT_SIZES, {1: 1, 2: 2, 3: 4, 4: 4, 5: 8, 7: 8, 8: 8}),
        (10, DEFAULT_SIZES, {8: 8, 9: 10, 10: 10}),
        (8, (3, 6), {1: 3, 3: 3, 4: 6, 6: 6, 7: 8, 8: 8}),
    ],
)
def test_padded_is_the_smallest_size_that_holds_the_batch(
    max_running: int, sizes: tuple[int, ...], want: dict[int, int]
) -> None:
    """Catches a batch padded past the smallest graph that fits (wasted rows), or into one too small."""
    engine = graph_engine(
        "pool", GraphConfig(capture=False, sizes=sizes), EngineConfig(max_running=max_running, kv_slots=256)
    )
    graphs = engine.graphs
    assert graphs.sizes == graph_sizes(max_running, sizes)
    assert graphs.max_rows == max_running == graphs.block.layout.max_rows
    for bs in range(1, max_running + 1):
        rows = graphs.padded(bs)
        assert rows in graphs.sizes and rows >= bs
        assert all(size < bs for size in graphs.sizes if size < rows)
    assert {bs: graphs.padded(bs) for bs in want} == want


@pytest.mark.parametrize("mode", GRAPH_MODES)
def test_a_decode_step_lands_live_rows_then_padding_in_the_padded_views(mode: GraphMode) -> None:
    """Catches a live row missing from (or misplaced in) the views the step's graph reads, padding
    rows that do not point at the reserved row and KV slot 0 with neutral sampling values, or a
    mode that leaves the previous batch's values in the padding. On CPU every mode's writes land
    synchronously, so the views after ``step()`` are what the step read."""
    engine = graph_engine(mode)
    graphs = engine.graphs
    shapes: set[tuple[int, int]] = set()
    pads = {f.name: f.pad for f in graphs.block.layout.fields}
    assert pads["rows"] == engine.pad_row and pads["positions"] == 0 and pads["out_cache_loc"] == 0

    def check(kind: str) -> None:
        if kind != "decode":
            return
        assert engine.pending is not None
        reqs = engine.pending[1]  # the requests this step launched (finished ones included)
        bs = len(reqs)
        rows = graphs.padded(bs)
        shapes.add((rows, bs))
        views = {name: t.numpy().copy() for name, t in graphs.block.views(rows).items()}
        assert all(v.shape == (rows,) for v in views.values())
        live_rows = [r.row for r in reqs]
        positions = [r.seq_len - 1 for r in reqs]  # seq_len moved past the step's token
        assert views["rows"][:bs].tolist() == live_rows
        assert views["positions"][:bs].tolist() == positions
        slots = views["out_cache_loc"][:bs]
        assert slots.tolist() == [int(engine.rtt.req_to_token[r.row, p]) for r, p in zip(reqs, positions, strict=True)]
        assert 0 not in slots and np.unique(slots).size == bs
        if mode == "pool":
            assert slots.tolist() == engine.slot_of[live_rows, positions].tolist()
        records = np.frombuffer(b"".join(r.sampling_params.record for r in reqs), RECORD_DTYPE)
        for name, values in sampling_columns(records).items():
            assert views[name][:bs].tolist() == values.tolist(), name
        for f in graphs.block.layout.fields:
            assert (views[f.name][bs:] == f.pad).all(), f"padding of {f.name}"
        # The sampled tokens went back by request row (the next step's input tokens), and
        # the loop reads the same ones (landed in the slot, or read back from out_tokens).
        out = engine.pending[0]()
        assert graphs.tokens_by_row[live_rows].tolist() == out
        assert engine.pad_row not in live_rows

    drive(engine, workload(1), check)
    assert {rows for rows, _ in shapes} == {1, 2, 4, 8}, shapes
    assert any(bs < rows for rows, bs in shapes), "some step must be padded"
    assert {f.name for f in SAMPLING_FIELDS} <= {f.name for f in graphs.block.layout.fields}


# -- pool mode: one copy per step, and everything comes back --------------------------------


@pytest.mark.parametrize("land_tokens", [True, False], ids=["landed", "read-back"])
def test_pool_mode_decode_step_is_one_block_copy_and_its_tokens_come_back_in_the_same_slot(land_tokens: bool) -> None:
    """Catches a pool-mode decode step that issues more than the block's one host-to-device copy
    (a per-field upload, a sampling-info stage, a free list on the device), a read-back copy when
    the replay lands its tokens in the slot itself, more than one read-back when it does not, or a
    second claim of the ring; including steps where requests finish and are freed."""
    engine = graph_engine("pool", attrs.evolve(PLAIN, land_tokens=land_tokens))
    assert engine.land_tokens == land_tokens  # the host path passes the platform check
    pool, block = engine.pool, engine.graphs.block
    engine.submit(make_requests(workload(2), CFG.vocab_size))
    decodes = freeing = 0
    while engine.busy:
        before, claims = pool.stats(), pool.claims
        kind = engine.step()
        after, claims = pool.stats(), pool.claims - claims
        if kind != "decode":
            continue
        assert engine.pending is not None
        bs = len(engine.pending[1])
        decodes += 1
        freeing += len(engine.running) < bs  # requests finished and were freed in this step
        # Exactly: the block's copy (a stage placed in the block: every field, padding included,
        # and no owned allocation) ...
        assert after.copies - before.copies == 1
        assert after.stages - before.stages == 1 and after.owned_stages == before.owned_stages
        assert after.device_allocations == before.device_allocations
        assert after.bytes_copied - before.bytes_copied == block.layout.nbytes(engine.graphs.padded(bs))
        # ... and the tokens in the same slot: stored there by the replay (the landing field
        # token_dst), or one read-back copy (Stage.readback); one claim of the ring either way.
        assert after.readbacks - before.readbacks == (0 if land_tokens else 1)
        assert after.bytes_read_back - before.bytes_read_back == (0 if land_tokens else 8 * bs)
        assert claims == 1
        assert after.host_allocations == before.host_allocations and after.aborted_stages == before.aborted_stages
    assert decodes > 20 and freeing > 2, (decodes, freeing)


@pytest.mark.parametrize("mode", GRAPH_MODES)
def test_every_kv_slot_and_request_row_comes_back(mode: GraphMode) -> None:
    """Catches a KV slot or a request row leaked by a finished request (the overlap step's slot
    included), a slot held by two requests, or slot 0 / the padding row handed to a request. Pool
    mode keeps its free list on the host (``HostKVAllocator``); the others on the device."""
    engine = graph_engine(mode)
    assert isinstance(engine.kv, HostKVAllocator) == (mode == "pool")
    kv, rtt = engine.kv, engine.rtt
    assert rtt.available_size() == rtt.size - 1  # the padding row is reserved at start

    def check(kind: str) -> None:
        # Every slot in use belongs to the prefix cache or to a running request's own range.
        held = [engine.rtt.req_to_token[r.row, r.owned_from : r.seq_len].long().numpy() for r in engine.running]
        owned = np.concatenate([*held, np.zeros(0, np.int64)])
        cache = np.concatenate([t.long().numpy() for t in engine.prefix_cache.values()] + [np.zeros(0, np.int64)])
        assert kv.size - kv.available_size() == owned.size + cache.size
        everything = np.concatenate([owned, cache])
        assert np.unique(everything).size == everything.size and 0 not in everything
        if mode == "pool":
            from_host = [engine.slot_of[r.row, r.owned_from : r.seq_len] for r in engine.running]
            assert all((h == d).all() for h, d in zip(from_host, held, strict=True))
        assert rtt.available_size() == rtt.size - 1 - len(engine.running)
        assert engine.pad_row not in {r.row for r in engine.running}

    drive(engine, workload(0), check)
    assert not engine.running and engine.prefix_cache
    assert kv.available_size() == ECFG.kv_slots - cached_slots(engine)
    assert rtt.available_size() == rtt.size - 1


# -- check_steps --------------------------------------------------------------------------


def test_check_steps_logs_each_replays_step_and_first_position() -> None:
    """Catches a replay that read another step's block (the log would hold a wrong step number or
    position), and a ``step`` field that changes the sampled tokens."""
    wl = workload(1)
    engine = graph_engine("pool", GraphConfig(capture=False, check_steps=True))
    assert engine.graphs.check_steps and "step" in {f.name for f in engine.graphs.block.layout.fields}
    outputs, kinds, _ = drive(engine, wl)
    plain, _, _ = drive(graph_engine("pool"), wl)
    assert_same(outputs, plain, "check_steps")
    n = engine.replays
    assert n == kinds.count("decode") > 20
    seen_steps = engine.graphs.seen_steps.tolist()
    assert seen_steps[1 : n + 1] == list(range(1, n + 1))
    assert engine.graphs.seen_positions[1 : n + 1].tolist() == engine.expected_positions
    assert len(engine.expected_positions) == n
    assert seen_steps[0] == -1 and seen_steps[n + 1] == -1  # no replay logged outside 1..n


@pytest.mark.parametrize("mode", ["pinned", "sglang"])
def test_check_steps_is_a_pool_mode_tool(mode: GraphMode) -> None:
    """The device-state modes have no host-staged step to log: the flag leaves their block alone."""
    engine = graph_engine(mode, GraphConfig(capture=False, check_steps=True))
    assert not engine.graphs.check_steps
    assert "step" not in {f.name for f in engine.graphs.block.layout.fields}


# -- construction -------------------------------------------------------------------------


@pytest.mark.parametrize("mode", ["eager", "pool-zc", "sync", "persistent", "", "POOL", None])
def test_unknown_mode_is_refused(mode: Any) -> None:
    with pytest.raises(ValueError, match="'mode' must be one of pinned, sglang, pool"):
        GraphEngine(CFG, mode, CPU, ECFG, PLAIN)


def test_a_cpu_engine_never_captures() -> None:
    """capture=True (the default) needs CUDA: on CPU the engine runs the same steps as plain calls."""
    engine = GraphEngine(CFG, "pool", CPU, ECFG)
    assert engine.graph_cfg.capture and not engine.graphs.capture
    assert engine.forward_stream is None and engine.schedule_stream is None and engine.upload_stream is None


@pytest.mark.parametrize("where", ["put_image", "landing", "flush"])
def test_a_pool_step_that_fails_while_staging_gives_its_kv_slots_back(
    monkeypatch: pytest.MonkeyPatch, where: str
) -> None:
    """Catches KV slots allocated for a step whose stage failed after opening (the image, the
    landing's handle, the copy) staying allocated: the step never ran, so nothing will ever free
    them."""
    engine = graph_engine("pool")
    assert engine.land_tokens  # the landing path runs here
    engine.submit(make_requests(workload(2), CFG.vocab_size))
    while engine.step() != "decode":
        pass
    free_before = engine.kv.available_size()

    def fail(self: Stage, *args: Any, **kwargs: Any) -> None:
        raise RuntimeError(f"{where} refused")

    monkeypatch.setattr(Stage, where, fail)
    with pytest.raises(RuntimeError, match=f"{where} refused"):
        engine.step()
    assert engine.kv.available_size() == free_before
