"""Bad input and misuse that the other unit tests do not already cover: each raises a typed
error before any state changes, and the next normal operation still works."""

from __future__ import annotations

import numpy as np
import pytest
import torch

from memcache import CacheIndexError, ReqToTokenPool, write_cache_indices
from pinpool import DeviceMismatchError, PinnedRingBuffer, PoolSettings, PoolStateError
from pinpool.cuda import CudaTransport
from pinpool.testing import LaggingGpu


def pool() -> PinnedRingBuffer:
    return PinnedRingBuffer(PoolSettings(device="cpu", num_slots=2, slot_bytes=1024))


def test_stream_given_to_a_cpu_pool_is_refused_and_the_pool_still_works() -> None:
    """Catches a stream silently ignored (the caller believes the copy is ordered on it)."""
    p = pool()
    with pytest.raises(DeviceMismatchError, match="'stream' must be None"):
        p.stage(stream=object())
    with pytest.raises(DeviceMismatchError, match="'stream' must be None"):
        p.register_consumer_stream(object())
    with p.stage() as st:
        value = st.put([1, 2], torch.int32)
    assert value.tolist() == [1, 2]


def test_cuda_transport_refuses_what_is_not_a_cuda_stream() -> None:
    """Catches a foreign object passed as the staging stream of a CUDA pool."""
    transport = CudaTransport(torch.device("cuda", 0))  # constructing it touches no GPU
    with pytest.raises(DeviceMismatchError, match=r"'stream' must be a torch\.cuda\.Stream \(got object\)"):
        transport.resolve_stream(object())


def test_owned_buffer_or_value_on_another_device_is_refused() -> None:
    """Catches a silent cross-device copy into or out of the ring."""
    p = pool()
    with pytest.raises(DeviceMismatchError, match="'owned' must be on the pool's device cpu"):
        p.stage(owned=torch.empty(64, dtype=torch.uint8, device="meta"))
    with p.stage() as st:
        with pytest.raises(DeviceMismatchError, match="CPU tensor"):
            st.put(torch.ones(3, device="meta"))
        value = st.put(torch.ones(3))
    assert value.tolist() == [1.0, 1.0, 1.0]
    assert p.stats().copies == 1


def test_write_cache_indices_recovers_after_a_refused_batch() -> None:
    """Catches a refused batch that leaves the pool or the rows in a state the next call trips on."""
    rtt = ReqToTokenPool(4, 16, "cpu")
    p = pool()
    ok = {
        "out_cache_loc": torch.tensor([7, 8]),
        "req_pool_indices": [2],
        "prefix_lens": [1],
        "seq_lens": [3],
        "extend_lens": [2],
        "prefix_tensors": [torch.tensor([5], dtype=torch.int32)],
    }
    with pytest.raises(CacheIndexError, match="'seq_lens' of request 0 must be <= max_context_len 16"):
        write_cache_indices(req_to_token_pool=rtt, pool=p, **{**ok, "seq_lens": [17], "extend_lens": [16]})
    write_cache_indices(req_to_token_pool=rtt, pool=p, backend="torch", **ok)
    assert rtt.req_to_token[2, :3].tolist() == [5, 7, 8]


def test_a_stage_that_fails_after_flush_still_fences_its_copy() -> None:
    """Catches a slot handed to the next stage while the failed stage's issued copy may still be pending."""
    gpu = LaggingGpu(max_lag=1000, seed=0)
    gpu.frozen = True  # the "GPU" never catches up on its own
    pool = PinnedRingBuffer(PoolSettings(device="cpu", num_slots=2, slot_bytes=256), transport=gpu)
    with pytest.raises(RuntimeError, match="model failed"), pool.stage() as st:
        view = st.put([1, 2, 3], torch.int64)
        st.flush()
        gpu.enqueue_check(view, np.array([1, 2, 3]), "flushed stage")
        raise RuntimeError("model failed")
    for _ in range(4):  # laps the ring: each stage must wait for the failed stage's copy
        with pool.stage() as other:
            other.put([9, 9, 9], torch.int64)
    gpu.drain()
    assert gpu.races == [] and gpu.mismatches == []


def test_a_pool_dropped_with_a_flushed_stage_open_waits_for_that_copy() -> None:
    """Catches teardown freeing the slab while an open stage's flushed copy may still read it."""
    import gc

    gpu = LaggingGpu(max_lag=0)
    gpu.frozen = True  # nothing runs unless the host waits
    pool = PinnedRingBuffer(PoolSettings(device="cpu", num_slots=2, slot_bytes=256), transport=gpu)
    st = pool.stage()
    st.put([1, 2, 3], torch.int32)
    st.flush()
    assert gpu.pending == 1
    del st, pool
    gc.collect()
    assert gpu.pending == 0, "the pool was dropped with its copy still queued"
    assert gpu.races == []


def test_close_inside_an_open_stage_refuses_and_frees_nothing() -> None:
    """Catches close() dropping memory that the open stage's copy will still read."""
    gpu = LaggingGpu(max_lag=0)
    pool = PinnedRingBuffer(PoolSettings(device="cpu", num_slots=2, slot_bytes=256), transport=gpu)
    with pool.stage() as st:
        st.put([4], torch.int64)
        st.flush()
        with pytest.raises(PoolStateError, match="inside an open stage"):
            pool.close()
        assert not pool.closed
    pool.close()
    assert pool.closed and gpu.pending == 0
