"""Sampler() captured in a CUDA graph over a DeviceBlock: replays draw the eager tokens.

One graph per test is captured with a ``StaticSamplingInfo`` over the block's views, static
logits, and the block's ``positions`` field. Each step then restages other requests (other
live counts, greedy and filtered mixes) through the block's one copy, writes new logits into
the static tensor, replays, and keeps a clone of the tokens; after the last step every
step's tokens are compared with the eager sampler on a deterministic ``SamplingBatchInfo`` of
that step's live requests, and the padding rows with a default request at position 0.

The stage's stream and the replay's stream take turns lagging (``torch.cuda._sleep``), and
every third step neither does: a replay that does not wait for the copy reads the previous
step's values, and a copy that does not wait for the previous (lagged) replay overwrites what
it still reads; either changes tokens.
"""

from __future__ import annotations

import random
from collections.abc import Iterator
from contextlib import contextmanager
from typing import Any

import pytest
import torch

from pinpool import DeviceBlock, Field, Layout, PinnedRingBuffer, PoolSettings
from pinpool.testing import no_sync
from sampling import (
    SAMPLING_FIELDS,
    Sampler,
    SamplingBatchInfo,
    SamplingParams,
    StaticSamplingInfo,
    sampling_columns,
)
from tests.fakes import Batch, Req, random_params

DEV = torch.device("cuda", 0)
ROWS = 16
LAG = 20_000_000  # about 10 ms of GPU sleep
FIELDS = (*SAMPLING_FIELDS, Field("positions", torch.int64, 0))
TWO_GPUS = torch.cuda.device_count() >= 2
PLACES = [
    "default stream",
    "side stream",
    pytest.param("other device current", marks=pytest.mark.skipif(not TWO_GPUS, reason="needs two CUDA devices")),
]
#: Live rows per step: full, partial, a single row; step 3 is all greedy, step 4 filter-free.
LIVES = [16, 3, 1, 9, 16, 5, 12, 2]


def make_block() -> DeviceBlock:
    pool = PinnedRingBuffer(PoolSettings(device=DEV, num_slots=8, slot_bytes=1 << 16))
    return DeviceBlock(pool, Layout(FIELDS, ROWS))


class SamplerGraph:
    """``Sampler()`` captured for ``rows`` padded rows: reads ``logits`` and the block, writes ``tokens``."""

    def __init__(self, block: DeviceBlock, rows: int, vocab: int) -> None:
        self.views = block.views(rows)
        self.info = StaticSamplingInfo(self.views, rows, vocab)
        self.logits = torch.zeros(rows, vocab, device=DEV)
        sampler = Sampler()
        # Valid values in the block before the warm-up reads it (it holds garbage until a copy).
        stage(block, rows, [SamplingParams(seed=1)], [0], torch.cuda.default_stream(DEV))
        torch.cuda.synchronize(DEV)
        warm = torch.cuda.Stream(DEV)
        with torch.cuda.stream(warm):  # PyTorch's rule: warm up on a side stream before capture
            for _ in range(3):  # compiles the Triton kernel, caches the allocator's blocks
                sampler(self.logits, self.info, self.views["positions"])
        torch.cuda.synchronize(DEV)
        self.graph = torch.cuda.CUDAGraph()
        with torch.cuda.graph(self.graph, stream=torch.cuda.Stream(DEV)):
            self.tokens = sampler(self.logits, self.info, self.views["positions"])
        torch.cuda.synchronize(DEV)


def stage(
    block: DeviceBlock, rows: int, params: list[SamplingParams], positions: list[int], stream: torch.cuda.Stream
) -> None:
    cols = sampling_columns(b"".join(p.record for p in params))
    with block.stage(rows, len(params), stream=stream) as st:
        for name, values in cols.items():
            st.put(name, values)
        st.put("positions", positions)


def step_params(rng: random.Random, step: int, live: int, vocab: int) -> list[SamplingParams]:
    if step == 3:
        return [SamplingParams(temperature=0.0, seed=rng.randrange(2**40)) for _ in range(live)]
    if step == 4:
        return [SamplingParams(temperature=rng.uniform(0.3, 1.5)) for _ in range(live)]  # no filter, seedless
    return [random_params(rng, vocab, bias=False) for _ in range(live)]


@contextmanager
def place_of(place: str) -> Iterator[torch.cuda.Stream]:
    """Yields the stream replays run on (DEV's current stream in the body); stages go to DEV's default stream.

    "other device current": the side stream is entered first (it becomes DEV's current stream),
    then cuda:1 is made current for the whole body: capture, stages, replays.
    """
    if place == "default stream":
        with torch.cuda.device(DEV):
            yield torch.cuda.default_stream(DEV)
        return
    side = torch.cuda.Stream(DEV)
    with torch.cuda.stream(side):
        if place == "other device current":
            with torch.cuda.device(1):
                yield side
        else:
            yield side


def lag(stream: torch.cuda.Stream) -> None:
    with torch.cuda.stream(stream):
        torch.cuda._sleep(LAG)


class Eager:
    """The eager sampler on a deterministic SamplingBatchInfo of exactly the given requests."""

    def __init__(self, vocab: int) -> None:
        self.vocab = vocab
        self.pool = PinnedRingBuffer(PoolSettings(device=DEV, num_slots=8, slot_bytes=1 << 20))

    def __call__(self, params: list[SamplingParams], positions: list[int], logits: torch.Tensor) -> list[int]:
        info = SamplingBatchInfo.from_schedule_batch(
            Batch([Req(p) for p in params], DEV), self.vocab, self.pool, owned=True, deterministic=True
        )
        return Sampler()(logits, info, torch.tensor(positions, dtype=torch.int64, device=DEV)).tolist()


def check(eager: Eager, steps: list[tuple[list[SamplingParams], list[int], torch.Tensor, torch.Tensor]]) -> None:
    for i, (params, positions, logits, got) in enumerate(steps):
        live = len(params)
        tokens = got.tolist()
        assert tokens[:live] == eager(params, positions, logits[:live]), f"step {i}: live rows"
        if live < ROWS:  # padding: a default request (temperature 1, no filter, seed 42) at position 0
            pad = eager([SamplingParams()] * (ROWS - live), [0] * (ROWS - live), logits[live:])
            assert tokens[live:] == pad, f"step {i}: padding rows"


@pytest.mark.parametrize("place", PLACES)
@pytest.mark.parametrize("vocab", [1000, 32_000])
def test_replays_draw_the_eager_tokens(place: str, vocab: int) -> None:
    """Catches a graph that froze the capture step's values or path (flags, greedy), a stage whose copy
    is not ordered against the replay (either way), padding not rewritten, or a replay queued on the
    wrong device or stream."""
    rng = random.Random(vocab)
    gen = torch.Generator(device=DEV).manual_seed(vocab)
    block = make_block()
    step_logits = [torch.randn(ROWS, vocab, device=DEV, generator=gen) * 3.0 for _ in LIVES]
    plans = []
    for i, live in enumerate(LIVES):
        plans.append((step_params(rng, i, live, vocab), [rng.randrange(1 << 20) for _ in range(live)]))
    torch.cuda.synchronize(DEV)
    default = torch.cuda.default_stream(DEV)
    steps: list[Any] = []
    with place_of(place) as replay_stream:
        if place != "default stream":
            block.register_reader(replay_stream)
        g = SamplerGraph(block, ROWS, vocab)
        for i, ((params, positions), logits) in enumerate(zip(plans, step_logits, strict=True)):
            if i % 3 == 0:
                lag(default)  # the copy lands late: the replay must wait for it
            stage(block, ROWS, params, positions, default)
            if i % 3 == 1:
                lag(replay_stream)  # the replay reads late: the next (unlagged) copy must wait for it
            g.logits.copy_(logits)  # on DEV's current stream, the replay's
            g.graph.replay()
            steps.append((params, positions, logits, g.tokens.clone()))
            if place == "other device current":
                assert torch.cuda.current_device() == 1
    torch.cuda.synchronize(DEV)
    check(Eager(vocab), steps)


def test_two_graph_sizes_share_one_block() -> None:
    """Catches graphs of two sizes over one block reading each other's layout."""
    vocab = 1000
    rng = random.Random(5)
    gen = torch.Generator(device=DEV).manual_seed(5)
    block = make_block()
    default = torch.cuda.default_stream(DEV)
    with torch.cuda.device(DEV):
        small, big = SamplerGraph(block, 4, vocab), SamplerGraph(block, ROWS, vocab)
        seen: list[tuple[int, list[SamplingParams], list[int], torch.Tensor, torch.Tensor]] = []
        for i in range(6):
            g, rows = (small, 4) if i % 2 else (big, ROWS)
            live = rng.randint(1, rows)
            params = [random_params(rng, vocab, bias=False) for _ in range(live)]
            positions = [rng.randrange(1 << 20) for _ in range(live)]
            logits = torch.randn(rows, vocab, device=DEV, generator=gen)
            stage(block, rows, params, positions, default)
            g.logits.copy_(logits)
            g.graph.replay()
            seen.append((rows, params, positions, logits, g.tokens.clone()))
    torch.cuda.synchronize(DEV)
    eager = Eager(vocab)
    for rows, params, positions, logits, got in seen:
        assert got.shape == (rows,)
        assert got[: len(params)].tolist() == eager(params, positions, logits[: len(params)])


def test_a_replay_step_makes_no_host_sync() -> None:
    """Catches a host sync in a decode step's sampling: the stage, the logits write, the replay
    (``no_sync`` sets ``torch.cuda.set_sync_debug_mode("error")`` and refuses pool fence waits)."""
    vocab = 32_000
    rng = random.Random(9)
    gen = torch.Generator(device=DEV).manual_seed(9)
    block = make_block()
    default = torch.cuda.default_stream(DEV)
    lives = [16, 7, 1, 12]
    plans = [
        (step_params(rng, i, live, vocab), [rng.randrange(1 << 20) for _ in range(live)])
        for i, live in enumerate(lives)
    ]
    step_logits = [torch.randn(ROWS, vocab, device=DEV, generator=gen) for _ in lives]
    with torch.cuda.device(DEV):
        g = SamplerGraph(block, ROWS, vocab)
        stage(block, ROWS, *plans[0], default)  # one step before the guard: first-use host caches
        g.graph.replay()
        torch.cuda.synchronize(DEV)
        steps: list[Any] = []
        with no_sync():
            assert torch.cuda.get_sync_debug_mode() == 2  # "error"
            for (params, positions), logits in zip(plans, step_logits, strict=True):
                stage(block, ROWS, params, positions, default)
                g.logits.copy_(logits)
                g.graph.replay()
                steps.append((params, positions, logits, g.tokens.clone()))
    torch.cuda.synchronize(DEV)
    check(Eager(vocab), steps)
