"""Requests of the reference decode loop, and a seeded generator of workloads."""

from __future__ import annotations

import random

import attrs

from sampling import SamplingParams


@attrs.define(eq=False)
class Request:
    rid: int
    prompt: list[int]
    sampling_params: SamplingParams
    arrival: int = 0  # loop iteration at which the request becomes visible
    prefix_group: int | None = None  # requests of one group share their first shared_len tokens
    shared_len: int = 0
    output: list[int] = attrs.Factory(list)
    row: int = -1
    seq_len: int = 0  # tokens whose KV is in the cache or being written by a queued step
    owned_from: int = 0  # KV slots [owned_from, seq_len) of the row are this request's to free
    done: bool = False


def accept_all(reqs: list[Request], tokens: list[int]) -> bool:
    """Append each request's new token; a request that reaches its limit or a stop token is done.

    A token for a request already done (sampled by the step launched before its finish
    was seen) is discarded. Returns whether a request finished with these tokens. One loop
    over the batch with the attribute reads inlined: it runs every step, for every request.
    """
    any_done = False
    for r, token in zip(reqs, tokens, strict=True):
        if r.done:
            continue
        output = r.output
        output.append(token)
        params = r.sampling_params
        if len(output) >= params.max_new_tokens or token in params.stop_token_ids:
            r.done = any_done = True
    return any_done


@attrs.frozen
class Workload:
    num_requests: int = 32
    arrival_gap: float = 0.5  # iterations between arrivals (0: all at once)
    prompt_len: tuple[int, int] = (8, 40)
    new_tokens: tuple[int, int] = (8, 24)
    shared_prefixes: int = 3
    shared_len: int = 16
    greedy_share: float = 0.25
    seed: int = 0


def make_requests(wl: Workload, vocab_size: int, *, rid_base: int = 0) -> list[Request]:
    rng = random.Random(wl.seed)
    prefixes = [[rng.randrange(vocab_size) for _ in range(wl.shared_len)] for _ in range(wl.shared_prefixes)]
    requests = []
    for i in range(wl.num_requests):
        group = rng.randrange(wl.shared_prefixes) if wl.shared_prefixes and rng.random() < 0.6 else None
        own = [rng.randrange(vocab_size) for _ in range(rng.randint(*wl.prompt_len))]
        prompt = (prefixes[group] + own) if group is not None else own
        greedy = rng.random() < wl.greedy_share
        params = SamplingParams(
            temperature=0.0 if greedy else rng.uniform(0.6, 1.2),
            top_p=rng.choice([1.0, 0.9, 0.7]),
            top_k=rng.choice([-1, 50, 200]),
            min_p=rng.choice([0.0, 0.05]),
            seed=rng.randrange(2**31),
            max_new_tokens=rng.randint(*wl.new_tokens),
            stop_token_ids=[rng.randrange(vocab_size)] if rng.random() < 0.3 else [],
        )
        requests.append(
            Request(
                rid=rid_base + i,
                prompt=prompt,
                sampling_params=params,
                arrival=int(i * wl.arrival_gap),
                prefix_group=group,
                shared_len=wl.shared_len if group is not None else 0,
            )
        )
    return requests
