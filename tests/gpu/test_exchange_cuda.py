"""``pool.exchange`` on real CUDA streams and devices: the decode step's one-call exchange.

The exchange is a stage (same slot rules) whose copy is issued before it returns, and whose
later laps replay a per-slot plan. These tests lag one stream with ``torch.cuda._sleep`` so
that "the other stream is probably done" is false when it matters, and stage with another
device current.
"""

from __future__ import annotations

import pytest
import torch

from pinpool import PinnedRingBuffer, PoolSettings
from pinpool.landing import land

LAG = 20_000_000  # about 10 ms of GPU sleep: far longer than the host takes to lap the ring
TWO_GPUS = torch.cuda.device_count() >= 2
N = 2048


def _pool(index: int, num_slots: int = 3) -> PinnedRingBuffer:
    return PinnedRingBuffer(PoolSettings(device=torch.device("cuda", index), num_slots=num_slots, zero_copy=True))


@pytest.mark.parametrize(("pool_index", "current_index"), [(0, 0), (0, 1), (1, 0)] if TWO_GPUS else [(0, 0)], ids=str)
@pytest.mark.parametrize("on", ["current stream", "side stream"])
def test_every_lap_reads_its_own_values_behind_lag_and_lands_its_own_tokens(
    pool_index: int, current_index: int, on: str
) -> None:
    """Catches a replayed plan writing the wrong bytes, a copy on the wrong stream or device, a slot
    reused under a lagging reader, or a landing read before its writer ran or after its slot was reused."""
    dev = torch.device("cuda", pool_index)
    pool = _pool(pool_index)
    side = torch.cuda.Stream(dev)
    laps = 4 * 3  # every slot replays its plan several times
    clones: list[tuple[torch.Tensor, torch.Tensor]] = []
    handles = []
    with torch.cuda.device(current_index):
        for step in range(laps):
            rows = [step * 10_000 + i for i in range(N)]
            positions = [-(step * 10_000 + i) for i in range(N)]
            stream = side if on == "side stream" else None
            ex = pool.exchange([(rows, torch.int64), (positions, torch.int32)], land=N, stream=stream)
            assert ex.land_to is not None and ex.landing is not None
            assert ex.stream == (side if on == "side stream" else torch.cuda.current_stream(dev))
            with torch.cuda.stream(ex.stream):
                torch.cuda._sleep(LAG // 8)  # the step's stream lags behind the host
                rows_d, positions_d = ex.views
                clones.append((rows_d.clone(), positions_d.clone()))
                land(rows_d + 1, ex.land_to)  # the "sampler": stores into the slot
            ex.close()  # the slot's fence, on the exchange's stream, after the writer
            handles.append((ex.landing, [r + 1 for r in rows]))
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
    assert pool.stats().copies == laps


def test_the_exchange_on_an_idle_side_stream_does_not_wait_for_the_busy_current_one() -> None:
    """Catches the exchange's copy queued on the current stream instead of its own: a read on the
    side stream right after it would see the slot's old bytes."""
    pool = _pool(0, num_slots=2)
    side = torch.cuda.Stream(0)
    got = torch.empty(N, dtype=torch.int64, device="cuda:0")
    for _ in range(2):  # both slots used on ``side`` once, and their plans built
        with pool.exchange([([0] * N, torch.int64)], stream=side):
            pass
    torch.cuda.synchronize(0)
    torch.cuda._sleep(LAG)  # the current stream is busy
    with pool.exchange([(list(range(N)), torch.int64)], stream=side) as ex, torch.cuda.stream(side):
        got.copy_(ex.views[0])
    values = pool.readback(got, stream=side).tolist()
    still_busy = not torch.cuda.current_stream(0).query()
    torch.cuda.synchronize(0)
    assert values == list(range(N))
    assert still_busy, "the current stream finished first, so this run shows nothing about stream choice"


def test_a_stream_change_between_exchanges_waits_on_the_device_for_the_old_streams_reader() -> None:
    """Catches case 2 for exchanges: a view read on the old stream behind lag, its slot rewritten by
    an exchange on another stream."""
    pool = _pool(0, num_slots=2)
    s1, s2 = torch.cuda.Stream(0), torch.cuda.Stream(0)
    ex = pool.exchange([([1] * N, torch.int64)], stream=s1)
    ex.close()  # the slot's fence right after the copy
    s1.synchronize()  # copy and fence done, so the host reuses the slot without a wait; the reader below is not
    with torch.cuda.stream(s1):
        torch.cuda._sleep(LAG)
        late = ex.views[0].clone()  # queued behind the lag, within the view's lifetime
    for _ in range(2):  # the second reuses the slot of ``late``'s view
        with pool.exchange([([9] * N, torch.int64)], stream=s2):
            pass
    torch.cuda.synchronize(0)
    assert torch.equal(late.cpu(), torch.ones(N, dtype=torch.int64))
    assert pool.stats().stalls == 0  # the wait was on the device
