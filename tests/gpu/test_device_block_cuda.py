"""``DeviceBlock`` on real CUDA: a captured graph replays from the block every step, on a lagging reader stream.

Each graph (one per padded size) reads ``block.views(rows)``, casts every field to float64
and writes the row into its log at index ``counter``, then adds 1 to ``counter``: row k
of a log is what replay k read. All replays run on one registered reader stream with
``torch.cuda._sleep`` lag queued before each, while the host stages the next steps on
another stream (or the current one, or the reader itself). After one synchronize every
replay must have read its own step's values, padding included: never the next step's
(the copy overtook the replay) nor the previous one's (the replay overtook the copy).

Parametrized like the zero-copy tests: the pool on cuda:0 with cuda:0 or cuda:1 current,
and on cuda:1 while cuda:0 is current (the two-GPU cases skip with one GPU). The control
drops ``register_reader`` and must see a replay read a later step.
"""

from __future__ import annotations

import random
from collections.abc import Callable, Iterator
from contextlib import contextmanager
from typing import Any

import numpy as np
import pytest
import torch
from torch.profiler import ProfilerActivity, profile

from pinpool import DeviceBlock, Field, Layout, PinnedRingBuffer, PoolSettings
from pinpool.encode import NUMPY_DTYPE
from pinpool.testing import no_sync

LAG = 2_000_000  # about 1 ms of GPU sleep at most per replay: the host stages steps far ahead of the replays
CONTROL_LAG = 2_000_000  # about 1 ms before every replay in the control: the host stages many steps per replay
STEPS = 120
FIELDS = (
    Field("step", torch.int64, pad=-1),  # first, at offset 0 of every layout: row 0 says which step was read
    Field("positions", torch.int32, pad=0),
    Field("temps", torch.float32, pad=1.0),
    Field("mask", torch.bool, pad=False),
    Field("small", torch.int16, pad=7),
)
MAX_ROWS = 64
LAYOUT = Layout(FIELDS, MAX_ROWS)
SIZES = (8, 37, 64)

needs_two = pytest.mark.skipif(torch.cuda.device_count() < 2, reason="needs two CUDA devices")
Where = tuple[int, int, str]  # (pool's device, current device, stage stream: "side" | "current" | "reader")
WHERE = [
    pytest.param((0, 0, "side"), id="cuda0-stage-on-side-stream"),
    pytest.param((0, 0, "current"), id="cuda0-stage-on-current-stream"),
    pytest.param((0, 0, "reader"), id="cuda0-stage-on-the-replay-stream"),
    pytest.param((0, 1, "side"), id="cuda0-side-stream-while-cuda1-current", marks=needs_two),
    pytest.param((0, 1, "current"), id="cuda0-current-stream-while-cuda1-current", marks=needs_two),
    pytest.param((1, 0, "side"), id="cuda1-side-stream-while-cuda0-current", marks=needs_two),
    pytest.param((1, 0, "current"), id="cuda1-current-stream-while-cuda0-current", marks=needs_two),
]
STEADY = [WHERE[0], WHERE[1]]

Values = dict[str, np.ndarray[Any, Any]]


class Replayer:
    """One captured graph per size: it reads the block's views and logs them at row ``counter``."""

    def __init__(self, block: DeviceBlock, device: torch.device, replays: int, sizes: tuple[int, ...]) -> None:
        self.device = device
        self.block = block
        self.counter = torch.zeros(1, dtype=torch.int64, device=device)
        self.logs = {
            rows: torch.full(
                (replays, len(block.layout.fields) * rows), float("nan"), dtype=torch.float64, device=device
            )
            for rows in sizes
        }
        self.graphs: dict[int, torch.cuda.CUDAGraph] = {}
        with torch.cuda.device(device):
            warm = torch.cuda.Stream(device=device)
            warm.wait_stream(torch.cuda.current_stream(device))
            with torch.cuda.stream(warm):
                for rows in sizes:
                    for _ in range(2):
                        self._body(rows)
            torch.cuda.synchronize(device)
            # An explicit capture stream on the block's device: torch.cuda.graph's default one is made once, on
            # whatever device was current at the first capture in the process.
            capture = torch.cuda.Stream(device=device)
            for rows in sizes:
                graph = torch.cuda.CUDAGraph()
                with torch.cuda.graph(graph, stream=capture):
                    self._body(rows)
                self.graphs[rows] = graph
            torch.cuda.synchronize(device)
            self.counter.zero_()
            for log in self.logs.values():
                log.fill_(float("nan"))
            torch.cuda.synchronize(device)

    def _body(self, rows: int) -> None:
        views = self.block.views(rows)
        read = torch.cat([views[f.name].to(torch.float64) for f in self.block.layout.fields])
        log = self.logs[rows]
        log.index_copy_(0, self.counter.clamp(max=log.shape[0] - 1), read.unsqueeze(0))
        self.counter.add_(1)

    def replay(self, rows: int) -> None:
        """Replay the graph of ``rows`` on the current stream (torch launches graphs there)."""
        self.graphs[rows].replay()

    def reads(self, plan: list[tuple[int, np.ndarray[Any, Any]]]) -> list[tuple[int, int, bool]]:
        """Per replay k: (k, the step it read, whether it read exactly step k's padded values)."""
        logs = {rows: log.cpu().numpy() for rows, log in self.logs.items()}
        out = []
        for k, (rows, want) in enumerate(plan):
            got = logs[rows][k]
            out.append((k, int(got[0]) if np.isfinite(got[0]) else -(2**62), bool(np.array_equal(got, want))))
        return out


def values_for(rng: random.Random, step: int, live: int) -> Values:
    return {
        "step": np.full(live, step, dtype=np.int64),
        "positions": np.array([rng.randint(-(2**31), 2**31 - 1) for _ in range(live)], dtype=np.int32),
        "temps": np.array([rng.randint(-4000, 4000) / 8 for _ in range(live)], dtype=np.float32),
        "mask": np.array([rng.random() < 0.5 for _ in range(live)], dtype=np.bool_),
        "small": np.array([rng.randint(-(2**15), 2**15 - 1) for _ in range(live)], dtype=np.int16),
    }


def expected_row(rows: int, values: Values) -> np.ndarray[Any, Any]:
    """What a replay of ``rows`` logs for this step: every field padded to ``rows``, as float64, field after field."""
    parts = []
    for f in FIELDS:
        arr = np.full(rows, f.pad, dtype=NUMPY_DTYPE[f.dtype])
        arr[: len(values[f.name])] = values[f.name]
        parts.append(arr.astype(np.float64))
    return np.concatenate(parts)


@contextmanager
def placed(where: Where) -> Iterator[tuple[torch.device, torch.cuda.Stream, torch.cuda.Stream | None]]:
    """(pool device, replay stream, stage stream or None), with the ``current`` device made current."""
    pool_index, current, mode = where
    device = torch.device("cuda", pool_index)
    replay = torch.cuda.Stream(device=device)
    stage = {"side": torch.cuda.Stream(device=device), "current": None, "reader": replay}[mode]
    with torch.cuda.device(current):
        yield device, replay, stage


def make_block(device: torch.device, num_slots: int, readers: list[torch.cuda.Stream]) -> DeviceBlock:
    pool = PinnedRingBuffer(PoolSettings(device=device, num_slots=num_slots, slot_bytes=1 << 14))
    block = DeviceBlock(pool, LAYOUT)
    for reader in readers:
        block.register_reader(reader)  # before the first step: every copy is ordered with the replays
    with block.stage(MAX_ROWS, MAX_ROWS) as st:  # a first step, so the warm-up runs read defined values
        for name, arr in values_for(random.Random(0), -1, MAX_ROWS).items():
            st.put(name, arr)
    torch.cuda.synchronize(device)
    return block


def run_steps(
    block: DeviceBlock,
    replayer: Replayer,
    rng: random.Random,
    steps: int,
    stage: torch.cuda.Stream | None,
    replay: torch.cuda.Stream,
    lag: Callable[[], int],
    sizes: tuple[int, ...] = SIZES,
) -> list[tuple[int, np.ndarray[Any, Any]]]:
    """Stage ``steps`` steps; after each, queue lag then the replay on ``replay``. Returns (rows, expected) per step."""
    plan = []
    for step in range(steps):
        rows = rng.choice(sizes)
        live = rng.randint(1, rows)  # row 0 is live: it names the step a replay read
        values = values_for(rng, step, live)
        with block.stage(rows, live, stream=stage) as st:
            for name, arr in values.items():
                if rng.random() < 0.5:
                    st.put(name, arr)
                else:
                    st.host(name)[:] = arr
        with torch.cuda.device(replay.device), torch.cuda.stream(replay):  # _sleep takes no stream: make it current
            cycles = lag()
            if cycles:
                torch.cuda._sleep(cycles)
            replayer.replay(rows)
        plan.append((rows, expected_row(rows, values)))
    return plan


@pytest.mark.parametrize("where", WHERE)
def test_every_replay_on_a_lagging_registered_stream_reads_its_own_steps_values(where: Where) -> None:
    """Catches a copy that overwrites the block under a queued replay, or a replay that reads before its copy."""
    rng = random.Random(11)
    with placed(where) as (device, replay, stage):
        block = make_block(device, num_slots=4, readers=[replay])
        replayer = Replayer(block, device, STEPS, SIZES)
        plan = run_steps(
            block, replayer, rng, STEPS, stage, replay, lambda: rng.randint(0, LAG) if rng.random() < 0.7 else 0
        )
        torch.cuda.synchronize(device)
        reads = replayer.reads(plan)
        wrong = [(k, read) for k, read, ok in reads if not ok]
        later = [(k, read) for k, read in wrong if read > k]
        assert wrong == [], f"{len(wrong)} of {STEPS} replays read another step ({len(later)} a later one): {wrong[:5]}"
        stats = block.pool.stats()
        assert stats.copies == STEPS + 1 and stats.stages == STEPS + 1
        # The host got num_slots steps ahead of the replays (the copies wait for them): steps were in flight.
        assert stats.stalls > 0, "the replays never lagged the host, so this run shows nothing about the guard"
        block.pool.close()


@pytest.mark.parametrize("where", STEADY)
def test_a_steady_step_makes_one_host_to_device_copy_and_no_host_sync(where: Where) -> None:
    """Catches a step that copies per field, allocates, or makes the host wait (a sync, a pageable copy)."""
    rng = random.Random(5)
    steps, num_slots = 20, 32
    with placed(where) as (device, replay, stage):
        block = make_block(device, num_slots=num_slots, readers=[replay])
        replayer = Replayer(block, device, num_slots + 2 * steps, (32,))
        # A lap of the ring on the stage's stream: no slot changes stream in the steady steps (no hand-off), and
        # with a synchronize before each run, every slot they reuse has its fence passed (no rule-1 wait).
        run_steps(block, replayer, rng, num_slots, stage, replay, lambda: 0, (32,))
        torch.cuda.synchronize(device)
        before = block.pool.stats()
        with profile(activities=[ProfilerActivity.CPU, ProfilerActivity.CUDA]) as prof:
            run_steps(block, replayer, rng, steps, stage, replay, lambda: 0, (32,))
            torch.cuda.synchronize(device)
        names = [e.name for e in prof.events()]
        assert sum(n.startswith("cudaMemcpyAsync") for n in names) == steps
        # The guard: before each copy the stage's stream waits for the replay stream, after it the reverse.
        assert sum(n.startswith("cudaStreamWaitEvent") for n in names) == 2 * steps
        assert sum(n.startswith("cudaGraphLaunch") for n in names) == steps
        assert not [n for n in names if n.startswith(("cudaMalloc", "cudaHostAlloc", "cudaStreamSynchronize"))]
        assert not [n for n in names if n.startswith("cudaEventSynchronize")]
        mid = block.pool.stats()
        assert (mid.copies - before.copies, mid.bytes_copied - before.bytes_copied) == (
            steps,
            steps * block.layout.nbytes(32),
        )
        previous = torch.cuda.get_sync_debug_mode()
        torch.cuda.set_sync_debug_mode("error")
        try:
            with no_sync():  # also refuses pageable or non-blocking-less copies and explicit fence waits
                run_steps(block, replayer, rng, steps, stage, replay, lambda: 0, (32,))
        finally:
            torch.cuda.set_sync_debug_mode(previous)
        assert torch.cuda.get_sync_debug_mode() == previous
        torch.cuda.synchronize(device)
        after = block.pool.stats()
        assert after.copies - mid.copies == steps
        assert after.stalls == before.stalls == 0


@pytest.mark.parametrize("where", STEADY)
def test_control_without_register_reader_a_lagging_replay_reads_a_later_step(where: Where) -> None:
    """Catches a lag too weak to matter: with the reader unregistered, some replay must read a later step."""
    steps = 40
    for register in (False, True):
        rng = random.Random(3)
        with placed(where) as (device, replay, stage):
            # num_slots > steps: the ring never makes the host wait, so it stages every step ahead of the replays.
            block = make_block(device, num_slots=64, readers=[replay] if register else [])
            replayer = Replayer(block, device, steps, (32,))
            plan = run_steps(block, replayer, rng, steps, stage, replay, lambda: CONTROL_LAG, (32,))
            torch.cuda.synchronize(device)
            reads = replayer.reads(plan)
            later = sum(read > k for k, read, _ in reads)
            wrong = sum(not ok for _, _, ok in reads)
            print(f"{'registered' if register else 'unregistered'}: {wrong} of {steps} replays wrong, {later} later")
            if register:
                assert wrong == 0
            else:
                assert later > 0, "no replay read a later step without the guard: the lag shows nothing"
            assert block.pool.stats().stalls == 0


# Defects found by the simulator tests (tests/unit/test_device_block.py), fixed, shown here on real streams.
# Each is deterministic: a 10 ms sleep holds one copy back.
HOLD_BACK = 20_000_000


def _stage_values(block: DeviceBlock, step: int, stream: torch.cuda.Stream) -> np.ndarray[Any, Any]:
    values = values_for(random.Random(step), step, 8)
    with block.stage(8, 8, stream=stream) as st:
        for name, arr in values.items():
            st.put(name, arr)
    return expected_row(8, values)


def _block_row(block: DeviceBlock) -> np.ndarray[Any, Any]:
    views = block.views(8)
    return torch.cat([views[f.name].to(torch.float64) for f in FIELDS]).cpu().numpy()


def test_a_step_on_a_new_stage_stream_is_not_overwritten_by_the_previous_steps_late_copy() -> None:
    """Catches a block left on an older step when consecutive steps are staged on different streams."""
    pool = PinnedRingBuffer(PoolSettings(device=torch.device("cuda", 0), num_slots=2, slot_bytes=1 << 14))
    block = DeviceBlock(pool, LAYOUT)
    s1, s2 = torch.cuda.Stream(device=0), torch.cuda.Stream(device=0)
    _stage_values(block, 0, s1)  # slot 0 last used on s1, slot 1 on s2: the ring's own hand-off stays out of it
    _stage_values(block, 1, s2)
    torch.cuda.synchronize(0)
    with torch.cuda.stream(s1):
        torch.cuda._sleep(HOLD_BACK)
    _stage_values(block, 2, s1)  # its copy waits behind the sleep
    want = _stage_values(block, 3, s2)  # s2 is idle: this copy lands first
    with torch.cuda.stream(s2):
        read = torch.cat([v.to(torch.float64) for v in block.views(8).values()])  # a reader on the stage's stream
    torch.cuda.synchronize(0)
    assert np.array_equal(read.cpu().numpy(), want)
    assert np.array_equal(_block_row(block), want), "the block ends on step 2: its late copy overwrote step 3"


def test_a_reader_registered_after_a_step_reads_that_step() -> None:
    """Catches a reader registered between steps (at graph capture, say) that replays before the last copy lands."""
    pool = PinnedRingBuffer(PoolSettings(device=torch.device("cuda", 0), num_slots=2, slot_bytes=1 << 14))
    block = DeviceBlock(pool, LAYOUT)
    stage, replay = torch.cuda.Stream(device=0), torch.cuda.Stream(device=0)
    _stage_values(block, 0, stage)
    torch.cuda.synchronize(0)
    with torch.cuda.stream(stage):
        torch.cuda._sleep(HOLD_BACK)
    want = _stage_values(block, 1, stage)  # its copy waits behind the sleep
    block.register_reader(replay)
    with torch.cuda.stream(replay):
        read = torch.cat([v.to(torch.float64) for v in block.views(8).values()])
    torch.cuda.synchronize(0)
    assert np.array_equal(read.cpu().numpy(), want), "the new reader read step 0: it did not wait for step 1's copy"
