"""The stream and device rules on real CUDA streams and devices.

Cases 1-3 are the three silent failures found on main at 8ab6ab0 (issue 11); each test
here failed there. The GPU is made to lag with ``torch.cuda._sleep`` on one stream so
that "the other stream is probably done" is false when it matters.
"""

from __future__ import annotations

import pytest
import torch
from torch.profiler import ProfilerActivity, profile

from pinpool import PinnedRingBuffer, PoolSettings

LAG = 20_000_000  # about 10 ms of GPU sleep: far longer than the host takes to lap the ring
N = 4097


def _pool(device: int | str = 0, num_slots: int = 2) -> PinnedRingBuffer:
    return PinnedRingBuffer(PoolSettings(device=torch.device("cuda", int(device)), num_slots=num_slots))


def test_case1_a_stage_closed_under_another_stream_fences_its_own_stream() -> None:
    """Catches case 1: the fence recorded on the stream current at close, so the slot is reused under a pending copy."""
    pool = _pool()
    s1, s2 = torch.cuda.Stream(), torch.cuda.Stream()
    with torch.cuda.stream(s1):
        torch.cuda._sleep(LAG)  # s1 lags: the stage's copy waits behind this
        st = pool.stage()
        view = st.put([1] * N, torch.int32)
        st.flush()
        landed = view.clone()  # on s1, right after the copy
    with torch.cuda.stream(s2):
        st.close()  # s2 is idle: a fence recorded here would pass at once
        for _ in range(3):
            with pool.stage() as later:
                later.put([9] * N, torch.int32)
    torch.cuda.synchronize()
    assert torch.equal(landed.cpu(), torch.ones(N, dtype=torch.int32))


@pytest.mark.parametrize("num_slots", [2, 3])
def test_case2_a_reader_on_the_previous_staging_stream_is_waited_for(num_slots: int) -> None:
    """Catches case 2: a slice read on its staging stream behind lag, overwritten by stages on another stream."""
    pool = _pool(num_slots=num_slots)
    s1, s2 = torch.cuda.Stream(), torch.cuda.Stream()
    with torch.cuda.stream(s1):
        with pool.stage() as st:
            view = st.put([1] * N, torch.int32)
        torch.cuda._sleep(LAG)
        late = view.clone()  # queued on s1 behind the lag, before any further stage
    with torch.cuda.stream(s2):
        for _ in range(num_slots):  # the last of these reuses the slot of ``view``
            with pool.stage() as st:
                st.put([9] * N, torch.int32)
    torch.cuda.synchronize()
    assert torch.equal(late.cpu(), torch.ones(N, dtype=torch.int32))
    assert pool.stats().stalls == 0  # the wait was on the device, not the host


def test_inverted_order_the_stage_on_an_idle_side_stream_does_not_wait_for_the_busy_current_one() -> None:
    """Catches a copy queued on the current stream instead of the stage's: a read on the side stream sees garbage."""
    pool = _pool()
    side = torch.cuda.Stream()
    got = torch.empty(N, dtype=torch.int32, device="cuda:0")  # allocated now: a cudaMalloc later would sync
    for _ in range(2):  # both slots used on ``side`` once: the mirror's allocation stream is no longer their last
        with pool.stage(stream=side) as st:
            st.put([0], torch.int32)
    torch.cuda.synchronize()
    torch.cuda._sleep(LAG)  # the current stream is busy
    with pool.stage(stream=side) as st:
        view = st.put(list(range(N)), torch.int32)
    with torch.cuda.stream(side):
        got.copy_(view)
    values = pool.readback(got, stream=side).tolist()  # read-backs too: fenced on the side stream
    still_busy = not torch.cuda.current_stream().query()
    torch.cuda.synchronize()
    assert values == list(range(N))
    assert still_busy, "the current stream finished first, so this run shows nothing about stream choice"


def test_an_owned_stage_on_a_side_stream_takes_no_block_still_read_on_the_current_stream() -> None:
    """Catches an owned buffer allocated from the current stream's pool but written on the stage's stream."""
    pool = _pool()
    side = torch.cuda.Stream()
    wrong = 0
    for _ in range(12):
        a = torch.full((N,), 5, dtype=torch.int32, device="cuda:0")
        torch.cuda._sleep(LAG // 4)
        b = a.to(torch.int16)  # reads ``a`` behind the lag
        del a  # its block goes back to the current stream's pool with that read still queued
        with pool.stage(owned=N * 4, stream=side) as st:
            st.put([9] * N, torch.int32)
        torch.cuda.synchronize()
        wrong += int(not bool((b == 5).all()))
    assert wrong == 0


def test_close_waits_for_a_reader_queued_on_the_stages_stream_after_its_fence() -> None:
    """Catches teardown that frees the mirror while a kernel on the stage's stream still reads it."""
    wrong = 0
    for _ in range(4):
        pool = _pool()
        side = torch.cuda.Stream()
        with pool.stage(stream=side) as st:
            view = st.put([7] * N, torch.int32)
        out = torch.empty(N, dtype=torch.int32, device="cuda:0")
        with torch.cuda.stream(side):
            torch.cuda._sleep(LAG // 2)
            out.copy_(view)  # queued after the slot's fence
        pool.close()
        del pool, view, st
        torch.full((2 * N,), -1, dtype=torch.int32, device="cuda:0")  # may reuse the freed mirror at once
        torch.cuda.synchronize()
        wrong += int(not bool((out == 7).all()))
    assert wrong == 0


def _api_calls(fn: object) -> dict[str, int]:
    with profile(activities=[ProfilerActivity.CPU, ProfilerActivity.CUDA]) as prof:
        fn()  # type: ignore[operator]
        torch.cuda.synchronize()
    counts: dict[str, int] = {}
    for event in prof.events():
        for call in ("cudaMemcpyAsync", "cudaEventRecord", "cudaStreamWaitEvent", "cudaEventQuery"):
            if event.name.startswith(call):
                counts[call] = counts.get(call, 0) + 1
    return counts


def test_an_unchanged_stream_costs_no_extra_call_and_a_change_costs_one_wait() -> None:
    """Catches a cross-stream guard that adds CUDA calls when the stream did not change."""
    pool = _pool(num_slots=4)
    s1, s2 = torch.cuda.Stream(), torch.cuda.Stream()
    for _ in range(8):
        with pool.stage(stream=s1) as st:
            st.put([1] * 64, torch.int32)

    def same() -> None:
        for _ in range(20):
            with pool.stage(stream=s1) as st:
                st.put([1] * 64, torch.int32)

    def alternating() -> None:
        for i in range(20):  # a lap of the 4 slots on one stream, the next lap on the other
            with pool.stage(stream=s1 if (i // 4) % 2 else s2) as st:
                st.put([1] * 64, torch.int32)

    steady = _api_calls(same)
    assert steady.get("cudaMemcpyAsync") == 20
    assert steady.get("cudaStreamWaitEvent", 0) == 0
    changing = _api_calls(alternating)
    assert changing.get("cudaMemcpyAsync") == 20
    assert changing.get("cudaStreamWaitEvent", 0) == 20  # every claim changed stream: one hand-off each
    assert changing["cudaEventRecord"] == steady["cudaEventRecord"] + 20


needs_two = pytest.mark.skipif(torch.cuda.device_count() < 2, reason="needs two CUDA devices")


@needs_two
def test_case3_two_pools_on_two_devices_each_used_while_the_other_is_current() -> None:
    """Catches case 3: a pool on cuda:1 used under cuda:0 fails, or queues its copy on cuda:0's stream."""
    pools = [_pool(0, num_slots=3), _pool(1, num_slots=3)]
    sides = [torch.cuda.Stream(device=i) for i in (0, 1)]
    seen: list[tuple[torch.Tensor, int]] = []
    for step in range(60):
        for i in (0, 1):
            other = 1 - i
            with torch.cuda.device(other):
                if step % 7 == 0:
                    with torch.cuda.device(i):
                        torch.cuda._sleep(LAG // 10)  # lag pool i's device
                stream = sides[i] if step % 3 == 0 else None
                with pools[i].stage(stream=stream) as st:
                    view = st.put([step * 10 + i] * 999, torch.int64)
                with torch.cuda.stream(st.stream):
                    seen.append((view.clone(), step * 10 + i))
                handle = pools[i].readback(view, stream=stream)  # None: pool i's device's current stream
                assert handle.tolist() == [step * 10 + i] * 999
                assert torch.cuda.current_device() == other
    for i in (0, 1):
        torch.cuda.synchronize(i)
    for got, want in seen:
        assert bool((got == want).all())
    assert [p.stats().copies for p in pools] == [60, 60]


@needs_two
def test_a_stream_of_the_other_device_is_refused() -> None:
    """Catches a stage queued on another device's stream (CUDA's invalid resource handle, or a silent wrong device)."""
    from pinpool import DeviceMismatchError

    pool = _pool(1)
    with pytest.raises(DeviceMismatchError, match="'stream' must be on the pool's device cuda:1"):
        pool.stage(stream=torch.cuda.Stream(device=0))
    assert pool.claims == 0


def test_a_fence_seen_passed_skips_its_query_until_it_is_recorded_again() -> None:
    """Catches the passed-fence memo outliving a new record (a slot reused while its copy is still
    queued) and a memo that does not save the query it exists for."""
    pool = _pool()
    fence = pool.transport.new_fence()
    side = torch.cuda.Stream()
    for _ in range(2):
        with torch.cuda.stream(side):
            torch.cuda._sleep(LAG)
        fence.record(side)
        assert not fence.query()  # recorded behind 10 ms of sleep: pending, memo or not
        side.synchronize()
        assert fence.query()
        calls = _api_calls(lambda: [fence.query() for _ in range(10)])
        assert calls.get("cudaEventQuery", 0) == 0
    # Control: the profiler sees the queries of a plain event, so the 0 above is a saving.
    plain = torch.cuda.Event()
    plain.record(side)
    side.synchronize()
    assert _api_calls(lambda: [plain.query() for _ in range(10)]).get("cudaEventQuery", 0) == 10
