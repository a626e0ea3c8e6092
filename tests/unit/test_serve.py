"""The serve benchmark on CPU (``engine.trace``, ``engine.serve``, ``engine.serve_bench``): the trace is
seeded, the scheduler's joins, leaves and padding stay right under churn in every mode, every mode
samples the same tokens as the eager sync loop with capture replaced by plain calls, and the
workload prints its tables. No timing is asserted: the figures are printed, never checked."""

from __future__ import annotations

import json

import numpy as np
import pytest
import torch

from pinpool.bench.engine import Engine, EngineConfig, vllm_files
from pinpool.bench.engine.graph_loop import GraphConfig
from pinpool.bench.engine.requests import Request
from pinpool.bench.engine.serve import SERVE_MODES, ServeEngine, ServeMode
from pinpool.bench.engine.serve_bench import CPU_MODEL, workload
from pinpool.bench.engine.trace import TraceConfig, fresh, make_trace
from pinpool.bench.kit import BenchContext

CPU = torch.device("cpu")
ECFG = EngineConfig(max_running=6, max_prefill_tokens=256, kv_slots=6 * CPU_MODEL.max_context_len + 512)
PLAIN = GraphConfig(capture=False)


def churn(seed: int = 0, n: int = 28, rate: float = 0.8) -> TraceConfig:
    """Arrivals fast enough that the batch fills to max_running, with outputs of very different lengths."""
    return TraceConfig(
        num_requests=n,
        rate=rate,
        prompt_median=6,
        prompt_bounds=(2, 16),
        output_min=2,
        output_cap=16,
        max_context_len=CPU_MODEL.max_context_len,
        seed=seed,
    )


def engine(mode: ServeMode) -> ServeEngine:
    return ServeEngine(CPU_MODEL, mode, CPU, ECFG, PLAIN)


def _fields(cfg: TraceConfig) -> list[tuple[object, ...]]:
    return [
        (r.rid, r.arrival, tuple(r.prompt), r.sampling_params.record, r.sampling_params.max_new_tokens)
        for r in make_trace(cfg, CPU_MODEL.vocab_size)
    ]


def test_trace_is_seeded_and_deterministic() -> None:
    """Catches a trace drawn from global random state: two modes would serve different requests."""
    cfg = churn(seed=5, n=200)
    assert _fields(cfg) == _fields(cfg)
    assert _fields(cfg) != _fields(churn(seed=6, n=200))


def test_trace_arrivals_follow_the_rate_and_lengths_are_capped_and_long_tailed() -> None:
    """Catches arrivals not in iteration order, a rate off by a factor, and lengths past the context."""
    cfg = TraceConfig(num_requests=4000, rate=2.5, seed=1)
    reqs = make_trace(cfg, 1000)
    arrivals = np.array([r.arrival for r in reqs])
    assert arrivals[0] == 0 and (np.diff(arrivals) >= 0).all()
    assert 2.3 < len(reqs) / (arrivals[-1] + 1) < 2.7
    outs = np.array([r.sampling_params.max_new_tokens for r in reqs])
    prompts = np.array([len(r.prompt) for r in reqs])
    assert (prompts + outs < cfg.max_context_len).all() and outs.min() >= 1
    assert prompts.min() >= cfg.prompt_bounds[0] and prompts.max() <= cfg.prompt_bounds[1]
    assert outs.max() == cfg.output_cap and np.median(outs) < cfg.output_cap / 4  # a long tail, capped


def test_trace_config_refuses_values_that_cannot_make_a_trace() -> None:
    """Catches a zero rate (no arrivals ever) and prompts that leave no room for output."""
    with pytest.raises(ValueError, match="'rate' must be > 0"):
        TraceConfig(rate=0)
    with pytest.raises(ValueError, match="max_context_len=40"):
        TraceConfig(prompt_bounds=(2, 38), output_min=4, max_context_len=40)


def test_fresh_copies_start_unserved_and_shift_arrivals() -> None:
    """Catches a second run of one trace starting from the first run's outputs or rows."""
    reqs = make_trace(churn(n=5), CPU_MODEL.vocab_size)
    reqs[0].output.append(3)
    copies = fresh(reqs, 10)
    assert [c.arrival for c in copies] == [r.arrival + 10 for r in reqs]
    assert all(c.output == [] and c.row == -1 and not c.done for c in copies)


@pytest.mark.parametrize("mode", SERVE_MODES)
def test_joins_leaves_and_padding_stay_right_under_churn(mode: ServeMode) -> None:
    """Catches a decode step that stages another batch than the running one (a filter or merge in the
    wrong order, a stale vLLM table row), padding rows that keep a departed request, a batch past
    max_running, and rows or KV slots that never come back."""
    eng = engine(mode)
    rows_free, kv_free = eng.rtt.available_size(), eng.kv.available_size()
    eng.submit(fresh(make_trace(churn(), CPU_MODEL.vocab_size), 0))
    sizes, joins, leaves = set(), 0, 0
    previous: set[int] = set()
    while eng.busy:
        kind = eng.step()
        now = {r.rid for r in eng.running}
        joins += bool(now - previous)
        leaves += bool(previous - now)
        previous = now
        _check_device_state(eng)
        if kind != "decode":
            continue
        assert eng.pending is not None
        reqs = eng.pending[1]
        bs = len(reqs)
        assert bs <= ECFG.max_running
        padded = eng.graphs.padded(bs)
        sizes.add(padded)
        rows, positions, pads = block_rows(eng, padded, bs)
        assert rows == [r.row for r in reqs]
        assert positions == [r.seq_len - 1 for r in reqs]  # staged before the step's increment
        assert pads == [eng.pad_row] * (padded - bs)
    assert joins > 3 and leaves > 3 and len(sizes) > 2
    assert eng.rtt.available_size() == rows_free and eng.kv.available_size() == kv_free


def block_rows(eng: ServeEngine, padded: int, bs: int) -> tuple[list[int], list[int], list[int]]:
    """The staged block of the step just launched: live rows, live positions, padding rows."""
    views = eng.graphs.block.views(padded)
    rows = views["rows"].tolist()
    return rows[:bs], views["positions"][:bs].tolist(), rows[bs:]


def _check_device_state(eng: ServeEngine) -> None:
    """The device-resident state each mode keeps agrees with the host's running list."""
    running = eng.running
    if eng.serve_mode == "sglang" and eng._batch is not None:
        assert eng._batch.rows.tolist() == [r.row for r in running]
        assert eng._batch.positions.tolist() == [r.seq_len for r in running]
    if eng.vllm is not None:
        table = eng.vllm.positions.gpu
        assert [int(table[r.row]) for r in running] == [r.seq_len for r in running]


def _eager_sync(trace: list[Request]) -> dict[int, list[int]]:
    return Engine(CPU_MODEL, "sync", CPU, ECFG).run(fresh(trace, 0))


@pytest.mark.parametrize("seed", [0, 1])
def test_every_mode_samples_the_sync_loops_tokens(seed: int) -> None:
    """Catches a mode whose staging feeds the graph another request's position, row or sampling
    parameters after a join or a leave: its tokens would differ from the eager sync loop's."""
    trace = make_trace(churn(seed=seed), CPU_MODEL.vocab_size)
    want = _eager_sync(trace)
    for mode in SERVE_MODES:
        eng = engine(mode)
        first = eng.serve(trace)
        again = eng.serve(trace)  # the same engine, a second time: tables and rows reused
        assert first.outputs == want, mode
        assert again.outputs == want, mode


def test_vllm_mode_on_the_rebuild_samples_the_same_tokens(monkeypatch: pytest.MonkeyPatch) -> None:
    """Catches a rebuild (CI, no .vllm/) that differs from vLLM's own classes, or a note that does not say which ran."""
    monkeypatch.setattr(vllm_files, "vllm_dir", lambda: None)
    monkeypatch.setattr(vllm_files, "_loaded", {})
    trace = make_trace(churn(seed=3), CPU_MODEL.vocab_size)
    eng = engine("vllm")
    assert eng.source_note is not None and eng.source_note.startswith("rebuild")
    assert eng.serve(trace).outputs == _eager_sync(trace)


def test_a_served_trace_has_a_latency_for_every_request_and_token() -> None:
    """Catches a request without TTFT, tokens stamped twice or never, and idle iterations counted as steps."""
    trace = make_trace(churn(seed=2, rate=0.2), CPU_MODEL.vocab_size)
    run = engine("pool").serve(trace)
    tokens = [len(t) for t in run.outputs.values()]
    assert len(run.ttft) == len(trace) and run.output_tokens == sum(tokens)
    assert len(run.tpot) == sum(1 for t in tokens if t > 1)
    assert len(run.itl) == sum(tokens) - len(trace)
    assert min(run.ttft) > 0 and min(run.itl) >= 0 and len(run.host) == run.iterations
    assert set(run.phases) == {"schedule", "stage", "replay", "read"}


def test_bad_mode_and_busy_engine_are_refused() -> None:
    """Catches a typo'd mode running as some default, and a second trace mixed into a running one."""
    with pytest.raises(ValueError, match="'mode' must be one of pinned, sglang, vllm, pool"):
        ServeEngine(CPU_MODEL, "turbo", CPU, ECFG, PLAIN)  # type: ignore[arg-type]
    eng = engine("pinned")
    eng.submit(fresh(make_trace(churn(n=3), CPU_MODEL.vocab_size), 0))
    with pytest.raises(RuntimeError, match="idle engine"):
        eng.serve([])


def test_workload_prints_a_table_per_load_with_a_row_per_mode(capsys: pytest.CaptureFixture[str]) -> None:
    """Catches the serve workload crashing on CPU, a missing mode row or column, tokens that differ
    across modes, and JSON with NaN in it."""
    ctx = BenchContext(device=CPU, batch_sizes=(1,), iters=3, repeats=2, steps=4, running=(3,), verbose=False)
    tables = workload(ctx)
    assert [t.title for t in tables] == ["serve: host-bound, light", "serve: host-bound, saturating"]
    for table in tables:
        print(table.render())
        assert table.column("mode") == ["pinned+graph", "sglang+graph", "vllm+graph", "pool+graph"]
        for name in ("output tok/s", "request/s", "TTFT p99 ms", "TPOT p99 ms", "ITL p99 ms", "host µs/step"):
            assert name in table.columns
        assert "identical across all modes and rounds: True" in table.notes[0]
        assert table.notes[1].startswith("vllm+graph: ")
        json.dumps(table.as_json(), allow_nan=False)
    assert "== serve: host-bound, light" in capsys.readouterr().out
