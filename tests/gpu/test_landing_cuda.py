"""Landings on the GPU: a captured graph stores its output into whichever ring slot each step staged.

The graph reads the step's ``x`` from a ``DeviceBlock``, computes ``3 x + 1`` and lands it
(``pinpool.landing.land``) at the pinned addresses the step's copy carried (a landing field,
``Field.landing``: the stage writes the live rows' addresses when it opens). The
replay runs behind random GPU lag, on the stage's stream or on a registered reader stream;
each handle must read its own step's values. The control plants a close whose fence does
not wait for the replay stream, and must read wrong values under the same lag. A second
part runs the launcher and the stage with another device current.
"""

from __future__ import annotations

import random
from collections import deque

import pytest
import torch

from pinpool import DeviceBlock, Field, Layout, PinnedRingBuffer, PoolSettings
from pinpool.cuda import use_stream
from pinpool.landing import land
from pinpool.readback import Landing
from tests.fakes import NoFenceAfterReaders, landing_stage

ROWS = 16
LAYOUT = Layout([Field("x", torch.int64, pad=-1), Field.landing("dst")], ROWS)
NUM_SLOTS = 3
LAG = 1_000_000  # up to ~0.5 ms of GPU sleep before a replay
TWO_GPUS = torch.cuda.device_count() >= 2


def make_block(device: torch.device, block_type: type[DeviceBlock] = DeviceBlock) -> DeviceBlock:
    pool = PinnedRingBuffer(PoolSettings(device=device, num_slots=NUM_SLOTS, slot_bytes=4096, zero_copy=True))
    assert pool.can_land, pool.platform.reason
    return block_type(pool, LAYOUT)


def capture(block: DeviceBlock, stream: torch.cuda.Stream) -> tuple[torch.cuda.CUDAGraph, torch.Tensor]:
    views = block.views(ROWS)
    out = torch.empty(ROWS, dtype=torch.int64, device=block.device_block.device)

    def body() -> None:
        torch.mul(views["x"], 3, out=out)
        out.add_(1)
        land(out, views["dst"])

    with block.stage(ROWS, 0, stream=stream) as st:
        st.flush()  # every row padding: the warm-up and the capture store nothing
    with torch.cuda.stream(stream):
        body()
    stream.synchronize()
    graph = torch.cuda.CUDAGraph()
    with torch.cuda.graph(graph, stream=stream):
        body()
    return graph, out


def run_steps(writer: str, block_type: type[DeviceBlock] = DeviceBlock, steps: int = 60) -> list[str]:
    """Stage, land, replay behind lag (on ``writer``: "stage" or "reader"), close; read each handle
    up to NUM_SLOTS - 1 claims later. Returns every wrong read."""
    dev = torch.device("cuda", 0)
    rng = random.Random(7)
    block = make_block(dev, block_type)
    stage_stream, replay_stream = torch.cuda.Stream(dev), torch.cuda.Stream(dev)
    if writer == "reader":
        block.register_reader(replay_stream)
    on = replay_stream if writer == "reader" else stage_stream
    graph, _ = capture(block, on)
    wrong: list[str] = []
    waiting: deque[tuple[Landing, list[int], int]] = deque()
    for step in range(steps):
        live = rng.randint(1, ROWS)
        x = [step * 1000 + i for i in range(live)]
        with block.stage(ROWS, live, stream=stage_stream) as st:
            st.put("x", x)
            handle = st.landing("dst")
            st.flush()
            with use_stream(on):
                torch.cuda._sleep(rng.randrange(LAG))
                graph.replay()
        waiting.append((handle, [3 * v + 1 for v in x], step))
        while waiting and (len(waiting) >= NUM_SLOTS - 1 or rng.random() < 0.5):
            got_handle, want, at = waiting.popleft()
            got = got_handle.tolist()
            if got != want:
                wrong.append(f"step {at}: read {got[:3]}, expected {want[:3]}")
    while waiting:
        got_handle, want, at = waiting.popleft()
        if got_handle.tolist() != want:
            wrong.append(f"step {at}")
    torch.cuda.synchronize(dev)
    return wrong


@pytest.mark.parametrize("writer", ["stage", "reader"])
def test_a_captured_graph_lands_each_steps_values_in_its_own_slot_behind_lag(writer: str) -> None:
    """Catches a landing read before its replay ran, a replay that read another step's addresses,
    or a slot reused while its replay was still queued; on the stage's stream and on a reader."""
    wrong = run_steps(writer)
    assert wrong == [], wrong[:3]


def test_control_a_fence_that_does_not_wait_for_the_replay_stream_reads_wrong_values() -> None:
    """Catches a lag test too weak to see the close's reader wait: planted away, it must fail."""
    wrong = run_steps("reader", NoFenceAfterReaders)
    print(f"planted: {len(wrong)} wrong reads of 60")
    assert len(wrong) >= 10, wrong[:3]


@pytest.mark.skipif(not TWO_GPUS, reason="needs two CUDA devices")
@pytest.mark.parametrize(("pool_index", "current_index"), [(0, 1), (1, 0)])
def test_landing_with_another_device_current(pool_index: int, current_index: int) -> None:
    """Catches a landing kernel launched in the current device's context instead of the tensors',
    or a stage, copy or fence of the pool issued on the current device."""
    dev = torch.device("cuda", pool_index)
    block = make_block(dev)
    side = torch.cuda.Stream(dev)
    block.register_reader(side)
    rng = random.Random(3)
    with torch.cuda.device(current_index):
        for step in range(20):
            live = rng.randint(1, ROWS)
            values = torch.arange(ROWS, device=dev) + 100 * step
            with block.stage(ROWS, live, stream=rng.choice([None, side])) as st:
                st.put("x", list(range(live)))
                handle = st.landing("dst")
                st.flush()
                with use_stream(side):
                    torch.cuda._sleep(rng.randrange(LAG))
                    land(values, block.views(ROWS)["dst"])
            assert torch.cuda.current_device() == current_index
            assert handle.tolist() == values[:live].tolist()


def run_stage_landings(register: bool, steps: int = 60) -> list[str]:
    """Plain stages (``Stage.land``, the eager loop's path): the landing kernel on a side stream
    behind lag, registered as a consumer or not. Returns every wrong read."""
    dev = torch.device("cuda", 0)
    rng = random.Random(11)
    pool = PinnedRingBuffer(PoolSettings(device=dev, num_slots=NUM_SLOTS, slot_bytes=4096, zero_copy=True))
    side = torch.cuda.Stream(dev)
    if register:
        pool.register_consumer_stream(side)
    wrong: list[str] = []
    waiting: deque[tuple[Landing, list[int], int]] = deque()
    for step in range(steps):
        n = rng.randint(1, ROWS)
        values = torch.arange(n, device=dev) + 1000 * step
        st, addresses, handle = landing_stage(pool, n)
        with st:
            st.flush()
            side.wait_stream(torch.cuda.current_stream(dev))  # the addresses' copy first
            with use_stream(side):
                torch.cuda._sleep(rng.randrange(LAG))
                land(values, addresses)
        waiting.append((handle, values.tolist(), step))
        while waiting and (len(waiting) >= NUM_SLOTS - 1 or rng.random() < 0.5):
            got_handle, want, at = waiting.popleft()
            if got_handle.tolist() != want:
                wrong.append(f"step {at}")
    torch.cuda.synchronize(dev)
    return wrong


def test_plain_stage_landings_on_a_registered_consumer_read_their_own_values() -> None:
    """Catches a plain stage's fence that does not follow a landing kernel on a registered consumer stream."""
    wrong = run_stage_landings(register=True)
    assert wrong == [], wrong[:3]


def test_control_plain_stage_landings_on_an_unregistered_stream_read_wrong_values() -> None:
    """The same steps with the side stream unregistered: the fence does not cover it, and it must show."""
    wrong = run_stage_landings(register=False)
    print(f"unregistered: {len(wrong)} wrong reads of 60")
    assert len(wrong) >= 10, wrong[:3]


@pytest.mark.parametrize("current_index", [0, 1] if TWO_GPUS else [0])
def test_an_aborted_stage_waits_for_the_writer_it_handed_its_landing_to(current_index: int) -> None:
    """Catches an aborted stage that copied nothing handing its slot straight to the next stage while
    the landing kernel it launched (on a registered consumer, behind lag) has yet to store: that
    kernel then overwrites the next stage's landing at the same bytes. Also with another device current."""
    dev = torch.device("cuda", 0)
    pool = PinnedRingBuffer(PoolSettings(device=dev, num_slots=2, slot_bytes=4096, zero_copy=True))
    side = torch.cuda.Stream(dev)
    pool.register_consumer_stream(side)
    n = 8
    with torch.cuda.device(current_index):
        st, addresses, _ = landing_stage(pool, n)
        st.flush()
        side.wait_stream(torch.cuda.current_stream(dev))  # the addresses' copy first
        with use_stream(side):
            torch.cuda._sleep(50_000_000)  # ~25 ms: still asleep when the next stage lands
            land(torch.full((n,), -7, dtype=torch.int64, device=dev), addresses)
        st.close(ok=False)  # an error after the writer was launched
        nxt, next_addresses, handle = landing_stage(pool, n)
        with nxt:
            nxt.flush()
            land(torch.arange(n, device=dev), next_addresses)  # on the stage's stream, at once
        assert handle.tolist() == list(range(n))
        assert torch.cuda.current_device() == current_index
    torch.cuda.synchronize(dev)
