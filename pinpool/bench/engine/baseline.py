"""What the non-pool modes stage instead of the library's one-copy paths.

``PerFieldSamplingInfo`` is sglang's ``SamplingBatchInfo`` shape: five tensors uploaded
field by field and flags from Python any/all. ``write_cache_per_field`` uploads the
per-request metadata field by field and runs the same kernel as the library (so token
streams match across modes), without the host validation.
"""

from __future__ import annotations

from collections.abc import Sequence
from typing import Any

import numpy as np
import torch

from memcache import ReqToTokenPool, write_req_to_token_reference
from memcache.write_kernel import launch_write_req_to_token
from pinpool.bench.engine.uploader import Uploader
from sampling import TOP_K_ALL, SamplingParams


class PerFieldSamplingInfo:
    """The five sampling tensors of a running batch, each uploaded on its own."""

    def __init__(self, params: Sequence[SamplingParams], vocab_size: int, uploader: Uploader) -> None:
        self.vocab_size = vocab_size
        self.deterministic = True
        self.logit_bias: torch.Tensor | None = None
        self._params = list(params)
        temps, self.top_ps, self.top_ks, self.min_ps, seeds = uploader.upload(
            "sampling",
            [
                ([p.temperature for p in params], torch.float32),
                ([p.top_p for p in params], torch.float32),
                ([p.top_k for p in params], torch.int32),
                ([p.min_p for p in params], torch.float32),
                ([42 if p.seed is None else p.seed for p in params], torch.int64),
            ],
        )
        self.temperatures = temps.view(-1, 1)
        self.sampling_seed: torch.Tensor | None = seeds
        self._flags()

    def _flags(self) -> None:
        params = self._params
        self.is_all_greedy = all(p.top_k <= 1 for p in params)
        self.need_top_p_sampling = any(p.top_p != 1.0 for p in params)
        self.need_top_k_sampling = any(p.top_k != TOP_K_ALL for p in params)
        self.need_min_p_sampling = any(p.min_p > 0 for p in params)

    def __len__(self) -> int:
        return len(self._params)

    @property
    def device(self) -> torch.device:
        return self.top_ps.device

    def check_live(self) -> None:
        return None

    def filter_batch(self, keep: Sequence[int], keep_indices_device: torch.Tensor) -> None:
        self._params = [self._params[i] for i in keep]
        self.temperatures = self.temperatures.index_select(0, keep_indices_device)
        self.top_ps = self.top_ps.index_select(0, keep_indices_device)
        self.top_ks = self.top_ks.index_select(0, keep_indices_device)
        self.min_ps = self.min_ps.index_select(0, keep_indices_device)
        assert self.sampling_seed is not None
        self.sampling_seed = self.sampling_seed.index_select(0, keep_indices_device)
        self._flags()

    def merge_batch(self, other: PerFieldSamplingInfo) -> None:
        self._params += other._params
        self.temperatures = torch.cat([self.temperatures, other.temperatures])
        self.top_ps = torch.cat([self.top_ps, other.top_ps])
        self.top_ks = torch.cat([self.top_ks, other.top_ks])
        self.min_ps = torch.cat([self.min_ps, other.min_ps])
        assert self.sampling_seed is not None and other.sampling_seed is not None
        self.sampling_seed = torch.cat([self.sampling_seed, other.sampling_seed])
        self._flags()


def write_cache_per_field(
    out_cache_loc: torch.Tensor,
    rows: list[int],
    prefix_lens: list[int],
    seq_lens: list[int],
    extend_lens: list[int],
    prefix_tensors: list[torch.Tensor],
    rtt: ReqToTokenPool,
    uploader: Uploader,
) -> None:
    starts = np.concatenate([[0], np.cumsum(extend_lens)[:-1]]).astype(np.int64).tolist()  # sync-ok: numpy, host
    if rtt.device.type != "cuda":
        write_req_to_token_reference(
            rtt.req_to_token, rows, prefix_lens, seq_lens, starts, prefix_tensors, out_cache_loc
        )
        return
    pointers = [t.data_ptr() if p else 0 for t, p in zip(prefix_tensors, prefix_lens, strict=True)]
    fields: list[tuple[Any, torch.dtype]] = [(v, torch.int64) for v in (rows, prefix_lens, seq_lens, starts, pointers)]
    meta = torch.stack(uploader.upload("cache", fields))  # [5, bs] on the device
    launch_write_req_to_token(rtt.req_to_token, meta, out_cache_loc)
