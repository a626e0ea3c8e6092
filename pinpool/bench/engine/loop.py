"""The reference decode loop: one pool per worker, staging in one of five modes (``engine.uploader``).

Each iteration launches one step (a prefill of newly admitted requests, else a decode of
the running batch), queues the read-back of its tokens, and only then reads the previous
step's tokens. The host therefore works on step N while the GPU runs step N+1; a request
whose finish shows up in step N still rides along in step N+1 and that token is dropped.
The schedule depends on iteration counts only, so every mode runs the same batches.
"""

from __future__ import annotations

import time
from collections import deque
from typing import Any

import attrs
import torch

from memcache import ReqToTokenPool, TokenToKVPoolAllocator, allocate_extend, write_cache_indices
from pinpool import Field, Layout, PinnedRingBuffer, PoolSettings, Stage
from pinpool.bench.engine.baseline import PerFieldSamplingInfo, write_cache_per_field
from pinpool.bench.engine.model import KVCache, ModelConfig, SleepModel, TinyDecoder
from pinpool.bench.engine.readback import Pending, TokenReader
from pinpool.bench.engine.requests import Request, accept_all
from pinpool.bench.engine.uploader import POOL_MODES, Mode, Uploader
from pinpool.readback import Landing
from sampling import Sampler, SamplingBatchInfo


@attrs.frozen
class EngineConfig:
    max_running: int = 64
    max_prefill_tokens: int = 4096
    #: Decode steps the running batch gets between two prefills, so a steady stream of
    #: arrivals cannot starve it (each prefill then takes every request that arrived).
    decodes_between_prefills: int = 2
    kv_slots: int = 1 << 16
    #: Replace the tiny model by ``SleepModel``: each forward is gpu_work_us of GPU sleep.
    simulated_model: bool = False
    #: GPU µs of simulated work per forward (torch.cuda._sleep); with the tiny model it is
    #: added on top of the model's own kernels. 0 = none.
    gpu_work_us: float = 0.0
    sleep_cycles_per_us: float = 1980.0  # measured by bench before use; ~SM clock in MHz
    #: Pool modes: the sampler stores each decode step's tokens straight into the step's
    #: pinned slot (``Stage.land``) instead of a read-back copy, where the platform allows.
    land_tokens: bool = True


@attrs.define
class StepTimes:
    decode_wall: list[float] = attrs.Factory(list)  # host seconds per decode iteration
    decode_staging: list[float] = attrs.Factory(list)  # of which: metadata staging and read-back
    decode_gpu_wait: list[float] = attrs.Factory(list)  # of which: waiting for the GPU (backpressure, reads)
    gpu_events: list[tuple[Any, Any]] = attrs.Factory(list)  # (start, end) CUDA events per decode step


class _Batch:
    def __init__(self, reqs: list[Request], device: torch.device) -> None:
        self.reqs, self.device = reqs, device


class Engine:
    def __init__(
        self,
        model_cfg: ModelConfig,
        mode: Mode,
        device: torch.device,
        cfg: EngineConfig,
        *,
        model: TinyDecoder | SleepModel | None = None,
        zero_copy_pool: bool = False,
    ) -> None:
        """``model``: an already built model for ``model_cfg`` on ``device`` (a bench shares one across engines).

        ``zero_copy_pool``: create the pool with ``zero_copy=True`` (its platform check runs
        once, here) so kernels may write its slots in place; the graph loop lands tokens so.
        """
        self.cfg, self.model_cfg, self.mode, self.device = cfg, model_cfg, mode, device
        #: pool-zc: the decode exchange is a zero-copy stage (the platform check runs once, here).
        self.zero_copy = mode == "pool-zc"
        self.pooled = mode in POOL_MODES
        landing = self.pooled and cfg.land_tokens
        self.pool = PinnedRingBuffer(
            PoolSettings.from_env(
                device=device, num_slots=8, slot_bytes=1 << 20, zero_copy=self.zero_copy or zero_copy_pool or landing
            )
        )
        #: The decode step's tokens land in its slot (the pool passed its platform check).
        self.land_tokens = landing and self.pool.can_land
        #: pool: the decode step's exchange, declared once: rows and positions up, and (landing)
        #: where the sampler stores each row's token in the same slot.
        self.step_layout = Layout(
            [
                Field("rows", torch.int64),
                Field("positions", torch.int64),
                *([Field.landing("tokens")] if self.land_tokens else []),
            ],
            cfg.max_running,
        )
        if self.zero_copy and not self.pool.platform.zero_copy_ok:
            self.pool.close()
            raise self.pool.platform.refusal(device)  # PlatformError saying why; the copy modes still work
        self.uploader = Uploader(mode, device, self.pool)
        self.reader = TokenReader(mode, self.pool)
        cycles = int(cfg.gpu_work_us * cfg.sleep_cycles_per_us)
        if model is None:
            model = SleepModel(model_cfg, device, cycles) if cfg.simulated_model else TinyDecoder(model_cfg, device)
        self.model: TinyDecoder | SleepModel = model
        self.extra_cycles = 0 if cfg.simulated_model else cycles
        self.staging = StagingClock()
        self.rtt = ReqToTokenPool(cfg.max_running + 1, model_cfg.max_context_len, device)
        self.kv = TokenToKVPoolAllocator(cfg.kv_slots, device)
        self.cache = KVCache(model_cfg, cfg.kv_slots, device)
        self.sampler = Sampler()
        self.prefix_cache: dict[int, torch.Tensor] = {}  # group -> int32 KV slots of its shared prefix
        self.running: list[Request] = []
        self.info: Any = None  # SamplingBatchInfo (pool) or PerFieldSamplingInfo
        self.last_tokens: torch.Tensor | None = None  # int64 [len(running)]: each request's newest token
        self.arange = torch.arange(cfg.max_running + 1, device=device)
        self.times = StepTimes()
        self.record_gpu = False
        self.waiting: deque[Request] = deque()
        self.pending: tuple[Pending, list[Request]] | None = None
        self.iteration = 0
        self.decodes_since_prefill = 0
        self.submitted: list[Request] = []

    # -- the loop ----------------------------------------------------------------------
    def submit(self, requests: list[Request]) -> None:
        self.waiting.extend(sorted(requests, key=lambda r: r.arrival))
        self.submitted.extend(requests)

    @property
    def finished_outputs(self) -> dict[int, list[int]]:
        return {r.rid: r.output for r in self.submitted}

    def gpu_wait_seconds(self) -> float:
        """Host seconds spent waiting for the GPU inside staging (ring stalls, blocked reads)."""
        # Blocked token reads are timed once: by the reader, or in the pool modes by the pool
        # (the reader's figure includes the pool's there).
        return self.pool.stall_seconds + self.uploader.wait_seconds + self.reader.wait_seconds

    @property
    def busy(self) -> bool:
        return bool(self.waiting or self.running or self.pending)

    def step(self) -> str:
        """One iteration: launch a prefill or a decode, then read the previous step's tokens."""
        start = time.perf_counter()
        staged_before, waited_before = self.staging.total, self.gpu_wait_seconds()
        may_prefill = not self.running or self.decodes_since_prefill >= self.cfg.decodes_between_prefills
        admitted = self._admit(self.waiting, self.iteration) if may_prefill else []
        launched: tuple[Pending, list[Request]] | None = None
        kind = "idle"
        if admitted:
            launched, kind = (self._prefill(admitted), admitted), "prefill"
            self.decodes_since_prefill = 0
        elif self.running:
            launched, kind = (self._decode(), list(self.running)), "decode"
            self.decodes_since_prefill += 1
        if self.pending is not None:
            self._consume(*self.pending)
        self.pending = launched
        if kind == "decode":
            self.times.decode_wall.append(time.perf_counter() - start)
            self.times.decode_staging.append(self.staging.total - staged_before)
            self.times.decode_gpu_wait.append(self.gpu_wait_seconds() - waited_before)
        self.iteration += 1
        return kind

    def run(self, requests: list[Request], max_iterations: int = 1_000_000) -> dict[int, list[int]]:
        self.submit(requests)
        while self.busy and self.iteration < max_iterations:
            self.step()
        return {r.rid: r.output for r in requests}

    def _admit(self, waiting: deque[Request], it: int) -> list[Request]:
        admitted: list[Request] = []
        tokens = 0
        while waiting and waiting[0].arrival <= it and len(self.running) + len(admitted) < self.cfg.max_running:
            req = waiting[0]
            need = len(req.prompt)
            if admitted and tokens + need > self.cfg.max_prefill_tokens:
                break
            if self.rtt.available_size() <= len(admitted) or self.kv.available_size() < tokens + need + 64:
                break
            admitted.append(waiting.popleft())
            tokens += need
        return admitted

    # -- steps -------------------------------------------------------------------------
    def _prefill(self, reqs: list[Request]) -> Pending:
        prefix_lens, prefix_tensors = [], []
        for r in reqs:
            cached = self.prefix_cache.get(r.prefix_group) if r.prefix_group is not None else None
            prefix_lens.append(r.shared_len if cached is not None else 0)
            prefix_tensors.append(cached if cached is not None else _EMPTY_PREFIX[self.device])
        extend = [len(r.prompt) - p for r, p in zip(reqs, prefix_lens, strict=True)]
        rows, out_cache_loc = self._alloc_extend(reqs, prefix_lens, extend)
        seq = [len(r.prompt) for r in reqs]
        for r, row, p in zip(reqs, rows, prefix_lens, strict=True):
            r.row, r.seq_len, r.owned_from = row, len(r.prompt), p
        with self.staging("prefill.write_cache"):
            if self.pooled:
                write_cache_indices(out_cache_loc, rows, prefix_lens, seq, extend, prefix_tensors, self.rtt, self.pool)
            else:
                write_cache_per_field(
                    out_cache_loc, rows, prefix_lens, seq, extend, prefix_tensors, self.rtt, self.uploader
                )
        token_ids: list[int] = []
        positions: list[int] = []
        token_rows: list[int] = []
        last_index: list[int] = []
        for r, p in zip(reqs, prefix_lens, strict=True):
            token_ids += r.prompt[p:]
            positions += range(p, len(r.prompt))
            token_rows += [r.row] * (len(r.prompt) - p)
            last_index.append(len(token_ids) - 1)
        with self.staging("prefill.upload"):
            tokens_d, positions_d, rows_d, last_d = self.uploader.upload(
                "step",
                [
                    (token_ids, torch.int64),
                    (positions, torch.int64),
                    (token_rows, torch.int64),
                    (last_index, torch.int64),
                ],
            )
        logits = self.model.forward(
            tokens_d, positions_d, rows_d, out_cache_loc, last_d, self.rtt.req_to_token, self.cache, max(seq)
        )
        with self.staging("prefill.sampling_info"):
            info = self._sampling_info(reqs)
        new_tokens = self.sampler(logits, info, positions_d[last_d])
        for r in reqs:  # the first request of a group publishes its prefix's KV slots
            if r.prefix_group is not None and r.prefix_group not in self.prefix_cache and r.owned_from == 0:
                self.prefix_cache[r.prefix_group] = self.rtt.req_to_token[r.row, : r.shared_len].clone()
                r.owned_from = r.shared_len  # those slots now belong to the cache
        self.running += reqs
        self._join(info, new_tokens, rows_d, last_d)
        with self.staging("prefill.readback"):
            return self.reader.start(new_tokens)

    def _alloc_extend(
        self, reqs: list[Request], prefix_lens: list[int], extend: list[int]
    ) -> tuple[list[int], torch.Tensor]:
        """Rows for ``reqs`` and their new KV slots (a device tensor), both or neither."""
        return allocate_extend(self.rtt, self.kv, len(reqs), sum(extend))

    def _join(self, info: Any, new_tokens: torch.Tensor, rows_d: torch.Tensor, last_d: torch.Tensor) -> None:
        """Add a prefill's requests (already in ``running``) to the decode batch's device state.

        ``rows_d[last_d]``: each new request's row, on the device (the graph loop keys tokens by row).
        """
        if self.info is None:
            self.info, self.last_tokens = info, new_tokens
            return
        assert self.last_tokens is not None
        with self.staging("prefill.merge"):
            self.info.merge_batch(info)
        self.last_tokens = torch.cat([self.last_tokens, new_tokens])

    def _decode(self) -> Pending:
        reqs, bs = self.running, len(self.running)
        out_cache_loc = self.kv.alloc(bs)
        # The scheduler's lists are built outside the clock: every mode needs them, and
        # the clock is for what the modes do differently (moving them to the GPU).
        rows, positions = [r.row for r in reqs], [r.seq_len for r in reqs]
        exchange: Stage | None = None
        land_to: torch.Tensor | None = None
        landing: Landing | None = None
        ok = False
        # The exchange is opened inside the try: a failure anywhere after it (a put, a
        # kernel launch) still closes it, and a flushed copy still gets its fence.
        try:
            with self.staging("decode.upload"):
                if self.pooled:
                    # One slot for the step, both ways: the metadata up now (one copy, issued
                    # here), the tokens back after the sampler, one fence (stored there by the
                    # sampler itself, a landing, or else a Stage.readback copy). The step's
                    # layout is declared once (``step_layout``): each call here runs cold.
                    # pool-zc: the same layout read in place, so flush() issues nothing; the
                    # kernels _launch_decode queues are launched before the close, so the
                    # slot's fence, recorded at close, follows them.
                    exchange = self.pool.stage(self.step_layout, rows=bs, zero_copy=self.zero_copy)
                    exchange.put("rows", rows)
                    exchange.put("positions", positions)
                    exchange.flush()
                    views = exchange.views
                    rows_d, positions_d = views["rows"], views["positions"]
                    if self.land_tokens:
                        land_to, landing = views["tokens"], exchange.landing("tokens")
                else:
                    rows_d, positions_d = self.uploader.upload("step", [(rows, torch.int64), (positions, torch.int64)])
            self._launch_decode(reqs, bs, rows_d, positions_d, out_cache_loc, land_to)
            assert self.last_tokens is not None
            with self.staging("decode.readback"):
                if exchange is None:
                    pending = self.reader.start(self.last_tokens)
                elif landing is not None:
                    exchange.close()  # the fence, after the sampler that stored the tokens
                    pending = landing.tolist  # the pool counts and times a read that waits
                else:
                    handle = exchange.readback(self.last_tokens)
                    exchange.close()
                    pending = self.reader.wrap(handle)
            ok = True
            return pending
        finally:
            if not ok and exchange is not None:
                exchange.close(ok=False)  # aborted: a flushed copy still gets its fence

    def _launch_decode(
        self,
        reqs: list[Request],
        bs: int,
        rows_d: torch.Tensor,
        positions_d: torch.Tensor,
        out_cache_loc: torch.Tensor,
        land_to: torch.Tensor | None = None,
    ) -> None:
        max_len = max(r.seq_len for r in reqs) + 1
        for r in reqs:
            r.seq_len += 1
        if self.record_gpu:
            start = self.gpu_mark()
        self.rtt.req_to_token[rows_d, positions_d] = out_cache_loc.to(torch.int32)
        if self.extra_cycles:
            torch.cuda._sleep(self.extra_cycles)
        assert self.last_tokens is not None
        logits = self.model.forward(
            self.last_tokens,
            positions_d,
            rows_d,
            out_cache_loc,
            self.arange[:bs],
            self.rtt.req_to_token,
            self.cache,
            max_len,
        )
        self.last_tokens = self.sampler(logits, self.info, positions_d, land_to=land_to)
        if self.record_gpu:
            self.times.gpu_events.append((start, self.gpu_mark()))

    def gpu_mark(self) -> Any:
        """A timing event recorded now on the pool device's current stream (the bench's GPU µs).

        The stream is passed to ``record``: without it torch looks the current stream up
        through several Python calls, which measured 20-35 µs of host time per step for
        the two marks on an H200 host (2026-11-30, tests/bench/diag_overlap.py), a cost
        of the measurement that every mode's step would carry.
        """
        event = torch.cuda.Event(enable_timing=True)
        event.record(self.pool.transport.resolve_stream(None))
        return event

    def _sampling_info(self, reqs: list[Request]) -> Any:
        if self.pooled:
            batch = _Batch(reqs, self.device)
            return SamplingBatchInfo.from_schedule_batch(
                batch, self.model_cfg.vocab_size, self.pool, owned=True, deterministic=True
            )
        return PerFieldSamplingInfo([r.sampling_params for r in reqs], self.model_cfg.vocab_size, self.uploader)

    def _consume(self, read: Pending, reqs: list[Request]) -> None:
        with self.staging("read"):
            tokens = read()
        accept_all(reqs, tokens)
        keep = [i for i, r in enumerate(self.running) if not r.done]
        if len(keep) == len(self.running):
            return
        for r in self.running:
            if r.done:
                self._free(r)
        self.running = [self.running[i] for i in keep]
        if not keep:
            self.info, self.last_tokens = None, None
            return
        with self.staging("filter"):
            (keep_d,) = self.uploader.upload("filter", [(keep, torch.int64)])
            self.info.filter_batch(keep, keep_d)
        assert self.last_tokens is not None
        self.last_tokens = self.last_tokens.index_select(0, keep_d)

    def _free(self, r: Request) -> None:
        """Give back a finished request's own KV slots and its row."""
        self.kv.free(self.rtt.req_to_token[r.row, r.owned_from : r.seq_len].long())
        self.rtt.free(r.row)


class StagingClock:
    """Accumulates host seconds spent moving metadata (uploads, batch builds, read-backs).

    ``with clock("site"):`` also books the time under that site, so a bench can say which
    staging site costs what.
    """

    __slots__ = ("_site", "_start", "by_site", "total")

    def __init__(self) -> None:
        self.total = 0.0
        self._start = 0.0
        self._site = "other"
        self.by_site: dict[str, float] = {}

    def __call__(self, site: str) -> StagingClock:
        self._site = site
        return self

    def __enter__(self) -> None:
        self._start = time.perf_counter()

    def __exit__(self, *exc: object) -> None:
        spent = time.perf_counter() - self._start
        self.total += spent
        self.by_site[self._site] = self.by_site.get(self._site, 0.0) + spent
        self._site = "other"


class _EmptyPrefixes(dict[torch.device, torch.Tensor]):
    def __missing__(self, device: torch.device) -> torch.Tensor:
        value = self[device] = torch.empty(0, dtype=torch.int32, device=device)
        return value


_EMPTY_PREFIX = _EmptyPrefixes()
