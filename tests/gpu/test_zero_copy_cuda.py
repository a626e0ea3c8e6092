"""Zero-copy stages on real CUDA: kernels read the pinned slot in place, and are never overtaken.

The GPU is made to lag with ``torch.cuda._sleep`` so that many steps are in flight and the
host laps the ring long before the readers run. Readers are real kernels queued inside
the stage: an elementwise add (a kernel loading the host bytes over PCIe) or a clone (the
copy engine reading them); their outputs are compared only after a final sync.

Every test runs four ways: the pool on cuda:0, with the stage on the current stream or on
a side stream; and the pool on cuda:1 while cuda:0 is current (skipped with one GPU).
The control is vLLM's shape: a guard-free ring of depth 2 of pinned buffers with UVA
views (``UvaBufferPool``), which must show wrong values under the same lag.
"""

from __future__ import annotations

import random
from collections.abc import Iterator
from contextlib import contextmanager

import pytest
import torch
from torch.profiler import ProfilerActivity, profile

from pinpool import Field, Layout, PinnedRingBuffer, PoolSettings
from pinpool.cuda import CudaTransport
from pinpool.exceptions import PlatformError, UnguardedReaderError
from pinpool.platform import device_alias
from pinpool.stage import Placement

LAG = 2_000_000  # about 1 ms of GPU sleep per lagging step: the host runs far ahead
STEPS = 200
N = 999

needs_two = pytest.mark.skipif(torch.cuda.device_count() < 2, reason="needs two CUDA devices")
Where = tuple[int, int, bool]  # (pool's device, current device, stage on a side stream)
WHERE = [
    pytest.param((0, 0, False), id="cuda0"),
    pytest.param((0, 0, True), id="cuda0-side-stream"),
    pytest.param((1, 0, False), id="cuda1-while-cuda0-current", marks=needs_two),
    pytest.param((1, 0, True), id="cuda1-side-stream-while-cuda0-current", marks=needs_two),
]


@contextmanager
def placed(where: Where) -> Iterator[tuple[torch.device, torch.cuda.Stream | None]]:
    """The pool's device and stage stream (None: that device's current one), with ``current`` made current."""
    pool_index, current, side = where
    with torch.cuda.device(current):
        yield torch.device("cuda", pool_index), torch.cuda.Stream(device=pool_index) if side else None


def _pool(device: torch.device, num_slots: int = 3, **kw: bool) -> PinnedRingBuffer:
    return PinnedRingBuffer(PoolSettings(device=device, num_slots=num_slots, zero_copy=True, **kw))


def _read(view: torch.Tensor, rng: random.Random) -> torch.Tensor:
    """A reader kernel: an elementwise add (SM loads over PCIe) or a clone (the copy engine)."""
    return view + 0 if rng.random() < 0.5 else view.clone()


@pytest.mark.parametrize("where", WHERE)
def test_platform_check_passes_and_views_alias_the_pinned_slot(where: Where) -> None:
    """Catches a check that refuses a sound platform, or views that are copies instead of UVA aliases."""
    with placed(where) as (device, stream):
        pool = _pool(device)
        report = pool.platform
        assert report.zero_copy_ok, report.reason
        assert (report.pinned, report.alias_is_host_address, report.kernel_sees_host_writes) == (True, True, True)
        assert pool.stats().platform == report
        with pool.stage(zero_copy=True, stream=stream) as st:
            assert st.placement is Placement.IN_PLACE
            view = st.put(list(range(N)), torch.int64)
            with torch.cuda.stream(st.stream):
                got = view + 0
        assert not st.is_live  # closed: a reader queued now would not be covered by the fence
        base = pool.host_slab.data_ptr()
        assert view.device == device and base <= view.data_ptr() < base + pool.settings.total_bytes
        torch.cuda.synchronize(device)
        assert got.cpu().tolist() == list(range(N))
        print(f"platform on {device}: {report}")  # the record: what the check found, step by step


@pytest.mark.parametrize("where", WHERE)
def test_zero_copy_stages_under_random_lag_give_no_wrong_values(where: Where) -> None:
    """Catches a zero-copy slot rewritten by the host while kernels that read it are still queued."""
    rng = random.Random(15)
    with placed(where) as (device, stream):
        pool = _pool(device)
        seen: list[tuple[torch.Tensor, int]] = []
        for step in range(STEPS):
            with pool.stage(zero_copy=True, stream=stream) as st:
                view = st.put([step] * N, torch.int64)
                with torch.cuda.stream(st.stream):
                    if rng.random() < 0.5:
                        torch.cuda._sleep(rng.randint(0, LAG))
                    seen.extend((_read(view, rng), step) for _ in range(rng.randint(1, 3)))
        torch.cuda.synchronize(device)
        wrong = sum(not bool((got == want).all()) for got, want in seen)
        assert wrong == 0, f"{wrong} of {len(seen)} reads saw another step's values"
        stats = pool.stats()
        assert (stats.copies, stats.zero_copy_stages) == (0, STEPS)


@pytest.mark.parametrize("where", WHERE)
def test_control_a_guard_free_ring_of_depth_2_reads_overwritten_values(where: Where) -> None:
    """Catches a lag test too weak to matter: vLLM's depth-2 UVA ring without guards must go wrong here."""
    rng = random.Random(15)
    with placed(where) as (device, stream):
        with torch.cuda.device(device):
            hosts = [torch.empty(N, dtype=torch.int64, pin_memory=True) for _ in range(2)]
        uvas = [device_alias(h.view(torch.uint8), device).view(torch.int64) for h in hosts]
        run_on = stream if stream is not None else torch.cuda.current_stream(device)
        seen: list[tuple[torch.Tensor, int]] = []
        for step in range(STEPS):
            hosts[step % 2].numpy()[:] = step  # UvaBufferPool.copy_to_uva: round robin, no wait
            with torch.cuda.stream(run_on):
                if rng.random() < 0.5:
                    torch.cuda._sleep(rng.randint(0, LAG))
                seen.extend((_read(uvas[step % 2], rng), step) for _ in range(rng.randint(1, 3)))
        torch.cuda.synchronize(device)
        wrong = sum(not bool((got == want).all()) for got, want in seen)
        print(f"guard-free depth-2 ring: {wrong} of {len(seen)} reads wrong")
        assert wrong > 0


@pytest.mark.parametrize("where", WHERE)
def test_readers_on_a_lagging_registered_consumer_stream_are_covered(where: Where) -> None:
    """Catches a zero-copy fence that covers the stage's stream but not a registered consumer's readers."""
    rng = random.Random(7)
    with placed(where) as (device, stream):
        pool = _pool(device)
        consumer = torch.cuda.Stream(device=device)
        pool.register_consumer_stream(consumer)
        seen: list[tuple[torch.Tensor, int]] = []
        for step in range(STEPS // 2):
            with pool.stage(zero_copy=True, stream=stream) as st:
                view = st.put([step] * N, torch.int64)
                with torch.cuda.stream(consumer):
                    torch.cuda._sleep(rng.randint(0, LAG))  # the consumer lags; the stage's stream is idle
                    seen.append((_read(view, rng), step))
        torch.cuda.synchronize(device)
        assert sum(not bool((got == want).all()) for got, want in seen) == 0


@pytest.mark.parametrize("where", WHERE)
def test_the_check_refuses_memory_that_is_not_pinned_and_copy_stages_still_work(where: Where) -> None:
    """Catches zero-copy views handed out over pageable memory (garbage reads), or copy stages broken by it."""

    class PageableTransport(CudaTransport):
        def alloc_host(self, nbytes: int) -> torch.Tensor:
            return torch.empty(nbytes, dtype=torch.uint8)  # what pin_memory=True gives on some CC hosts

    with placed(where) as (device, stream):
        settings = PoolSettings(device=device, num_slots=3, zero_copy=True)
        pool = PinnedRingBuffer(settings, transport=PageableTransport(device))
        assert not pool.platform.zero_copy_ok and pool.platform.pinned is False
        with pytest.raises(PlatformError, match="not page-locked"):
            pool.stage(zero_copy=True, stream=stream)
        with pool.stage(stream=stream) as st:
            view = st.put(list(range(N)), torch.int32)
        with torch.cuda.stream(st.stream):
            got = view.clone()
        torch.cuda.synchronize(device)
        assert got.cpu().tolist() == list(range(N))


@pytest.mark.parametrize("where", WHERE)
def test_a_zero_copy_stage_makes_no_copy_call(where: Where) -> None:
    """Catches a copy issued by a zero-copy stage (then it is neither zero-copy nor cheaper)."""
    with placed(where) as (device, stream):
        pool = _pool(device, num_slots=4)
        with profile(activities=[ProfilerActivity.CPU, ProfilerActivity.CUDA]) as prof:
            for _ in range(20):
                with pool.stage(zero_copy=True, stream=stream) as st:
                    st.put([1] * 64, torch.int32)
        names = [e.name for e in prof.events()]
        assert not any(n.startswith("cudaMemcpy") or n == "aten::copy_" for n in names)
        assert pool.stats().copies == 0


@pytest.mark.parametrize("where", WHERE)
def test_debug_refuses_closing_under_an_unregistered_stream(where: Where) -> None:
    """Catches readers launched on an unregistered side stream going unflagged in debug mode."""
    with placed(where) as (device, stream):
        pool = _pool(device, debug=True)
        side = torch.cuda.Stream(device=device)
        st = pool.stage(zero_copy=True, stream=stream)
        view = st.put([3] * N, torch.int32)
        with torch.cuda.stream(side):
            got = view + 0
            with pytest.raises(UnguardedReaderError, match="nor a registered consumer"):
                st.close()  # the fence is recorded first (after the stage's stream), then the check refuses
        torch.cuda.synchronize(device)
        assert bool((got == 3).all())


@pytest.mark.parametrize("where", WHERE)
def test_a_layout_staged_in_place_under_lag_reads_each_steps_rows_and_pads(where: Where) -> None:
    """Catches an in-place layout (``pool.stage(layout, rows=..., zero_copy=True)``) whose padding rows
    keep an earlier step's values, whose views are not the pinned slot, or whose slot the host rewrites
    while a lagging reader has yet to run."""
    rng = random.Random(5)
    layout = Layout([Field("ids", torch.int64, pad=-1)], N)
    with placed(where) as (device, stream):
        pool = _pool(device)
        seen: list[tuple[torch.Tensor, int, int]] = []
        for step in range(STEPS // 4):
            live = N if step < pool.settings.num_slots else rng.randint(0, N)  # every slot full of values first
            with pool.stage(layout, rows=N, live=live, zero_copy=True, stream=stream) as st:
                assert st.placement is Placement.IN_PLACE
                st.put("ids", [step] * live)
                st.flush()  # padding written in the pinned slot: readers launched from here read it all
                view = st.views["ids"]
                base = pool.host_slab.data_ptr()
                assert view.device == device and base <= view.data_ptr() < base + pool.settings.total_bytes
                with torch.cuda.stream(st.stream):
                    if rng.random() < 0.5:
                        torch.cuda._sleep(rng.randint(0, LAG))
                    seen.append((_read(view, rng), step, live))
        torch.cuda.synchronize(device)
        wrong = [
            step for got, step, live in seen if not (bool(got[:live].eq(step).all()) and bool(got[live:].eq(-1).all()))
        ]
        assert wrong == [], f"steps {wrong[:5]} read another step's rows or padding"
        assert pool.stats().copies == 0
