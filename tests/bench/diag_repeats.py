"""How often ``from_schedule_batch`` sees a request object it has seen before (a diagnostic, not a test).

python3 tests/bench/diag_repeats.py > $OUT/diag_repeats.txt

A per-object cache of packed sampling records would hit only on requests that reach a new
prefill batch twice. In sglang's scheduler two paths do that:

- chunked prefill: a prompt longer than what is left of ``chunked_prefill_size`` is cut; the
  rest goes first into the next prefill batch (``Scheduler.chunked_req``), the same object;
- retraction: when the next decode step does not fit the KV pool, ``retract_decode`` sends
  the requests it likes least back to the waiting queue; they are prefilled again later.

This is a model of that admission, written here (not sglang's code): FIFO admission under a
prefill token budget, a chunk budget and a KV estimate that counts each running request's
remaining output times a new-token ratio (0.7 at start, decaying to 0.1 over 600 decode
steps, raised again after a retraction), prefill batches run instead of a decode step, and
retraction of the request with the fewest output tokens (longest prompt first on ties)
until the step fits. Requests are ShareGPT-shaped: lognormal prompts (median 300 tokens)
and outputs (median 200, or 1000 where a row says so), capped, arriving as a Poisson process. It counts the objects
each prefill batch hands to ``from_schedule_batch`` and which of them were seen before.
"""

from __future__ import annotations

import math
from collections import deque
from dataclasses import dataclass

import numpy as np


@dataclass
class Req:
    prompt: int
    output: int
    arrival: int
    done: int = 0  # tokens generated
    prefilled: int = 0  # prompt (+ regenerated output, after a retraction) tokens in the KV pool
    seen: bool = False
    retracted: bool = False

    @property
    def need(self) -> int:
        """Tokens to prefill: the prompt, plus the output so far after a retraction."""
        return self.prompt + self.done


@dataclass
class Config:
    name: str
    kv_tokens: int
    chunk: int = 8192
    max_prefill: int = 16384
    max_running: int = 256
    rate: float = 4.0  # arrivals per iteration
    requests: int = 5000
    output_median: float = 200.0
    seed: int = 0


@dataclass
class Counts:
    batches: int = 0
    objects: int = 0
    chunk_repeats: int = 0
    retract_repeats: int = 0
    retractions: int = 0
    most_in_batch: int = 0
    alone: int = 0  # repeats that were their batch's only request


def trace(cfg: Config) -> list[Req]:
    rng = np.random.default_rng(cfg.seed)
    n = cfg.requests
    arrivals = np.floor(np.cumsum(rng.exponential(1.0 / cfg.rate, n))).astype(int)
    prompts = np.clip(np.rint(rng.lognormal(math.log(300), 1.2, n)), 4, 32768).astype(int)
    outputs = np.clip(np.rint(rng.lognormal(math.log(cfg.output_median), 1.0, n)), 1, 4096).astype(int)
    return [Req(int(p), int(o), int(a)) for p, o, a in zip(prompts, outputs, arrivals, strict=True)]


def simulate(cfg: Config) -> Counts:
    pending = deque(trace(cfg))
    waiting: deque[Req] = deque()
    running: list[Req] = []
    chunked: Req | None = None
    ratio, counts, step = 0.7, Counts(), 0
    while pending or waiting or running or chunked:
        while pending and pending[0].arrival <= step:
            waiting.append(pending.popleft())
        used = sum(r.prefilled + r.done for r in running) + (chunked.prefilled if chunked else 0)
        batch = _admit(cfg, waiting, running, chunked, used, ratio)
        if batch:
            counts.batches += 1
            counts.objects += len(batch)
            repeats = 0
            for r in batch:
                if r.seen:
                    repeats += 1
                    if r.retracted:
                        counts.retract_repeats += 1
                        r.retracted = False
                    else:
                        counts.chunk_repeats += 1
                r.seen = True
            counts.alone += repeats if len(batch) == 1 else 0
            counts.most_in_batch = max(counts.most_in_batch, repeats)
            chunked = None
            for r in batch:
                if r.prefilled < r.need:
                    chunked = r  # cut: its rest goes into the next prefill batch
                else:
                    r.done += 1  # the prefill samples the first token
                    running.append(r)
        elif running:
            while len(running) > 1 and used + len(running) > cfg.kv_tokens:
                # keep the longest-running requests: retract the one with the least output
                victim = min(running, key=lambda r: (r.done, -r.prompt))
                running.remove(victim)
                used -= victim.prefilled + victim.done
                victim.prefilled, victim.retracted = 0, True
                waiting.append(victim)
                counts.retractions += 1
                # sglang's estimate after a retraction: tokens decoded so far plus 20 steps each,
                # over the running requests' whole output budgets
                budget = sum(r.output for r in running) or 1
                ratio = min(1.0, (sum(r.done for r in running) + 20 * len(running)) / budget)
            for r in running:
                r.done += 1
            ratio = max(0.1, ratio - 0.6 / 600)
        running = [r for r in running if r.done < r.output]
        step += 1
    return counts


def _admit(
    cfg: Config, waiting: deque[Req], running: list[Req], chunked: Req | None, used: int, ratio: float
) -> list[Req]:
    """One prefill batch under the chunk, prefill and KV budgets (empty: run a decode step)."""
    free = cfg.kv_tokens - used - sum(math.ceil((r.output - r.done) * ratio) for r in running)
    chunk, prefill, batch = cfg.chunk, cfg.max_prefill, []
    if chunked is not None:
        take = min(chunked.need - chunked.prefilled, chunk)
        chunked.prefilled += take
        chunk, prefill, free = chunk - take, prefill - take, free - take
        batch.append(chunked)
        if chunked.prefilled < chunked.need:
            return batch
    while waiting and len(running) + len(batch) < cfg.max_running and chunk > 0 and prefill > 0:
        r = waiting[0]
        estimate = r.need + math.ceil(min(r.output - r.done, 4096) * ratio)
        if estimate > free:
            break
        waiting.popleft()
        take = min(r.need, chunk)
        r.prefilled = take
        chunk, prefill, free = chunk - take, prefill - take, free - estimate
        batch.append(r)
        if take < r.need:
            break  # cut: the chunked request ends the batch
    return batch


def main() -> None:
    configs = [
        Config("ample KV (2M tokens), chunk 8192", kv_tokens=2_000_000),
        Config("ample KV (2M tokens), chunk 2048", kv_tokens=2_000_000, chunk=2048),
        Config("tight KV (200k tokens), chunk 8192", kv_tokens=200_000),
        Config("tight KV (200k tokens), chunk 2048", kv_tokens=200_000, chunk=2048),
        Config("very tight KV (80k tokens), chunk 2048", kv_tokens=80_000, chunk=2048),
        Config(
            "tight KV (200k tokens), chunk 2048, outputs median 1000", kv_tokens=200_000, chunk=2048, output_median=1000
        ),
        Config(
            "very tight KV (80k tokens), chunk 2048, outputs median 1000",
            kv_tokens=80_000,
            chunk=2048,
            output_median=1000,
        ),
    ]
    print(
        "config | prefill batches | objects read | seen before: chunk / retraction | share | "
        "most in one batch | of them alone in their batch | retractions"
    )
    for cfg in configs:
        c = simulate(cfg)
        repeats = c.chunk_repeats + c.retract_repeats
        print(
            f"{cfg.name} | {c.batches} | {c.objects} | {c.chunk_repeats} / {c.retract_repeats} | "
            f"{repeats / c.objects:.1%} | {c.most_in_batch} | {c.alone} | {c.retractions}"
        )
    print(f"note: {configs[0].requests} requests at {configs[0].rate} arrivals per iteration, at most 256 running")


if __name__ == "__main__":
    main()
