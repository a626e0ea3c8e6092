"""Minimal scheduler stand-ins that satisfy sampling's Protocols."""

from __future__ import annotations

import random
from dataclasses import dataclass, field
from typing import Any

import torch

from pinpool import DeviceBlock, Field, Layout, PinnedRingBuffer, Stage
from pinpool.readback import Landing
from sampling import SamplingParams


@dataclass
class Req:
    sampling_params: SamplingParams


@dataclass
class Batch:
    reqs: list[Req]
    device: torch.device = field(default_factory=lambda: torch.device("cpu"))


def random_params(rng: random.Random, vocab: int = 50, seeded: bool = True, bias: bool = True) -> SamplingParams:
    greedy = rng.random() < 0.2
    return SamplingParams(
        temperature=0.0 if greedy else rng.uniform(0.3, 1.5),
        top_p=rng.choice([1.0, rng.uniform(0.2, 1.0)]),
        top_k=rng.choice([-1, rng.randint(1, vocab)]),
        min_p=rng.choice([0.0, rng.uniform(0.0, 0.3)]),
        seed=rng.randint(0, 2**40) if seeded and rng.random() < 0.8 else None,
        logit_bias={rng.randrange(vocab): rng.uniform(-5, 5) for _ in range(rng.randint(1, 3))}
        if bias and rng.random() < 0.3
        else None,
    )


class NeverPendingFence:
    """A fence that always reports done: it turns a ring's reuse guard off."""

    def record(self, stream: Any) -> None: ...

    def query(self) -> bool:
        return True

    def synchronize(self) -> None: ...


class UnfencedTransport:
    """Planted bug for control tests: every fence reads as passed, so the ring reuses slots without waiting.

    Wraps a real transport (``CudaTransport``, ``LaggingGpu``) and keeps its copies.
    """

    def __init__(self, inner: Any) -> None:
        self._inner = inner

    def __getattr__(self, name: str) -> Any:
        return getattr(self._inner, name)

    def new_fence(self) -> NeverPendingFence:
        return NeverPendingFence()

    def stream_wait(self, waiter: Any, fence: Any) -> None:
        return None


class NoFenceAfterReaders(DeviceBlock):
    """Planted bug for control tests: a landed stage's close does not wait for the block's readers (the
    replay that stores through the addresses) before the slot's fence; the wait before the copy, for the
    previous replays, is kept."""

    _copying = False

    def before_copy(self, stream: Any) -> None:
        self._copying = True
        try:
            super().before_copy(stream)
        finally:
            self._copying = False

    def wait_for_readers(self, stream: Any) -> None:
        if self._copying:
            super().wait_for_readers(stream)


def landing_stage(
    pool: PinnedRingBuffer, n: int, dtype: torch.dtype = torch.int64, **kw: Any
) -> tuple[Stage, torch.Tensor, Landing]:
    """A stage whose layout is one landing of ``n`` rows: (the stage, its device addresses, the handle)."""
    st = pool.stage(Layout([Field.landing("out", dtype)], max(n, 1)), rows=n, **kw)
    return st, st.views["out"], st.landing("out")
