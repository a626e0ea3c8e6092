"""A seeded serving trace: Poisson arrivals counted in loop iterations, long-tailed lengths.

Arrivals are counted in loop iterations, not seconds, so every staging mode runs the same
schedule (the same batches at the same iterations) and samples the same tokens; a faster
mode runs those iterations in less wall time, which is what its throughput and latency
figures show. Prompt lengths are lognormal and output lengths Pareto, both capped so that
a request fits the model's context. One ``numpy`` generator per trace: the same config gives
the same requests, field for field.
"""

from __future__ import annotations

import attrs
import numpy as np

from pinpool.bench.engine.requests import Request
from sampling import SamplingParams


def _positive(_: object, attribute: attrs.Attribute[float], value: float) -> None:
    if not value > 0:
        raise ValueError(f"'{attribute.name}' must be > 0 (got {value})")


@attrs.frozen
class TraceConfig:
    num_requests: int = attrs.field(default=64, validator=attrs.validators.ge(1))
    #: Mean arrivals per loop iteration (a Poisson process: exponential gaps).
    rate: float = attrs.field(default=1.0, validator=_positive)
    #: Prompt tokens: lognormal with this median and log-space sigma, clipped to the bounds.
    prompt_median: float = attrs.field(default=24.0, validator=_positive)
    prompt_sigma: float = 0.6
    prompt_bounds: tuple[int, int] = (4, 96)
    #: New tokens: Pareto with this minimum and tail index (smaller: heavier tail), capped.
    output_min: int = attrs.field(default=8, validator=attrs.validators.ge(1))
    output_alpha: float = attrs.field(default=1.5, validator=_positive)
    output_cap: int = attrs.field(default=96, validator=attrs.validators.ge(1))
    #: Every request's prompt plus output stays below this (the model's context length).
    max_context_len: int = 160
    greedy_share: float = 0.25
    seed: int = 0

    def __attrs_post_init__(self) -> None:
        low, high = self.prompt_bounds
        if not 1 <= low <= high:
            raise ValueError(f"'prompt_bounds' must be 1 <= low <= high (got {self.prompt_bounds})")
        if high + self.output_min >= self.max_context_len:
            raise ValueError(
                f"'prompt_bounds' high + 'output_min' must be < max_context_len={self.max_context_len} "
                f"(got {high} + {self.output_min}); lower the prompt bound or raise the context"
            )

    @property
    def mean_output(self) -> float:
        """The uncapped Pareto mean (infinite for alpha <= 1): a guide for picking rates."""
        a = self.output_alpha
        return a * self.output_min / (a - 1) if a > 1 else float("inf")


def make_trace(cfg: TraceConfig, vocab_size: int, *, rid_base: int = 0) -> list[Request]:
    """The trace's requests, sorted by arrival iteration (the first arrives at iteration 0)."""
    rng = np.random.default_rng(cfg.seed)
    n = cfg.num_requests
    gaps = rng.exponential(1.0 / cfg.rate, n)
    gaps[0] = 0.0
    arrivals = np.floor(np.cumsum(gaps)).astype(np.int64)
    low, high = cfg.prompt_bounds
    prompt_lens = np.clip(np.rint(rng.lognormal(np.log(cfg.prompt_median), cfg.prompt_sigma, n)), low, high)
    outputs = np.floor(cfg.output_min * (1.0 + rng.pareto(cfg.output_alpha, n)))
    # Capped by the trace's cap and by what the context leaves after the prompt.
    room = cfg.max_context_len - 1 - prompt_lens
    output_lens = np.minimum(np.minimum(outputs, cfg.output_cap), room).astype(np.int64)
    greedy = rng.random(n) < cfg.greedy_share
    temperature = rng.uniform(0.6, 1.2, n)
    top_p = rng.choice(np.array([1.0, 0.9, 0.7]), n)
    top_k = rng.choice(np.array([-1, 50, 200]), n)
    min_p = rng.choice(np.array([0.0, 0.05]), n)
    seeds = rng.integers(0, 2**31, n)
    requests = []
    for i in range(n):
        prompt = rng.integers(0, vocab_size, int(prompt_lens[i])).tolist()  # sync-ok: numpy, on the host
        params = SamplingParams(
            temperature=0.0 if greedy[i] else float(temperature[i]),
            top_p=float(top_p[i]),
            top_k=int(top_k[i]),
            min_p=float(min_p[i]),
            seed=int(seeds[i]),
            max_new_tokens=int(output_lens[i]),
        )
        requests.append(Request(rid=rid_base + i, prompt=prompt, sampling_params=params, arrival=int(arrivals[i])))
    return requests


def fresh(requests: list[Request], offset: int) -> list[Request]:
    """Unstarted copies of ``requests`` arriving ``offset`` iterations later (one trace, run again)."""
    return [
        Request(rid=r.rid, prompt=list(r.prompt), sampling_params=r.sampling_params, arrival=r.arrival + offset)
        for r in requests
    ]
