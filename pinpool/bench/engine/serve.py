"""Continuous batching under request churn, in four staging modes, with per-request latencies.

``ServeEngine`` is ``GraphEngine`` (prefill eager, decode replayed at padded graph sizes,
overlap scheduling) serving a trace (``engine.trace``): requests join at every prefill and
leave at every step, so the batch and often the graph size change all the time. The modes
differ in how a decode step's graph inputs get their values:

- ``pinned``, ``pool``: ``GraphEngine``'s modes as they are (per-field pinned temporaries and
  a batch rebuilt on each change; one ring stage of the whole block, one copy);
- ``sglang``: the batch lives on the device, as sglang's ``ScheduleBatch``: positions grow
  there, and each membership change runs ``filter_batch`` (an upload of the kept indices,
  then an ``index_select`` per tensor) and ``merge_batch`` (the new requests' tensors
  uploaded, then a ``cat`` per tensor);
- ``vllm``: Model Runner V2's shape. Per-request state sits in tables indexed by request
  row, written once when a request joins (``StagedWriteTensor`` for the positions, UVA
  ``UvaBackedTensor`` tables for the sampling parameters, re-published each step as vLLM's
  sampler does). Each step uploads ``idx_mapping`` and ``query_start_loc`` (full padded
  width, as vLLM writes it; our model does not read it) with ``async_tensor_h2d``, and one
  kernel gathers rows, positions and sampling parameters into the graph's inputs on the
  device (``engine.vllm_gather``: vLLM's fused-kernel shape, written here). The table
  classes come from vLLM's own file where ``.vllm/`` has it (``engine.vllm_files``), else
  a labelled rebuild.

Times. Each iteration's host clock is read at its start; a request arrives at the start of
its arrival iteration. Its tokens are stamped when the host has read them: the read waits
on the step's fence or event, so the host clock after it is never earlier than the device
finishing them. TTFT = first token - arrival; TPOT = (last - first) / (tokens - 1); ITL =
the gaps between a request's tokens.
"""

from __future__ import annotations

import time
from typing import Any, Literal

import attrs
import numpy as np
import torch

from pinpool.bench.engine.graph_loop import GraphConfig, GraphEngine, _DeviceBatch
from pinpool.bench.engine.loop import EngineConfig, StepTimes
from pinpool.bench.engine.model import ModelConfig, SleepModel, TinyDecoder
from pinpool.bench.engine.readback import Pending
from pinpool.bench.engine.requests import Request
from pinpool.bench.engine.trace import fresh
from pinpool.bench.engine.vllm_files import VllmBuffers, load
from pinpool.bench.engine.vllm_gather import gather_inputs, uses_triton
from sampling.params import RECORD_DTYPE
from sampling.static import SAMPLING_FIELDS, sampling_columns

ServeMode = Literal["pinned", "sglang", "vllm", "pool"]
SERVE_MODES: tuple[ServeMode, ...] = ("pinned", "sglang", "vllm", "pool")
PHASES = ("schedule", "stage", "replay", "read")


@attrs.define
class ServeRun:
    """One trace served: tokens, per-request latencies (seconds) and per-iteration host figures."""

    outputs: dict[int, list[int]]
    elapsed: float  # wall seconds from the first iteration's start to the last token read
    iterations: int  # iterations that launched a step (idle ones, waiting for an arrival, left out)
    output_tokens: int
    ttft: list[float]
    tpot: list[float]  # requests with at least two tokens
    itl: list[float]
    host: list[float]  # per launching iteration: wall less counted GPU waits
    phases: dict[str, float]  # host seconds per iteration, by phase (PHASES), means
    gpu_busy: float | None  # device seconds of prefills and replays (CUDA events), None on CPU


class _Clock:
    """Per-request token stamps of one run."""

    def __init__(self, offset: int) -> None:
        self.offset = offset
        self.iteration_start: list[float] = []
        self.first: dict[int, float] = {}
        self.last: dict[int, float] = {}
        self.ttft: list[float] = []
        self.tpot: list[float] = []
        self.itl: list[float] = []
        self.host: list[float] = []

    def stamp(self, r: Request, now: float) -> None:
        last = self.last.get(r.rid)
        if last is None:
            self.first[r.rid] = now
            self.ttft.append(now - self.iteration_start[r.arrival - self.offset])
        else:
            self.itl.append(now - last)
        self.last[r.rid] = now
        if r.done and len(r.output) > 1:
            self.tpot.append((now - self.first[r.rid]) / (len(r.output) - 1))


class _VllmTables:
    """Model Runner V2's per-request tables and per-step uploads (see the module doc)."""

    def __init__(self, engine: ServeEngine, buffers: VllmBuffers) -> None:
        device, rows = engine.device, engine.rtt.size
        max_reqs = engine.cfg.max_running
        self.h2d = buffers.async_tensor_h2d
        #: int64 [rows]: each request's next position (vLLM's num_computed_tokens).
        self.positions = buffers.staged_write_tensor(rows, torch.int64, device)
        dtypes = {f.name: f.dtype for f in SAMPLING_FIELDS}
        #: Per field, a host table read by the device through UVA (pinned), by request row.
        self.sampling = {name: buffers.uva_backed_tensor(rows, dtype) for name, dtype in dtypes.items()}
        self.query_start_loc = torch.zeros(max_reqs + 1, dtype=torch.int32, device=device)
        self.qsl_np = np.zeros(max_reqs + 1, dtype=np.int32)
        self.arange = np.arange(max_reqs + 1, dtype=np.int32)
        gather = (
            "one Triton kernel written here in vLLM's fused shape"
            if uses_triton(device)
            else "that kernel's torch reference (no Triton here)"
        )
        self.source = f"{buffers.source}; graph inputs gathered by {gather}"

    def add(self, reqs: list[Request]) -> None:
        """vLLM's ``add_request`` then ``apply_staged_writes``: one row per new request."""
        records = np.frombuffer(b"".join([r.sampling_params.record for r in reqs]), RECORD_DTYPE)
        cols = sampling_columns(records)
        rows = np.fromiter((r.row for r in reqs), np.int64, len(reqs))
        for name, table in self.sampling.items():
            table.np[rows] = cols[name]
        for r in reqs:
            self.positions.stage_write_elem(r.row, r.seq_len)
        self.positions.apply_write()

    def stage(self, engine: ServeEngine, reqs: list[Request], bs: int, rows: int) -> None:
        """Upload the index mapping and query starts, then gather the graph's inputs on the device."""
        idx = self.h2d(np.fromiter((r.row for r in reqs), np.int64, bs), engine.device, torch.int64)
        qsl = self.qsl_np
        qsl[: bs + 1] = self.arange[: bs + 1]
        qsl[bs + 1 :] = bs
        self.h2d(qsl, out=self.query_start_loc)
        for table in self.sampling.values():
            table.copy_to_uva()  # vLLM's sampler re-publishes its tables each step
        views = engine.graphs.block.views(rows)
        # One kernel: rows, positions (the table then moves to the next step's) and sampling fields.
        gather_inputs(idx, self.positions.gpu, {k: t.gpu for k, t in self.sampling.items()}, views)
        views["out_cache_loc"][:bs].copy_(engine.kv.alloc(bs))
        engine.fill_padding(rows, bs)


class ServeEngine(GraphEngine):
    """``GraphEngine`` serving traces in one of ``SERVE_MODES``, timing each request."""

    def __init__(
        self,
        model_cfg: ModelConfig,
        mode: ServeMode,
        device: torch.device,
        cfg: EngineConfig,
        graph_cfg: GraphConfig | None = None,
        *,
        model: TinyDecoder | SleepModel | None = None,
    ) -> None:
        if mode not in SERVE_MODES:
            raise ValueError(f"'mode' must be one of {', '.join(SERVE_MODES)} (got {mode!r})")
        # vllm: GraphEngine's device-state base (device KV free list, persistent read-back);
        # its staging is this class's (``_stage_sglang`` below).
        super().__init__(model_cfg, "sglang" if mode == "vllm" else mode, device, cfg, graph_cfg, model=model)
        self.serve_mode: ServeMode = mode
        self.vllm = _VllmTables(self, load(device)) if mode == "vllm" else None
        self.prefill_events: list[tuple[Any, Any]] = []
        self._clock = _Clock(0)

    @property
    def source_note(self) -> str | None:
        """Where the vllm mode's classes came from (vLLM's file or the rebuild)."""
        return self.vllm.source if self.vllm is not None else None

    def fill_padding(self, rows: int, bs: int) -> None:
        """Padding values into rows ``bs..rows`` of the block, when the shape changed since the last fill."""
        if (rows, bs) == self._written_shape:
            return
        self._written_shape = (rows, bs)
        if bs < rows:
            views = self.graphs.block.views(rows)
            for f in self.graphs.block.layout.fields:
                views[f.name][bs:].fill_(f.pad)

    # -- serving a trace -------------------------------------------------------------------
    def serve(self, requests: list[Request]) -> ServeRun:
        """Serve ``requests`` (a trace; copies are run, arrivals counted from now) until all are done."""
        if self.busy:
            raise RuntimeError("'serve' needs an idle engine (a previous trace is still running)")
        clock = self._clock = _Clock(self.iteration)
        self.times = StepTimes()
        self.prefill_events = []
        reqs = fresh(requests, self.iteration)
        phases_before = self._phase_totals()
        self.submit(reqs)
        while self.busy:
            self.step()
        end = max(clock.last.values(), default=time.perf_counter())
        if self.device.type == "cuda":
            torch.cuda.synchronize(self.device)  # sync-ok: end of a served trace, after its last token was read
        self.submitted.clear()  # a soak serves thousands of requests: keep none of them here
        n = max(1, len(clock.host))
        after = self._phase_totals()
        phases = {k: (after[k] - phases_before[k]) / n for k in PHASES}
        phases["schedule"] = max(0.0, sum(clock.host) / n - sum(phases[k] for k in PHASES[1:]))
        busy = None
        if self.record_gpu and self.device.type == "cuda":
            events = self.times.gpu_events + self.prefill_events
            busy = sum(s.elapsed_time(e) for s, e in events) / 1e3
        return ServeRun(
            outputs={r.rid: r.output for r in reqs},
            elapsed=end - clock.iteration_start[0],
            iterations=len(clock.host),
            output_tokens=sum(len(r.output) for r in reqs),
            ttft=clock.ttft,
            tpot=clock.tpot,
            itl=clock.itl,
            host=clock.host,
            phases=phases,
            gpu_busy=busy,
        )

    def _phase_totals(self) -> dict[str, float]:
        by = self.phases.by_site
        return {
            "schedule": 0.0,
            "stage": by.get("stage", 0.0),
            "replay": by.get("replay", 0.0),
            "read": by.get("readback", 0.0) + self.staging.by_site.get("read", 0.0),
        }

    # -- hooks -----------------------------------------------------------------------------
    def step(self) -> str:
        start = time.perf_counter()
        self._clock.iteration_start.append(start)
        waited = self.gpu_wait_seconds()
        kind = super().step()
        if kind != "idle":  # an idle iteration launches nothing: it is no step of the loop's
            self._clock.host.append(time.perf_counter() - start - (self.gpu_wait_seconds() - waited))
        return kind

    def _prefill(self, reqs: list[Request]) -> Pending:
        if not (self.record_gpu and self.device.type == "cuda"):
            return super()._prefill(reqs)
        start = self.gpu_mark()
        pending = super()._prefill(reqs)
        self.prefill_events.append((start, self.gpu_mark()))
        return pending

    def _join(self, info: Any, new_tokens: torch.Tensor, rows_d: torch.Tensor, last_d: torch.Tensor) -> None:
        batch = self._batch
        super()._join(info, new_tokens, rows_d, last_d)
        joined = self.running[len(self.running) - new_tokens.shape[0] :]
        if self.vllm is not None:
            self.vllm.add(joined)
        elif self.serve_mode == "sglang" and batch is not None:
            # merge_batch: the new requests' tensors, uploaded, then one cat per tensor.
            new = _DeviceBatch(self, joined)
            batch.rows = torch.cat([batch.rows, new.rows])
            batch.positions = torch.cat([batch.positions, new.positions])
            batch.sampling = {k: torch.cat([v, new.sampling[k]]) for k, v in batch.sampling.items()}
            self._batch, self._written_shape = batch, None

    def _consume(self, read: Pending, reqs: list[Request]) -> None:
        before, batch = self.running, self._batch
        counts = [len(r.output) for r in reqs]
        super()._consume(read, reqs)
        now = time.perf_counter()  # after the read, which waited for these tokens' fence or event
        for r, count in zip(reqs, counts, strict=True):
            if len(r.output) > count:
                self._clock.stamp(r, now)
        if self.serve_mode == "sglang" and batch is not None and self.running is not before:
            # filter_batch: the kept indices, uploaded, then one index_select per tensor.
            keep = [i for i, r in enumerate(before) if not r.done]
            if not keep:
                return
            (keep_d,) = self.uploader.upload("filter", [(keep, torch.int64)])
            batch.rows = batch.rows.index_select(0, keep_d)
            batch.positions = batch.positions.index_select(0, keep_d)
            batch.sampling = {k: v.index_select(0, keep_d) for k, v in batch.sampling.items()}
            self._batch, self._written_shape = batch, None

    def _stage_sglang(self, reqs: list[Request], bs: int, rows: int) -> None:
        if self.vllm is None:
            super()._stage_sglang(reqs, bs, rows)
        else:
            self.vllm.stage(self, reqs, bs, rows)
