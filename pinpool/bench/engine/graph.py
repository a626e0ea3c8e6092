"""The decode step as CUDA graphs: the model and the sampler captured per padded batch size.

Every graph reads its inputs from one ``pinpool.DeviceBlock``, at the addresses
``block.views(rows)`` gave at capture: the request rows, positions and KV slots of the
step, and each request's sampling parameters (``sampling.static``). How the block gets
this step's values is the staging mode's business (``engine.graph_loop``); the graphs
are the same in every mode, so token streams can be compared across modes.

Tokens never travel through the host between steps: ``tokens_by_row[row]`` holds each
request's newest token on the device. A graph reads its input tokens from there and
writes the sampled ones back, and either into ``out_tokens``, which the loop reads back,
or (``land_tokens``) straight into the step's pinned slot, stored by the sampler's own
kernel. A prefill writes its requests' first tokens there too. Padding rows point at a
reserved request row and KV slot 0, so what they compute lands where no request reads.

``capture=False`` runs the same step as plain calls: the CPU path of the tests, and the
eager twin the graph's tokens are compared with.
"""

from __future__ import annotations

import bisect
from collections.abc import Callable, Sequence

import torch

from pinpool import DeviceBlock, Field, Layout, PinnedRingBuffer
from pinpool.bench.engine.model import KVCache, SleepModel, TinyDecoder
from sampling import Sampler
from sampling.static import SAMPLING_FIELDS, StaticSamplingInfo

#: Padded batch sizes a decode step may take (each a graph); trimmed to the engine's max.
DEFAULT_SIZES = (1, 2, 4, 8, 12, 16, 24, 32, 48, 64, 96, 128, 160, 192, 256)


#: Steps a ``check_steps`` log holds (step numbers start at 1).
CHECK_STEPS = 1 << 16


def step_fields(pad_row: int, check_steps: bool = False, land_tokens: bool = False) -> tuple[Field, ...]:
    """The block's fields: what one decode step needs per request, then its sampling parameters.

    ``check_steps`` adds ``step`` (the step's number in every live row), which each replay
    logs on the device: a replay that read another step's block logs the wrong number.
    ``land_tokens`` adds ``token_dst``, a landing field: the pinned address each row's
    sampled token is stored at by the replay itself, written by the stage when it opens
    (``Field.landing``), 0 on padding rows.
    """
    check = (Field("step", torch.int64, pad=-1),) if check_steps else ()
    landing = (Field.landing("token_dst"),) if land_tokens else ()
    return (
        Field("rows", torch.int64, pad=pad_row),
        Field("positions", torch.int64, pad=0),
        Field("out_cache_loc", torch.int64, pad=0),
        *SAMPLING_FIELDS,
        *check,
        *landing,
    )


def graph_sizes(max_rows: int, sizes: Sequence[int] = DEFAULT_SIZES) -> tuple[int, ...]:
    """The sizes up to ``max_rows``, with ``max_rows`` itself so every batch fits one."""
    kept = sorted({s for s in sizes if 1 <= s < max_rows} | {max_rows})
    return tuple(kept)


class DecodeGraphs:
    """One decode step per padded size: ``replay(rows)`` launches it on the current stream."""

    def __init__(
        self,
        model: TinyDecoder | SleepModel,
        pool: PinnedRingBuffer,
        req_to_token: torch.Tensor,
        cache: KVCache,
        *,
        max_rows: int,
        pad_row: int,
        vocab_size: int,
        width: int,
        capture: bool,
        sizes: Sequence[int] = DEFAULT_SIZES,
        extra_work: Callable[[], None] | None = None,
        check_steps: bool = False,
        land_tokens: bool = False,
    ) -> None:
        self.model, self.req_to_token, self.cache = model, req_to_token, cache
        self.sizes = graph_sizes(max_rows, sizes)
        self.max_rows = self.sizes[-1]
        self.width = width  # attention width of a decode step: fixed, so every size has one shape
        self.vocab_size = vocab_size
        self.capture = capture
        self.extra_work = extra_work
        device = req_to_token.device
        self.block = DeviceBlock(pool, Layout(step_fields(pad_row, check_steps, land_tokens), self.max_rows))
        self.check_steps = check_steps
        #: The replay stores each live row's token at the pinned address its step staged.
        self.land_tokens = land_tokens
        #: check_steps: int64 [CHECK_STEPS]: at index s, the step number (and the first row's
        #: position) that the replay of step s read from the block; -1 where none ran.
        self.seen_steps = torch.full((CHECK_STEPS,), -1, dtype=torch.int64, device=req_to_token.device)
        self.seen_positions = torch.full_like(self.seen_steps, -1)
        #: int64 [req_to_token rows]: each request's newest token, by request row.
        self.tokens_by_row = torch.zeros(req_to_token.shape[0], dtype=torch.int64, device=device)
        #: int64 [max_rows]: the tokens the last replay sampled, padding rows included.
        self.out_tokens = torch.zeros(self.max_rows, dtype=torch.int64, device=device)
        self._arange = torch.arange(self.max_rows, device=device)
        self._sampler = Sampler()
        self._graphs: dict[int, torch.cuda.CUDAGraph] = {}
        self._infos: dict[int, StaticSamplingInfo] = {}

    def padded(self, bs: int) -> int:
        """The smallest size that holds ``bs`` rows."""
        return self.sizes[bisect.bisect_left(self.sizes, bs)]

    def body(self, rows: int) -> None:
        """The step for ``rows`` padded rows, launched on the current stream (what a graph captures)."""
        views = self.block.views(rows)
        req_rows, positions, out_cache_loc = views["rows"], views["positions"], views["out_cache_loc"]
        self.req_to_token[req_rows, positions] = out_cache_loc.to(torch.int32)
        if self.extra_work is not None:
            self.extra_work()
        tokens = self.tokens_by_row[req_rows]
        logits = self.model.forward(
            tokens,
            positions,
            req_rows,
            out_cache_loc,
            self._arange[:rows],
            self.req_to_token,
            self.cache,
            self.width,
        )
        info = self._infos.get(rows)
        if info is None:
            info = self._infos[rows] = StaticSamplingInfo(views, rows, self.vocab_size)
        # Landing: the sampler stores each token straight into the step's slot itself (its
        # draw kernel, or pinpool.landing.land after the other paths): no read-back copy,
        # and no copy into out_tokens, which only a read-back reads.
        land_to = views["token_dst"] if self.land_tokens else None
        new_tokens = self._sampler(logits, info, positions, land_to=land_to)
        self.tokens_by_row[req_rows] = new_tokens  # padding rows all write the reserved row
        if land_to is None:
            self.out_tokens[:rows].copy_(new_tokens)
        if self.check_steps:
            step = views["step"][:1].clamp(0, CHECK_STEPS - 1)  # padding-only capture: -1 -> 0
            self.seen_steps.index_copy_(0, step, views["step"][:1])
            self.seen_positions.index_copy_(0, step, positions[:1])

    def capture_all(self, stream: torch.cuda.Stream, stage_stream: torch.cuda.Stream | None = None) -> None:
        """Capture every size on ``stream`` (largest first, so the smaller share its memory).

        Before each capture the block holds padding only (``live=0``) and the step runs
        twice eagerly on ``stream``: Triton compiles, cuBLAS picks its kernels, and the
        allocator has the blocks the capture will take.
        """
        if not self.capture:
            return
        mempool = torch.cuda.graph_pool_handle()
        for rows in reversed(self.sizes):
            with self.block.stage(rows, 0, stream=stage_stream or stream) as st:
                st.flush()  # padding only; a layout with a landing field must flush before close
            with torch.cuda.stream(stream):
                for _ in range(2):
                    self.body(rows)
            stream.synchronize()  # sync-ok: start-up, before capture; never per step
            graph = torch.cuda.CUDAGraph()
            with torch.cuda.graph(graph, pool=mempool, stream=stream):
                self.body(rows)
            self._graphs[rows] = graph
        stream.synchronize()  # sync-ok: start-up, after capture

    def replay(self, rows: int) -> None:
        """Launch the step for ``rows`` padded rows on the current stream."""
        graph = self._graphs.get(rows)
        if graph is None:
            self.body(rows)
        else:
            graph.replay()
