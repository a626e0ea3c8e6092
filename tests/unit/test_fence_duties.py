"""A slot's fence duties when a stage copies nothing, and stale copy targets, in the stream-aware simulator.

Found by a cold review (2026-11-30). Each test fails on the code before the fix:
- a stage, closed or aborted, whose landing bytes a writer on a consumer stream was already handed;
- a stage that retained a tensor for a kernel but put nothing;
- land() with no flush(): the copy at close would carry live addresses past the fence;
- an ``owned`` buffer staged again after its memory was swapped (``.data =``);
- debug mode refusing a block stage closed under its block's registered reader.
"""

from __future__ import annotations

import gc
import weakref

import numpy as np
import pytest
import torch

from pinpool import DeviceBlock, Field, Layout, PinnedRingBuffer, PoolSettings, PoolStateError
from pinpool.landing import land
from pinpool.testing import LaggingGpu
from tests.fakes import landing_stage


def _pool(gpu: LaggingGpu, slot_bytes: int = 64, **kw: object) -> PinnedRingBuffer:
    return PinnedRingBuffer(PoolSettings(device="cpu", num_slots=2, slot_bytes=slot_bytes, **kw), transport=gpu)  # type: ignore[arg-type]


@pytest.mark.parametrize("ok", [True, False])
def test_a_stage_with_landing_bytes_is_fenced_after_their_writer_even_when_aborted(ok: bool) -> None:
    """Catches a stage, closed or aborted after its flush, whose fence does not follow a writer queued
    on a consumer stream: the slot is handed out again while the writer still stores into its landing
    bytes. (``land`` always puts its addresses in the copy, so a landing stage that copied nothing
    is no longer a case: the fence is recorded; what matters is what it follows.)"""
    gpu = LaggingGpu(max_lag=0, seed=1)
    side = gpu.new_stream("consumer")
    side.speed = 1e-12  # the device never picks the writer while other work can run
    pool = _pool(gpu, zero_copy=True)
    pool.register_consumer_stream(side)
    gpu.frozen = True  # nothing runs until a host wait
    st, _, handle = landing_stage(pool, 4, torch.int32)  # 16 landing bytes at the slot's end
    st.flush()
    raw = torch.from_numpy(handle._host).view(torch.uint8)  # the pinned bytes the writer stores into
    gpu.enqueue_write(raw, torch.full((16,), 0xEE, dtype=torch.uint8), stream=side)
    wrote: list[bool] = []
    gpu.submit(side, lambda: wrote.append(True), "kernel")  # marks the writer done
    st.close(ok=ok)
    for i in range(pool.settings.num_slots):  # until the writer's slot is claimed again
        with pool.stage() as nxt:
            if nxt.slot == st.slot:
                assert wrote, "the writer's slot was handed out again before the writer ran"
            values = nxt.put(list(range(i, i + 16)), torch.int32)  # the whole slot, whichever it is
        gpu.enqueue_check(values, np.arange(i, i + 16, dtype=np.int32), f"later stage {i}'s values")
    assert nxt.slot == st.slot
    gpu.drain()
    assert not gpu.races and not gpu.mismatches


def test_a_stage_that_only_retained_keeps_the_object_until_its_fence() -> None:
    """Catches a stage with nothing put skipping its fence, so the next claim drops what it retained
    while the kernel that reads it is still queued (rule 5)."""
    gpu = LaggingGpu(max_lag=0, seed=0)
    pool = _pool(gpu)
    gpu.frozen = True
    scratch = torch.arange(4)
    alive = weakref.ref(scratch)
    with pool.stage() as st:
        st.retain(scratch)
        gpu.enqueue_check(torch.zeros(1), torch.zeros(1), "a kernel reading the retained tensor")
    del scratch
    with pool.stage():
        pass
    gc.collect()
    assert alive() is not None


def test_land_without_flush_is_refused_and_copies_nothing() -> None:
    """Catches close() copying a landing's live addresses when no writer could have run before it:
    a kernel launched after close would store into a slot its fence no longer guards."""
    gpu = LaggingGpu(max_lag=0, seed=3)
    pool = _pool(gpu, zero_copy=True)
    st, _, handle = landing_stage(pool, 2)
    st.put([1, 2], torch.int64)
    with pytest.raises(PoolStateError, match="needs flush\\(\\) before close"):
        st.close()
    assert pool.stats().copies == 0
    assert pool.stats().aborted_stages == 1
    assert not handle.armed
    with pool.stage() as nxt:  # the ring goes on as usual
        nxt.put([3], torch.int64)
    gpu.drain()
    assert pool.stats().copies == 1


def test_a_block_landing_without_flush_is_refused_and_leaves_the_block_as_it_was() -> None:
    """Catches a block stage's close issuing the copy that leaves live addresses in the graph's block."""
    gpu = LaggingGpu(max_lag=0, seed=0)
    pool = _pool(gpu, slot_bytes=1024, zero_copy=True)
    block = DeviceBlock(pool, Layout([Field.landing("addr", torch.int64)], max_rows=4))
    gpu.drain()
    before = block.views(4)["addr"].clone()
    with pytest.raises(PoolStateError, match="needs flush"), block.stage(rows=4, live=2) as sst:
        sst.landing("addr")  # its addresses were written when the stage opened
    gpu.drain()
    assert torch.equal(block.views(4)["addr"], before)  # never copied: no address reached the block
    assert pool.stats().copies == 0


def test_an_owned_buffer_given_new_memory_gets_the_copy_there() -> None:
    """Catches a cached copy slice of an ``owned`` buffer staged again still pointing at its old
    storage after ``.data =``: the returned view (new memory) would never receive the values."""
    gpu = LaggingGpu(max_lag=0, seed=0)
    pool = _pool(gpu, slot_bytes=256)
    owned = torch.zeros(64, dtype=torch.uint8)
    for _ in range(2):  # both slots see the buffer (a slot's view cache would keep its slices)
        with pool.stage(owned=owned) as st:
            st.put([1, 2, 3, 4], torch.int32)
    gpu.drain()
    old = owned.data
    owned.data = torch.zeros(64, dtype=torch.uint8)  # the same object, other memory
    with pool.stage(owned=owned) as st:
        values = st.put([5, 6, 7, 8], torch.int32)
    gpu.drain()
    assert values.tolist() == [5, 6, 7, 8]
    assert old[:16].view(torch.int32).tolist() == [1, 2, 3, 4]  # the old memory was left alone


def test_debug_mode_accepts_a_block_landing_closed_under_the_blocks_reader() -> None:
    """Catches debug mode refusing (and so stranding) a landing whose writer ran on a registered
    block reader: the slot's fence follows the block's readers, not only the pool's consumers."""
    gpu = LaggingGpu(max_lag=0, seed=0)
    pool = _pool(gpu, slot_bytes=1024, zero_copy=True, debug=True)
    block = DeviceBlock(pool, Layout([Field.landing("addr", torch.int64)], max_rows=4))
    reader = gpu.new_stream("replay")
    block.register_reader(reader)
    sst = block.stage(rows=4, live=2)
    handle = sst.landing("addr")
    sst.flush()
    default = gpu.current_stream()
    gpu.set_current(reader)  # the replay runs, and the stage closes, under the reader
    try:
        gpu.drain()
        land(torch.tensor([11, 22, 0, 0]), block.views(4)["addr"])
        sst.close()
    finally:
        gpu.set_current(default)
    gpu.drain()
    assert handle.tolist() == [11, 22]
