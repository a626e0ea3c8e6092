"""``DeviceBlock`` and the ring under faults and misuse (found by review; each failed before its fix):

- a copy that raises, a buffer passed once, a read-back after a replay on a reader stream.

CPU only: plain CPU pools, or the stream-aware simulator (``pinpool.testing.LaggingGpu``).
"""

from __future__ import annotations

import gc
import random
import weakref
from typing import Any

import numpy as np
import pytest
import torch

from pinpool import DeviceBlock, Field, Layout, PinnedRingBuffer, PoolSettings, PoolStateError
from pinpool.testing import LaggingGpu, SimStream

LAYOUT = Layout([Field("step", torch.int64, pad=-1), Field("temps", torch.float32, pad=1.0)], 8)
SLOT_BYTES = 1024


class _CopyFault(LaggingGpu):
    """The simulator, with a host-to-device copy that raises while ``armed`` (a CUDA error, a KeyboardInterrupt)."""

    armed = False

    def copy(self, dst: torch.Tensor, src: torch.Tensor, stream: Any) -> None:
        if self.armed:
            self.armed = False
            raise RuntimeError("injected: the copy call failed")
        super().copy(dst, src, stream)


def _fault_pool() -> tuple[_CopyFault, PinnedRingBuffer]:
    gpu = _CopyFault(max_lag=0, seed=0)
    pool = PinnedRingBuffer(PoolSettings(device="cpu", num_slots=2, slot_bytes=SLOT_BYTES), transport=gpu)  # type: ignore[arg-type]
    return gpu, pool


def test_a_plain_ring_stage_whose_copy_raises_leaves_the_pool_usable() -> None:
    """Control for the next test (passes): the ring's own Stage releases the pool when its copy raises."""
    gpu, pool = _fault_pool()
    gpu.armed = True
    with pytest.raises(RuntimeError, match="injected"), pool.stage() as st:
        st.put([1, 2, 3], torch.int64)
    with pool.stage() as st:  # usable
        st.put([4], torch.int64)


def test_a_block_stage_whose_copy_raises_at_close_leaves_the_pool_usable() -> None:
    """Catches a block stage whose copy raises at close leaving the pool's stage open forever (the old
    ``StaticInputs.finish`` cleared ``block._open``, then ``issue()`` raised before ``st.close()``): every
    later stage of the pool (and of the block) would raise PoolStateError 'stage() called inside open stage'."""
    gpu, pool = _fault_pool()
    block = DeviceBlock(pool, LAYOUT)
    gpu.armed = True
    with pytest.raises(RuntimeError, match="injected"), block.stage(4, 2) as st:
        st.put("step", np.array([1, 1], np.int64))
        st.put("temps", np.array([0.5, 0.5], np.float32))
    # The step failed; the block keeps its previous values. The pool and the block must still work.
    try:
        with block.stage(4, 2) as st:
            st.put("step", np.array([2, 2], np.int64))
            st.put("temps", np.array([0.25, 0.25], np.float32))
    except PoolStateError as err:
        pytest.fail(f"the block is wedged after a failed copy: {err}")
    gpu.drain()
    assert block.views(4)["step"].tolist() == [2, 2, -1, -1]


def test_an_owned_tensor_is_not_kept_alive_by_the_pool_after_its_stage() -> None:
    """Catches the pool keeping a strong reference to a caller's ``owned=`` buffer after its stage
    closed (a copy-slice cache keyed by it): up to the cache's limit of buffers per slot would stay
    allocated for a caller that passes a fresh ``owned=`` tensor per stage (README rule 4)."""
    pool = PinnedRingBuffer(PoolSettings(device="cpu", num_slots=2, slot_bytes=SLOT_BYTES))
    owned = torch.empty(256, dtype=torch.uint8)
    ref = weakref.ref(owned)
    with pool.stage(owned=owned) as st:
        st.put([1, 2, 3], torch.int64)
    del owned, st
    gc.collect()
    assert ref() is None, "the pool still holds the caller's owned buffer after the stage closed"


def _replay_after_backlog(gpu: LaggingGpu, stream: SimStream, out: torch.Tensor, value: int, backlog: int) -> None:
    """A "replay" on ``stream`` that writes ``out`` after ``backlog`` earlier kernels (a lagging forward stream)."""
    for _ in range(backlog):
        gpu.submit(stream, lambda: None, "kernel")
    gpu.enqueue_write(out, torch.full(out.shape, value, dtype=torch.int64), stream)


def test_a_block_readback_after_a_replay_on_a_registered_reader_reads_that_replays_output() -> None:
    """Catches a block stage's ``readback`` that copies ``src`` on the stage's stream with no wait for
    the block's registered readers. With the copy on one stream and the replay on a registered reader
    (put, flush, replay, read back: one slot, one fence), the read-back would land before the replay
    wrote its output: the host would read the previous step's tokens."""
    wrong = []
    for seed in range(10):
        gpu = LaggingGpu(max_lag=0, seed=seed)
        pool = PinnedRingBuffer(PoolSettings(device="cpu", num_slots=3, slot_bytes=SLOT_BYTES), transport=gpu)  # type: ignore[arg-type]
        block = DeviceBlock(pool, LAYOUT)
        upload, forward = gpu.new_stream("schedule"), gpu.new_stream("forward")
        block.register_reader(forward)
        out = torch.zeros(4, dtype=torch.int64)  # the replay's output, "device" memory
        gpu.frozen = True  # the device runs only when the host waits
        rng = random.Random(seed)
        st = block.stage(4, 4, stream=upload)
        st.put("step", np.full(4, 1, np.int64))
        st.put("temps", np.array([rng.random() for _ in range(4)], np.float32))
        st.flush()
        _replay_after_backlog(gpu, forward, out, 7, backlog=40)  # waits for the copy, then runs late
        handle = st.readback(out)
        st.close()
        got = handle.tolist()
        gpu.frozen = False
        gpu.drain()
        if got != [7, 7, 7, 7]:
            wrong.append((seed, got))
    assert not wrong, f"read-back taken before the replay on the registered reader ran: {wrong}"


@pytest.mark.parametrize(
    "src",
    [torch.zeros(4, dtype=torch.complex64), torch.zeros(4, 2).t(), torch.zeros(1 << 10, dtype=torch.int64)],
    ids=["dtype", "layout", "too-big"],
)
def test_a_refused_block_readback_issues_no_copy_and_leaves_the_step_open(src: torch.Tensor) -> None:
    """Catches a block stage's read-back that issues the step's copy before checking its source: the
    refusal would leave the block's copy queued and the step flushed, unable to finish."""
    gpu = LaggingGpu(max_lag=3, seed=5)
    pool = PinnedRingBuffer(PoolSettings(device="cpu", num_slots=3, slot_bytes=SLOT_BYTES), transport=gpu)
    block = DeviceBlock(pool, LAYOUT)
    st = block.stage(4, 2)
    st.put("step", np.array([1, 1], np.int64))
    with pytest.raises((ValueError, RuntimeError)):
        st.readback(src)
    assert not st.flushed and pool.stats().copies == 0
    st.put("temps", np.array([0.5, 0.5], np.float32))  # the step goes on
    st.readback(torch.tensor([3, 4]))
    st.close()
    gpu.drain()
    assert block.views(4)["step"].tolist() == [1, 1, -1, -1]
    assert pool.stats().copies == 1
