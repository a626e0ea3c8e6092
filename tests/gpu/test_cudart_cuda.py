"""The direct CUDA runtime path on the GPU: found, correct both ways, same results as torch's path."""

from __future__ import annotations

import pytest
import torch

from pinpool import HostSyncError, PinnedRingBuffer, PoolSettings, no_sync

DEV = torch.device("cuda", 0)
SLEEP_CYCLES = 20_000_000  # ~10 ms: long enough that a fence recorded after it is still pending


def pool(direct: bool, **kw: int) -> PinnedRingBuffer:
    return PinnedRingBuffer(PoolSettings(device=DEV, cudart_direct=direct, **{"num_slots": 4, **kw}))


def test_the_pool_finds_torchs_runtime_and_uses_it() -> None:
    """Catches a silent fall-back to torch's slower path on the machine it is meant for."""
    assert pool(True)._transport.path == "cudart"
    assert pool(False)._transport.path == "torch"


@pytest.mark.parametrize("direct", [True, False])
def test_upload_and_stage_readback_round_trip(direct: bool) -> None:
    """Catches a wrong pointer, length or direction in a direct copy."""
    p = pool(direct, num_slots=2)
    results = []
    for step in range(12):  # laps the 2-slot ring six times
        torch.cuda._sleep(SLEEP_CYCLES // 20)
        st = p.stage()
        a = st.put([step, step + 1, step + 2], torch.int64)
        b = st.put([0.5 * step] * 999, torch.float32)
        st.flush()
        out = (a * 10).contiguous()
        handle = st.readback(out)
        back = st.readback(b[:5].contiguous())
        st.close()
        results.append((handle.tolist(), back.values().tolist()))
    assert results == [([10 * s, 10 * s + 10, 10 * s + 20], [0.5 * s] * 5) for s in range(12)]


def test_direct_fence_pending_then_passed_and_its_wait_is_refused_inside_no_sync() -> None:
    """Catches a direct fence that reports a queued copy as landed, or waits where waits are forbidden."""
    p = pool(True)
    src = torch.arange(64, device=DEV)
    torch.cuda._sleep(SLEEP_CYCLES)
    handle = p.readback(src)
    assert not handle.ready()
    with no_sync(), pytest.raises(HostSyncError):
        handle.tolist()
    assert handle.tolist() == list(range(64))  # outside no_sync the wait is allowed
    assert handle.ready()
    assert p.stats().readback_waits == 1


def test_side_stream_copies_are_ordered_on_that_stream() -> None:
    """Catches a direct copy issued on the current stream instead of the stage's stream."""
    p = pool(True)
    side = torch.cuda.Stream(DEV)
    target = torch.zeros(4097, dtype=torch.int32, device=DEV)
    with torch.cuda.stream(side):
        torch.cuda._sleep(SLEEP_CYCLES)  # the side stream is busy: a copy ordered on it lands late
    with p.stage(stream=side) as st:
        view = st.put(list(range(4097)), torch.int32)
    with torch.cuda.stream(side):
        target.copy_(view)  # queued on the side stream after the stage's copy
    torch.cuda.synchronize()
    assert target.cpu().tolist() == list(range(4097))


def test_direct_and_torch_paths_give_the_same_engine_tokens(monkeypatch: pytest.MonkeyPatch) -> None:
    """Catches any difference the direct path makes to what a decode loop computes."""
    from engine.bench import _engine, _requests

    streams = []
    for flag in ("1", "0"):
        monkeypatch.setenv("PINPOOL_CUDART_DIRECT", flag)
        engine = _engine("pool", DEV, 32, 0.0, 0.0)
        assert engine.pool._transport.path == ("cudart" if flag == "1" else "torch")
        streams.append(engine.run(_requests(32, 12, seed=3)))
    assert streams[0] == streams[1]
