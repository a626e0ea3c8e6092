"""The reference loop with CUDA-graph decode and overlap scheduling, in three staging modes.

Prefill stays eager (``engine.loop``). Each decode step takes the smallest captured
graph that holds the running batch (``engine.graph``), lands the step's inputs in the
graph's static block, replays it on the forward stream and queues one read-back of the
sampled tokens. As in ``engine.loop`` the host reads step N's tokens only after step
N+1 is queued, so it schedules and stages a step while the GPU runs the previous one.

Streams, as in sglang's overlap mode: the forward runs on a stream of its own. Each
iteration makes it current once (``use_stream``), so prefill, the decode step's device
work, its read-back and the frees all queue there; the stream that was current when the
engine was built is the scheduler's (``schedule_stream``).

The modes differ only in how the static block gets its values:

- ``pinned``: per step, rows and positions as pinned temporaries with non-blocking
  copies (PR #28076), then device-to-device copies write the graph inputs (KV slots
  from the device free list; the sampling parameters, uploaded when the batch changes,
  are copied in then, with the padding);
- ``sglang``: the batch state stays on the device: positions are incremented there, KV
  slots come from the device free list, and device-to-device copies write the graph
  inputs (padding and sampling inputs when the batch or the graph size changes).
  Nothing is uploaded in steady decode (the batch is uploaded when it changes);
- ``pool``: the scheduler keeps the batch on the host (KV slots from a host free list,
  ``memcache.HostKVAllocator``, and the block's host image) and one stage placed in
  the ``DeviceBlock`` lands every field, padding included, in ONE host-to-device copy;
  the replay stores its tokens straight into the same slot (the layout's landing field
  ``token_dst``: no read-back copy), or, where the platform refuses that, a read-back
  copies them there (``Stage.readback``). ``GraphConfig(upload_stream=
  "schedule")`` puts that copy on the scheduler's stream instead, with the forward stream
  a registered reader of the block: the stream rules (README, rule 9) order them.
"""

from __future__ import annotations

import random
from typing import Any, Literal

import attrs
import numpy as np
import torch

from memcache import AllocationError, TokenToKVPoolAllocator
from memcache.host_kv_allocator import HostKVAllocator
from pinpool import DeviceBlock, Stage
from pinpool.bench.engine.graph import DEFAULT_SIZES, DecodeGraphs
from pinpool.bench.engine.loop import Engine, EngineConfig, StagingClock, _Batch
from pinpool.bench.engine.model import ModelConfig, SleepModel, TinyDecoder
from pinpool.bench.engine.readback import Pending, TokenReader
from pinpool.bench.engine.requests import Request, accept_all
from pinpool.cuda import use_stream
from pinpool.readback import Landing
from sampling import SamplingBatchInfo
from sampling.params import RECORD_DTYPE
from sampling.static import sampling_columns

GraphMode = Literal["pinned", "sglang", "pool"]
GRAPH_MODES: tuple[GraphMode, ...] = ("pinned", "sglang", "pool")
_SAMPLING = ("temperature", "top_p", "top_k", "min_p", "seed")
_TORCH_DTYPE = {"temperature": torch.float32, "top_p": torch.float32, "top_k": torch.int32, "min_p": torch.float32}


@attrs.frozen
class GraphConfig:
    #: False: the same padded steps as plain calls (the CPU path, and the eager twin).
    capture: bool = True
    sizes: tuple[int, ...] = DEFAULT_SIZES
    #: Tests: queue up to this many cycles of GPU sleep on the forward stream before each
    #: replay (seeded), so the host runs far ahead of the device.
    lag_cycles: int = 0
    lag_seed: int = 0
    #: pool mode: where the block's copy goes. "forward": on the forward stream, ordered
    #: with the replays by the stream itself; "schedule": on the scheduler's stream, with
    #: the forward stream a registered reader of the block (the stream rules order them).
    upload_stream: Literal["forward", "schedule"] = "forward"
    #: pool mode: stage each step's number in the block; the replays log what they read
    #: (``DecodeGraphs.seen_steps``) and ``expected_positions`` says what they should have.
    check_steps: bool = False
    #: pool mode: the replay stores its tokens straight into the step's pinned slot
    #: (the landing field ``token_dst``), where the platform allows it; False, or a platform that
    #: refuses kernels writing host memory: a device-to-host read-back copy.
    land_tokens: bool = True


class _HostBatch:
    """The running batch as the pool mode's scheduler holds it: the block's host image, built on change.

    The image (``block.layout.host_image``) holds every field of the layout, padding
    included; a step updates positions and KV slots in it and lands it with one memcpy.
    """

    def __init__(self, reqs: list[Request], block: DeviceBlock, rows: int) -> None:
        bs = len(reqs)
        self.image = block.layout.host_image(rows, bs)
        views = self.image.views
        views["rows"][:] = np.fromiter((r.row for r in reqs), np.int64, bs)
        views["positions"][:] = np.fromiter((r.seq_len for r in reqs), np.int64, bs)
        records = np.frombuffer(b"".join([r.sampling_params.record for r in reqs]), RECORD_DTYPE)
        for name, values in sampling_columns(records).items():
            views[name][:] = values
        self.rows, self.positions, self.slots = views["rows"], views["positions"], views["out_cache_loc"]


class _DeviceBatch:
    """The running batch as the device-state modes hold it: rows and positions on the device."""

    def __init__(self, engine: GraphEngine, reqs: list[Request]) -> None:
        up = engine.uploader
        fields: list[tuple[Any, torch.dtype]] = [
            ([r.row for r in reqs], torch.int64),
            ([r.seq_len for r in reqs], torch.int64),
        ]
        records = np.frombuffer(b"".join([r.sampling_params.record for r in reqs]), RECORD_DTYPE)
        cols = sampling_columns(records)
        # As lists: the per-field pattern builds each tensor from Python values (torch cannot
        # pin a tensor made from a numpy array).
        fields += [(cols[n].tolist(), _TORCH_DTYPE.get(n, torch.int64)) for n in _SAMPLING]  # sync-ok: numpy, host
        uploaded = up.upload("batch", fields)
        self.rows, self.positions = uploaded[0], uploaded[1]
        self.sampling = dict(zip(_SAMPLING, uploaded[2:], strict=True))


class GraphEngine(Engine):
    """``Engine`` with graph decode on a forward stream; ``mode``: one of ``GRAPH_MODES``."""

    def __init__(
        self,
        model_cfg: ModelConfig,
        mode: GraphMode,
        device: torch.device,
        cfg: EngineConfig,
        graph_cfg: GraphConfig | None = None,
        *,
        model: TinyDecoder | SleepModel | None = None,
    ) -> None:
        if mode not in GRAPH_MODES:
            raise ValueError(f"'mode' must be one of {', '.join(GRAPH_MODES)} (got {mode!r})")
        graph_cfg = graph_cfg or GraphConfig()
        landing = mode == "pool" and graph_cfg.land_tokens
        super().__init__(
            model_cfg, "pool" if mode == "pool" else "pinned", device, cfg, model=model, zero_copy_pool=landing
        )
        #: Host seconds per decode phase ("stage", "replay", "readback"), summed over steps.
        self.phases = StagingClock()
        self.graph_mode: GraphMode = mode
        self.graph_cfg = graph_cfg
        #: The replay writes its tokens into the step's slot (the pool passed its platform check).
        self.land_tokens = landing and self.pool.can_land
        cuda = device.type == "cuda"
        # The scheduler's stream (uploads) and the forward stream (prefill, replays, reads).
        self.schedule_stream = torch.cuda.current_stream(device) if cuda else None
        self.forward_stream = torch.cuda.Stream(device) if cuda else None
        if mode == "sglang":
            self.reader = TokenReader("persistent", self.pool)  # no pinned allocation per step
        # One request row is reserved for padding: it is never handed to a request.
        self.pad_row = self.rtt.alloc(1)[0]
        if mode == "pool":
            self.kv = self.host_kv = HostKVAllocator(cfg.kv_slots)  # type: ignore[assignment]
            #: int64 [rows, max_context_len]: the KV slot of each (row, position), on the host.
            self.slot_of = np.zeros((self.rtt.size, model_cfg.max_context_len), dtype=np.int64)
        elif self.forward_stream is not None:
            # The device free list lives on the forward stream, where it is sliced, read and
            # replaced (torch.cat): allocated there, its memory is never handed to another
            # stream's pool while forward-stream kernels may still read it.
            with use_stream(self.forward_stream):
                self.kv = TokenToKVPoolAllocator(cfg.kv_slots, device)
        self._lag = random.Random(self.graph_cfg.lag_seed) if self.graph_cfg.lag_cycles else None
        extra = None
        if self.extra_cycles:
            cycles = self.extra_cycles
            extra = lambda: torch.cuda._sleep(cycles)  # noqa: E731
        self.graphs = DecodeGraphs(
            self.model,
            self.pool,
            self.rtt.req_to_token,
            self.cache,
            max_rows=cfg.max_running,
            pad_row=self.pad_row,
            vocab_size=model_cfg.vocab_size,
            width=model_cfg.max_context_len,
            capture=self.graph_cfg.capture and cuda,
            sizes=self.graph_cfg.sizes,
            extra_work=extra,
            check_steps=self.graph_cfg.check_steps and mode == "pool",
            land_tokens=self.land_tokens,
        )
        #: check_steps: the first row's position each step staged, by step number - 1.
        self.expected_positions: list[int] = []
        #: Where the pool mode's block copy goes (None: the host path).
        self.upload_stream = self.forward_stream
        if self.forward_stream is not None:
            # The forward stream writes the block (device-to-device copies in the pinned and
            # sglang modes) and reads it (every replay).
            self.graphs.block.record_stream(self.forward_stream)
            if self.graph_cfg.upload_stream == "schedule":
                self.upload_stream = self.schedule_stream
                self.graphs.block.register_reader(self.forward_stream)
            self.graphs.capture_all(self.forward_stream, self.upload_stream)
        self._batch: Any = None  # _HostBatch / _DeviceBatch of the running set, None after a change
        self._written_shape: tuple[int, int] | None = None  # (rows, bs) the graph inputs' padding is for
        self.replays = 0

    # -- hooks of Engine -------------------------------------------------------------------
    def step(self) -> str:
        # The whole iteration runs with the forward stream current: prefill, the decode
        # step's device work, its read-back and the frees all queue there, so one switch
        # per iteration serves them (``use_stream``, a fraction of torch.cuda.stream's host
        # cost).
        with use_stream(self.forward_stream):
            return super().step()

    def _alloc_extend(
        self, reqs: list[Request], prefix_lens: list[int], extend: list[int]
    ) -> tuple[list[int], torch.Tensor]:
        if self.graph_mode != "pool":
            return super()._alloc_extend(reqs, prefix_lens, extend)
        total = sum(extend)
        if len(reqs) > self.rtt.available_size() or total > self.kv.available_size():
            raise AllocationError(f"prefill needs {len(reqs)} rows and {total} KV slots; nothing was allocated")
        rows = self.rtt.alloc(len(reqs))
        slots = self.kv.alloc(total)
        start = 0
        for row, p, e in zip(rows, prefix_lens, extend, strict=True):
            self.slot_of[row, p : p + e] = slots[start : start + e]
            start += e
        (slots_d,) = self.uploader.upload("prefill.slots", [(slots, torch.int64)])
        return rows, slots_d

    def _sampling_info(self, reqs: list[Request]) -> Any:
        if self.graph_mode == "pool":
            # Read once by the prefill's sampler: a ring stage, no owned allocation.
            return SamplingBatchInfo.from_schedule_batch(
                _Batch(reqs, self.device), self.model_cfg.vocab_size, self.pool, deterministic=True
            )
        return super()._sampling_info(reqs)

    def _join(self, info: Any, new_tokens: torch.Tensor, rows_d: torch.Tensor, last_d: torch.Tensor) -> None:
        # Tokens live on the device by request row; the batch state is rebuilt at the next decode.
        self.graphs.tokens_by_row[rows_d[last_d]] = new_tokens
        self._batch = None

    def _free(self, r: Request) -> None:
        if self.graph_mode == "pool":
            self.kv.free(self.slot_of[r.row, r.owned_from : r.seq_len])  # type: ignore[arg-type]
            self.rtt.free(r.row)
            return
        super()._free(r)

    def _consume(self, read: Pending, reqs: list[Request]) -> None:
        with self.staging("read"):
            tokens = read()
        if not accept_all(reqs, tokens):
            return  # nobody finished: the batch (and the pool mode's host image) stays as it is
        for r in self.running:
            if r.done:
                self._free(r)
        self.running = [r for r in self.running if not r.done]
        self._batch = None

    # -- the decode step -----------------------------------------------------------------
    def _decode(self) -> Pending:
        reqs, bs = self.running, len(self.running)
        rows = self.graphs.padded(bs)
        mode = self.graph_mode
        exchange: Stage | None = None
        landing: Landing | None = None
        with self.staging("decode.stage"), self.phases("stage"):
            if mode == "pool":
                exchange, landing = self._stage_pool(reqs, bs, rows)
                if landing is None and exchange.stream is not self.forward_stream:
                    # Copied on the scheduler's stream: the tokens are read back on the
                    # forward stream, where the replay runs, by a read-back of their own.
                    exchange.close()
                    exchange = None
            elif mode == "pinned":
                self._stage_pinned(reqs, bs, rows)
            else:
                self._stage_sglang(reqs, bs, rows)
        ok = False
        # The pool's exchange stays open across the replay: the tokens come back into the
        # same slot under the same fence (Stage.readback). A failure closes it still.
        try:
            for r in reqs:
                r.seq_len += 1
            if self._lag is not None:
                torch.cuda._sleep(self._lag.randrange(self.graph_cfg.lag_cycles))
            if self.record_gpu:
                start = self.gpu_mark()
            with self.phases("replay"):
                self.graphs.replay(rows)
            self.replays += 1
            if self.record_gpu:
                self.times.gpu_events.append((start, self.gpu_mark()))
            with self.staging("decode.readback"), self.phases("readback"):
                if landing is not None:
                    # The replay stores the tokens in the slot; the close below fences them.
                    pending = self.reader.wrap(landing)
                elif exchange is not None:
                    pending = self.reader.wrap(exchange.readback(self.graphs.out_tokens[:bs]))
                elif mode == "pool":
                    pending = self.reader.wrap(self.pool.readback(self.graphs.out_tokens[:bs]))
                else:
                    pending = self.reader.start(self.graphs.out_tokens[:bs])
            ok = True
            return pending
        finally:
            if exchange is not None:
                exchange.close(ok=ok)

    def _stage_pool(self, reqs: list[Request], bs: int, rows: int) -> tuple[Stage, Landing | None]:
        """Open this step's exchange and issue its one copy; the caller replays, reads back and closes.

        With ``land_tokens`` the copy also carries where each row's token goes in the
        slot (the landing field ``token_dst``, written by the stage when it opens), and the
        returned ``Landing`` reads them once the exchange has closed.
        """
        block = self.graphs.block
        batch = self._batch
        if batch is None:
            batch = self._batch = _HostBatch(reqs, block, rows)
        slots = batch.slots
        self.host_kv.alloc_into(slots)  # straight into the image: the step's KV slots
        positions = batch.positions
        try:
            st = block.stage(rows, bs, stream=self.upload_stream)
        except BaseException:
            self.kv.free(slots)  # nothing was staged: the step's KV slots go back
            raise
        landing = None
        try:
            st.put_image(batch.image)  # every field, padding included: one memcpy (the addresses kept)
            if self.land_tokens:
                landing = st.landing("token_dst")
            if self.graphs.check_steps:
                st.put("step", np.full(bs, self.replays + 1, dtype=np.int64))
                self.expected_positions.append(int(positions[0]))  # sync-ok: numpy on the host, no device
            st.flush()
        except BaseException:
            try:
                st.close(ok=False)
            finally:
                self.kv.free(slots)  # the step never ran: its KV slots go back, even if close raised
            raise
        self.slot_of[batch.rows, positions] = slots
        positions += 1  # in the image: the next step's positions
        return st, landing

    def _stage_pinned(self, reqs: list[Request], bs: int, rows: int) -> None:
        fresh = self._batch is None
        if fresh:
            self._batch = _DeviceBatch(self, reqs)  # for its sampling tensors
        rows_d, positions_d = self.uploader.upload(
            "step", [([r.row for r in reqs], torch.int64), ([r.seq_len for r in reqs], torch.int64)]
        )
        self._write_inputs(rows, bs, rows_d, positions_d, self.kv.alloc(bs), fresh)

    def _stage_sglang(self, reqs: list[Request], bs: int, rows: int) -> None:
        fresh = self._batch is None
        if fresh:
            self._batch = _DeviceBatch(self, reqs)
        batch = self._batch
        self._write_inputs(rows, bs, batch.rows, batch.positions, self.kv.alloc(bs), fresh)
        batch.positions += 1  # the next step's positions, on the device

    def _write_inputs(
        self, rows: int, bs: int, rows_d: torch.Tensor, positions_d: torch.Tensor, slots_d: torch.Tensor, fresh: bool
    ) -> None:
        """Device-to-device copies into the graph inputs, then padding fills.

        The padding and the sampling inputs are rewritten only when the batch or the graph
        size changed: in between nothing else writes those bytes (the strongest form of
        the peers' pattern, which fills padding on every replay).
        """
        views = self.graphs.block.views(rows)
        views["rows"][:bs].copy_(rows_d)
        views["positions"][:bs].copy_(positions_d)
        views["out_cache_loc"][:bs].copy_(slots_d)
        if fresh or (rows, bs) != self._written_shape:
            self._written_shape = (rows, bs)
            for name in _SAMPLING:
                views[name][:bs].copy_(self._batch.sampling[name])
            if bs < rows:
                for f in self.graphs.block.layout.fields:
                    views[f.name][bs:].fill_(f.pad)
