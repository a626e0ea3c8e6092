"""A stage or read-back opened inside a CUDA graph capture is refused, on real CUDA.

Without the guard, the stage's copy (and its fence record) would be captured at the
slot's address: every replay would copy whatever another stage later wrote there; and in
torch's default capture mode its fence query alone breaks the capture. The check asks
about the current device's current stream, the pool device's current stream and the
stage's own stream, so it holds with another device current, with a stream passed, and for
a stream forked into the capture.
"""

from __future__ import annotations

from collections.abc import Callable
from typing import Any

import pytest
import torch

from pinpool import DeviceBlock, Field, Layout, PinnedRingBuffer, PoolSettings, PoolStateError

DEV = torch.device("cuda", 0)
TWO_GPUS = torch.cuda.device_count() >= 2
#: A decode step's layout: an input and a landing.
STEP = Layout([Field("step", torch.int64, pad=-1), Field.landing("tokens")], max_rows=4)


def _openers(pool: PinnedRingBuffer, block: DeviceBlock, src: torch.Tensor) -> dict[str, Callable[..., Any]]:
    return {
        "stage": lambda stream: pool.stage(stream=stream),
        "layout stage": lambda stream: pool.stage(STEP, rows=4, live=2, stream=stream),
        "read-back": lambda stream: pool.readback(src, stream=stream),
        "block stage": lambda stream: block.stage(4, 2, stream=stream),
    }


@pytest.mark.parametrize("current_index", [0, 1] if TWO_GPUS else [0])
@pytest.mark.parametrize(
    "where",
    ["current stream", "capture stream passed", "side stream", "forked stream"],
)
@pytest.mark.parametrize("kind", ["stage", "layout stage", "read-back", "block stage"])
def test_staging_inside_a_capture_is_refused_and_the_pool_goes_on(kind: str, where: str, current_index: int) -> None:
    """Catches a stage whose copy and fence would be baked into a graph (a slot the ring reuses), or
    whose fence query would break the capture: on the capture stream, on another stream while the
    capture body runs, and on a stream forked into the capture while an idle stream is current."""
    pool = PinnedRingBuffer(PoolSettings(device=DEV, num_slots=3, zero_copy=True))
    block = DeviceBlock(pool, Layout([Field("step", torch.int64, pad=-1)], max_rows=4))
    src = torch.arange(4, device=DEV)
    capture, side, idle = torch.cuda.Stream(DEV), torch.cuda.Stream(DEV), torch.cuda.Stream(DEV)
    x = torch.zeros(4, device=DEV)
    for _ in range(3):  # every slot fenced once: a claim inside the capture would query a fence
        with pool.stage(stream=side) as st:
            st.put([1], torch.int64)
    torch.cuda.synchronize(DEV)
    claims = pool.claims
    open_one = _openers(pool, block, src)[kind]
    refused: PoolStateError | None = None
    graph = torch.cuda.CUDAGraph()
    with torch.cuda.graph(graph, stream=capture):
        x.add_(1)  # something captured before the refused call
        if where == "forked stream":
            side.wait_stream(capture)  # ``side`` joins the capture
        try:
            with torch.cuda.device(current_index):
                if where == "forked stream":
                    with torch.cuda.stream(idle):
                        open_one(side)
                else:
                    open_one({"current stream": None, "capture stream passed": capture, "side stream": side}[where])
        except PoolStateError as e:
            refused = e
        finally:
            if where == "forked stream":
                capture.wait_stream(side)  # rejoined, so the capture can end
    assert refused is not None and "capturing a CUDA graph" in str(refused)
    assert pool.claims == claims
    assert torch.cuda.current_device() == 0
    graph.replay()  # the capture is intact: it holds the add alone
    torch.cuda.synchronize(DEV)
    assert x.tolist() == [1.0] * 4  # a capture records without running: the replay added 1 once
    # Outside the capture the same pool stages as ever, on any stream.
    with pool.stage(stream=capture) as st:
        view = st.put([7, 8, 9], torch.int64)
    capture.synchronize()  # the copy went to ``capture`` at close
    assert view.tolist() == [7, 8, 9]
    handle = pool.readback(src)
    assert handle.tolist() == [0, 1, 2, 3]
