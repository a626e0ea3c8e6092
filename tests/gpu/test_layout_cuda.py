"""A ``Layout`` staged in the ring on real CUDA streams and devices: the decode step's one copy.

``pool.stage(layout, rows=n)`` is a stage (same slot rules) whose fields sit at the layout's
plan offsets and whose landing field carries the addresses the sampler stores into. These
tests lag one stream with ``torch.cuda._sleep`` so that "the other stream is probably done"
is false when it matters, and stage with another device current.

Ported from ``test_exchange_cuda.py`` (``pool.exchange`` is gone; its per-slot replay plans
with it, so "every slot replays its plan" is now simply every slot reused several times).
"""

from __future__ import annotations

import pytest
import torch

from pinpool import Field, Layout, PinnedRingBuffer, PoolSettings
from pinpool.landing import land

LAG = 20_000_000  # about 10 ms of GPU sleep: far longer than the host takes to lap the ring
TWO_GPUS = torch.cuda.device_count() >= 2
N = 2048
STEP = Layout([Field("rows", torch.int64), Field("positions", torch.int32), Field.landing("tokens")], N)
ROWS_ONLY = Layout([Field("rows", torch.int64)], N)


def _pool(index: int, num_slots: int = 3) -> PinnedRingBuffer:
    return PinnedRingBuffer(PoolSettings(device=torch.device("cuda", index), num_slots=num_slots, zero_copy=True))


@pytest.mark.parametrize(("pool_index", "current_index"), [(0, 0), (0, 1), (1, 0)] if TWO_GPUS else [(0, 0)], ids=str)
@pytest.mark.parametrize("on", ["current stream", "side stream"])
def test_every_step_reads_its_own_values_behind_lag_and_lands_its_own_tokens(
    pool_index: int, current_index: int, on: str
) -> None:
    """Catches a field written at the wrong offset, a copy on the wrong stream or device, a slot
    reused under a lagging reader, or a landing read before its writer ran or after its slot was reused."""
    dev = torch.device("cuda", pool_index)
    pool = _pool(pool_index)
    side = torch.cuda.Stream(dev)
    steps = 4 * 3  # every slot reused several times
    clones: list[tuple[torch.Tensor, torch.Tensor]] = []
    handles = []
    with torch.cuda.device(current_index):
        for step in range(steps):
            rows = [step * 10_000 + i for i in range(N)]
            positions = [-(step * 10_000 + i) for i in range(N)]
            stream = side if on == "side stream" else None
            st = pool.stage(STEP, rows=N, stream=stream)
            st.put("rows", rows)
            st.put("positions", positions)
            st.flush()
            assert st.stream == (side if on == "side stream" else torch.cuda.current_stream(dev))
            with torch.cuda.stream(st.stream):
                torch.cuda._sleep(LAG // 8)  # the step's stream lags behind the host
                rows_d, positions_d = st.views["rows"], st.views["positions"]
                assert rows_d.device == dev and positions_d.device == dev
                clones.append((rows_d.clone(), positions_d.clone()))
                land(rows_d + 1, st.views["tokens"])  # the "sampler": stores into the slot
            st.close()  # the slot's fence, on the stage's stream, after the writer
            handles.append((st.landing("tokens"), [r + 1 for r in rows]))
            if len(handles) == pool.settings.num_slots - 1:  # read within num_slots - 1 claims
                handle, want = handles.pop(0)
                assert handle.tolist() == want
        assert torch.cuda.current_device() == current_index
    for handle, want in handles:
        assert handle.tolist() == want
    torch.cuda.synchronize(dev)
    for step, (rows_d, positions_d) in enumerate(clones):
        assert rows_d[:3].tolist() == [step * 10_000 + i for i in range(3)]
        assert torch.equal(rows_d.cpu(), torch.arange(N, dtype=torch.int64) + step * 10_000)
        assert torch.equal(positions_d.cpu(), -(torch.arange(N, dtype=torch.int32) + step * 10_000))
    assert pool.stats().copies == steps


def test_padding_rows_land_their_pads_on_the_device_behind_lag() -> None:
    """Catches padding written after the copy was queued (the device reading the previous step's rows
    there) or not at all, with the ring reused under a lagging stream."""
    layout = Layout([Field("rows", torch.int64, pad=-1), Field("temp", torch.float32, pad=1.0)], N)
    pool = _pool(0)
    clones = []
    for step in range(9):
        live = N if step < 3 else N // 2 + step  # every slot full of values first
        with pool.stage(layout, rows=N, live=live) as st:
            st.put("rows", [step] * live)
            st.put("temp", [0.5] * live)
            st.flush()
            torch.cuda._sleep(LAG // 8)
            clones.append((st.views["rows"].clone(), st.views["temp"].clone(), live))
    torch.cuda.synchronize(0)
    for step, (rows_d, temp_d, live) in enumerate(clones):
        assert rows_d[:live].eq(step).all() and rows_d[live:].eq(-1).all(), f"step {step}"
        assert temp_d[:live].eq(0.5).all() and temp_d[live:].eq(1.0).all(), f"step {step}"


def test_the_stage_on_an_idle_side_stream_does_not_wait_for_the_busy_current_one() -> None:
    """Catches the layout's copy queued on the current stream instead of its own: a read on the
    side stream right after it would see the slot's old bytes."""
    pool = _pool(0, num_slots=2)
    side = torch.cuda.Stream(0)
    got = torch.empty(N, dtype=torch.int64, device="cuda:0")
    for _ in range(2):  # both slots used on ``side`` once
        with pool.stage(ROWS_ONLY, rows=N, stream=side) as st:
            st.put("rows", [0] * N)
    torch.cuda.synchronize(0)
    torch.cuda._sleep(LAG)  # the current stream is busy
    with pool.stage(ROWS_ONLY, rows=N, stream=side) as st, torch.cuda.stream(side):
        st.put("rows", list(range(N)))
        st.flush()
        got.copy_(st.views["rows"])
    values = pool.readback(got, stream=side).tolist()
    still_busy = not torch.cuda.current_stream(0).query()
    torch.cuda.synchronize(0)
    assert values == list(range(N))
    assert still_busy, "the current stream finished first, so this run shows nothing about stream choice"


def test_a_stream_change_between_stages_waits_on_the_device_for_the_old_streams_reader() -> None:
    """Catches case 2 for layouts: a view read on the old stream behind lag, its slot rewritten by
    a stage on another stream."""
    pool = _pool(0, num_slots=2)
    s1, s2 = torch.cuda.Stream(0), torch.cuda.Stream(0)
    st = pool.stage(ROWS_ONLY, rows=N, stream=s1)
    st.put("rows", [1] * N)
    st.close()  # the copy, then the slot's fence right after it
    s1.synchronize()  # copy and fence done, so the host reuses the slot without a wait; the reader below is not
    with torch.cuda.stream(s1):
        torch.cuda._sleep(LAG)
        late = st.views["rows"].clone()  # queued behind the lag, within the view's lifetime
    for _ in range(2):  # the second reuses the slot of ``late``'s view
        with pool.stage(ROWS_ONLY, rows=N, stream=s2) as nxt:
            nxt.put("rows", [9] * N)
    torch.cuda.synchronize(0)
    assert torch.equal(late.cpu(), torch.ones(N, dtype=torch.int64))
    assert pool.stats().stalls == 0  # the wait was on the device
