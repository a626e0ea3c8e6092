"""A stage or read-back opened inside a CUDA graph capture is refused, on real CUDA.

Without the guard, the stage's copy (and its fence record) would be captured at the
slot's address: every replay would copy whatever another stage later wrote there. The
check asks about the stage's own stream on the pool's device, so it holds with another
device current and with the stream passed explicitly.
"""

from __future__ import annotations

from collections.abc import Callable
from typing import Any

import pytest
import torch

from pinpool import PinnedRingBuffer, PoolSettings, PoolStateError, StaticField, StaticInputs

DEV = torch.device("cuda", 0)
TWO_GPUS = torch.cuda.device_count() >= 2


def _openers(pool: PinnedRingBuffer, block: StaticInputs, src: torch.Tensor) -> dict[str, Callable[..., Any]]:
    return {
        "stage": lambda stream: pool.stage(stream=stream),
        "read-back": lambda stream: pool.readback(src, stream=stream),
        "static stage": lambda stream: block.stage(4, 2, stream=stream),
    }


@pytest.mark.parametrize("current_index", [0, 1] if TWO_GPUS else [0])
@pytest.mark.parametrize("explicit", [False, True], ids=["current stream", "stream passed"])
@pytest.mark.parametrize("kind", ["stage", "read-back", "static stage"])
def test_staging_inside_a_capture_is_refused_and_the_pool_goes_on(
    kind: str, explicit: bool, current_index: int
) -> None:
    """Catches a stage whose copy and fence would be baked into a graph (a slot the ring reuses)."""
    pool = PinnedRingBuffer(PoolSettings(device=DEV, num_slots=3))
    block = StaticInputs(pool, (StaticField("step", torch.int64, pad=-1),), max_rows=4)
    src = torch.arange(4, device=DEV)
    capture = torch.cuda.Stream(DEV)
    x = torch.zeros(4, device=DEV)
    torch.cuda.synchronize(DEV)
    claims = pool.claims
    graph = torch.cuda.CUDAGraph()
    with pytest.raises(PoolStateError, match="capturing a CUDA graph"), torch.cuda.graph(graph, stream=capture):
        x.add_(1)  # something captured before the refused call
        with torch.cuda.device(current_index):
            _openers(pool, block, src)[kind](capture if explicit else None)
    assert pool.claims == claims
    assert torch.cuda.current_device() == 0
    # Outside the capture the same pool stages as ever, on any stream.
    with pool.stage(stream=capture) as st:
        view = st.put([7, 8, 9], torch.int64)
    capture.synchronize()  # the copy went to ``capture`` at close
    assert view.tolist() == [7, 8, 9]
    handle = pool.readback(src)
    assert handle.tolist() == [0, 1, 2, 3]
