"""The serve loop (engine.serve) on the GPU: with captured graphs every mode samples the plain
calls' tokens under churn, the vLLM mode's sampling tables are read in place through UVA, and a
served trace reports its device time."""

from __future__ import annotations

import pytest
import torch

from pinpool.bench.engine import vllm_files
from pinpool.bench.engine.model import TinyDecoder
from pinpool.bench.engine.requests import Request
from pinpool.bench.engine.serve import SERVE_MODES, ServeEngine
from pinpool.bench.engine.serve_bench import CONFIGS, Load, build
from pinpool.bench.engine.trace import TraceConfig, make_trace

DEV = torch.device("cuda", 0)
CFG = CONFIGS["host-bound"]
LOAD = Load("churn", 4.0, 32)


def _trace() -> list[Request]:
    """Arrivals fast enough to fill 32 running, so graph sizes and membership change every few steps."""
    return make_trace(TraceConfig(num_requests=96, rate=LOAD.rate, seed=11), CFG.vocab_size)


def test_captured_modes_sample_the_plain_calls_tokens_under_churn() -> None:
    """Catches a captured replay reading another step's inputs after a join or leave, in any mode.

    The reference is the same padded step as plain calls (the graphs' eager twin), as in
    test_graph_engine_cuda: the eager loop attends over the batch's longest sequence where a
    graph attends over the fixed context, and in bfloat16 the two may round apart.
    """
    model = TinyDecoder(CFG, DEV)
    trace = _trace()
    want = build(CFG, "pinned", DEV, LOAD.max_running, model, capture=False).serve(trace).outputs
    for mode in SERVE_MODES:
        engine = build(CFG, mode, DEV, LOAD.max_running, model)
        engine.record_gpu = True
        run = engine.serve(trace)
        assert run.outputs == want, mode
        assert run.gpu_busy is not None and run.gpu_busy > 0
        assert engine.serve(trace).outputs == want, f"{mode}, second trace on the same engine"


@pytest.mark.skipif(vllm_files.vllm_dir() is None, reason="no .vllm/ (vLLM's buffer_utils.py) here")
def test_vllm_mode_runs_vllms_own_file_and_reads_its_tables_through_uva() -> None:
    """Catches the vllm mode silently running the rebuild, or its UVA tables being device copies."""
    engine = ServeEngine(CFG, "vllm", DEV, build(CFG, "pool", DEV, 8, TinyDecoder(CFG, DEV)).cfg)
    assert engine.source_note is not None and engine.source_note.startswith("vLLM")
    assert engine.vllm is not None
    table = engine.vllm.sampling["temperature"]
    view = table.copy_to_uva()
    assert view.is_cuda and view.data_ptr() == table.pool._uva_bufs[table.pool._curr].cpu.data_ptr()
