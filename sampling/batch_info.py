"""``SamplingBatchInfo``: a batch's sampling tensors, staged through the pool in one copy.

The per-request tensors are column views of one ``[bs, 32]`` byte matrix of packed
records (``sampling.params.RECORD_DTYPE``). Building a batch joins the requests'
precomputed records, memmoves them into a pool slot, and lands them (with any logit-bias
entries) in one copy. Flags are computed from the host copy of the records: no device
value is ever read back.
"""

from __future__ import annotations

from collections.abc import Sequence
from typing import Any, Protocol, cast

import attrs
import numpy as np
import torch

from pinpool import DeviceMismatchError, PinnedRingBuffer, Stage
from sampling.exceptions import BatchMismatchError
from sampling.params import RECORD_DTYPE, TOP_K_ALL, SamplingParams

RECORD_BYTES = RECORD_DTYPE.itemsize
# Byte offsets of the record's columns, as element indices of each dtype view.
_OFFSETS = {name: spec[1] for name, spec in (RECORD_DTYPE.fields or {}).items()}
_F32 = {name: _OFFSETS[name] // 4 for name in ("temperature", "top_p", "min_p")}
_TOP_K_I32 = _OFFSETS["top_k"] // 4
_SEED_I64 = _OFFSETS["seed"] // 8


class RequestLike(Protocol):
    @property
    def sampling_params(self) -> SamplingParams: ...


class ScheduleBatchLike(Protocol):
    """What ``from_schedule_batch`` needs of a scheduler's batch."""

    @property
    def reqs(self) -> Sequence[RequestLike]: ...

    @property
    def device(self) -> torch.device | str: ...


@attrs.define(eq=False)
class SamplingBatchInfo:
    """Sampling tensors of a running batch; filtered and merged in place like sglang's."""

    #: uint8 [bs, 32] on the device: the packed records the column views below read.
    records: torch.Tensor
    #: The host copy of the same records (numpy, RECORD_DTYPE): flags come from here.
    host_records: np.ndarray[Any, Any]
    vocab_size: int
    deterministic: bool
    pool: PinnedRingBuffer
    #: Ring lease while the records live in a pool slot; None once they are owned.
    lease: Stage | None = None
    #: float32 [bs, vocab_size] or None.
    logit_bias: torch.Tensor | None = None
    temperatures: torch.Tensor = attrs.field(init=False)  # float32 [bs, 1]
    top_ps: torch.Tensor = attrs.field(init=False)  # float32 [bs]
    top_ks: torch.Tensor = attrs.field(init=False)  # int32 [bs]
    min_ps: torch.Tensor = attrs.field(init=False)  # float32 [bs]
    sampling_seed: torch.Tensor | None = attrs.field(init=False)  # int64 [bs] or None
    is_all_greedy: bool = attrs.field(init=False)
    need_top_p_sampling: bool = attrs.field(init=False)
    need_top_k_sampling: bool = attrs.field(init=False)
    need_min_p_sampling: bool = attrs.field(init=False)

    def __attrs_post_init__(self) -> None:
        self._derive()

    # -- construction ------------------------------------------------------------------
    @classmethod
    def from_schedule_batch(
        cls,
        batch: ScheduleBatchLike,
        vocab_size: int,
        pool: PinnedRingBuffer,
        *,
        owned: bool = False,
        deterministic: bool = False,
    ) -> SamplingBatchInfo:
        """Stage ``batch``'s sampling parameters in one copy.

        ``owned=False`` leaves the tensors in a ring slot: valid for ``num_slots`` stages,
        no allocation. ``owned=True`` copies them (still one copy) into device memory the
        batch owns, for a batch that lives across decode steps (design invariant 5).
        """
        reqs = batch.reqs
        bs = len(reqs)
        if bs == 0:
            raise BatchMismatchError("'batch.reqs' must hold at least one request (got 0)")
        if isinstance(vocab_size, bool) or not isinstance(vocab_size, int) or vocab_size < 1:
            raise BatchMismatchError(f"'vocab_size' must be an int >= 1 (got {vocab_size!r})")
        if torch.device(batch.device) != pool.device:
            raise DeviceMismatchError(f"'batch.device' must be the pool's device {pool.device} (got {batch.device})")
        joined = b"".join([r.sampling_params.record for r in reqs])
        host_records = np.frombuffer(joined, RECORD_DTYPE)
        n_bias = host_records["n_bias"]
        bias_total = int(n_bias.sum())
        if bias_total:
            _check_bias_tokens(host_records, vocab_size)
        owned_bytes = None
        if owned:
            owned_bytes = bs * RECORD_BYTES + bias_total * 12 + 2 * pool.settings.alignment
        with pool.stage(owned_bytes=owned_bytes) as st:
            records = st.put(joined, torch.uint8, name="sampling records").view(bs, RECORD_BYTES)
            if bias_total:
                flat_index, bias_values = _stage_bias(st, reqs, n_bias, bias_total, vocab_size)
        logit_bias = None
        if bias_total:
            logit_bias = torch.zeros(bs, vocab_size, dtype=torch.float32, device=pool.device)
            logit_bias.view(-1).index_put_((flat_index,), bias_values, accumulate=True)
        return cls(
            records,
            host_records,
            vocab_size,
            deterministic,
            pool,
            lease=None if owned else st,
            logit_bias=logit_bias,
        )

    # -- batch edits (no host sync) ----------------------------------------------------
    def filter_batch(
        self, keep_indices: Sequence[int] | np.ndarray[Any, Any], keep_device: torch.Tensor | None = None
    ) -> None:
        """Keep the rows ``keep_indices`` (host ints), in that order.

        ``keep_device``: the same indices already on the device (int64). Without it they
        are staged through the pool (one small copy).
        """
        keep = np.asarray(keep_indices, dtype=np.int64).reshape(-1)
        bs = len(self.host_records)
        if keep.size == 0 or keep.min() < 0 or keep.max() >= bs:
            raise BatchMismatchError(f"'keep_indices' must be non-empty and in [0, {bs}) (got {keep.tolist()[:8]})")
        if keep_device is None:
            with self.pool.stage() as st:
                keep_device = st.put(keep, torch.int64, name="keep_indices")
        elif keep_device.device != self.records.device or keep_device.shape != (keep.size,):
            raise BatchMismatchError(
                f"'keep_device' must be shape ({keep.size},) on {self.records.device} "
                f"(got {tuple(keep_device.shape)} on {keep_device.device})"
            )
        self._check_lease()
        self.records = self.records.index_select(0, keep_device)
        self.host_records = self.host_records[keep]
        if self.logit_bias is not None:
            # The host records say whether any kept row still carries a bias: drop the
            # dense matrix (and its kernel per step) when none does.
            has_bias = bool(self.host_records["n_bias"].any())
            self.logit_bias = self.logit_bias.index_select(0, keep_device) if has_bias else None
        self.lease = None
        self._derive()

    def merge_batch(self, other: SamplingBatchInfo) -> None:
        """Append ``other``'s rows after this batch's."""
        if other.vocab_size != self.vocab_size:
            raise BatchMismatchError(f"'other.vocab_size' must be {self.vocab_size} (got {other.vocab_size})")
        if other.deterministic != self.deterministic:
            raise BatchMismatchError("'other.deterministic' must match this batch's deterministic setting")
        if other.records.device != self.records.device:
            raise BatchMismatchError(f"'other' must be on {self.records.device} (got {other.records.device})")
        self._check_lease()
        other._check_lease()
        if self.logit_bias is not None or other.logit_bias is not None:
            self.logit_bias = torch.cat([self._dense_bias(), other._dense_bias()])
        self.records = torch.cat([self.records, other.records])
        self.host_records = np.concatenate([self.host_records, other.host_records])
        self.lease = None
        self._derive()

    def apply_logits_bias(self, logits: torch.Tensor) -> torch.Tensor:
        """Add the logit bias to ``logits`` [bs, vocab] in place (one kernel); returns it."""
        if self.logit_bias is not None:
            if logits.shape != self.logit_bias.shape:
                raise BatchMismatchError(
                    f"'logits' must be shape {tuple(self.logit_bias.shape)} (got {tuple(logits.shape)})"
                )
            logits.add_(self.logit_bias)
        return logits

    # -- internals ---------------------------------------------------------------------
    def __len__(self) -> int:
        return len(self.host_records)

    def _check_lease(self) -> None:
        if self.lease is not None:
            self.lease.check_live("SamplingBatchInfo")

    def _dense_bias(self) -> torch.Tensor:
        if self.logit_bias is not None:
            return self.logit_bias
        return torch.zeros(len(self), self.vocab_size, dtype=torch.float32, device=self.records.device)

    def _derive(self) -> None:
        f32 = self.records.view(torch.float32)
        self.temperatures = f32[:, _F32["temperature"] : _F32["temperature"] + 1]
        self.top_ps = f32[:, _F32["top_p"]]
        self.min_ps = f32[:, _F32["min_p"]]
        self.top_ks = self.records.view(torch.int32)[:, _TOP_K_I32]
        self.sampling_seed = self.records.view(torch.int64)[:, _SEED_I64] if self.deterministic else None
        host = self.host_records
        top_k = host["top_k"]
        self.is_all_greedy = bool((top_k <= 1).all())
        self.need_top_p_sampling = bool((host["top_p"] != 1.0).any())
        self.need_top_k_sampling = bool((top_k != TOP_K_ALL).any())
        self.need_min_p_sampling = bool((host["min_p"] > 0).any())


def _check_bias_tokens(host_records: np.ndarray[Any, Any], vocab_size: int) -> None:
    over = np.nonzero(host_records["bias_max_token"] >= vocab_size)[0]
    if over.size:
        i = int(over[0])
        raise BatchMismatchError(
            f"'logit_bias' token ids must be < vocab_size {vocab_size} "
            f"(got {int(host_records['bias_max_token'][i])} in request {i})"
        )


def _stage_bias(
    st: Stage, reqs: Sequence[RequestLike], n_bias: np.ndarray[Any, Any], total: int, vocab_size: int
) -> tuple[torch.Tensor, torch.Tensor]:
    index_raw, index_device = st.reserve(total, torch.int64, name="logit_bias index")
    value_raw, value_device = st.reserve(total, torch.float32, name="logit_bias values")
    index_host, value_host = cast(np.ndarray[Any, Any], index_raw), cast(np.ndarray[Any, Any], value_raw)
    at = 0
    for i in np.nonzero(n_bias)[0].tolist():  # only the requests that carry a bias
        bias = reqs[i].sampling_params.logit_bias
        assert bias is not None
        tokens, values = bias
        n = len(tokens)
        index_host[at : at + n] = tokens
        index_host[at : at + n] += i * vocab_size
        value_host[at : at + n] = values
        at += n
    return index_device, value_device
