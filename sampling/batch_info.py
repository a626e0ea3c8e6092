"""``SamplingBatchInfo``: a batch's sampling tensors, staged through the pool in one copy.

The per-request tensors are column views of one ``[bs * 32]`` byte block of packed
records (``sampling.params.RECORD_DTYPE``). Building a batch joins the requests'
precomputed records, memmoves them into a pool slot, and lands them (with any logit-bias
entries) in one copy. Flags are computed from the host copy of the records: no device
value is ever read back.
"""

from __future__ import annotations

import weakref
from collections.abc import Sequence
from typing import Any, Protocol

import attrs
import numpy as np
import torch

from pinpool import DeviceMismatchError, PinnedRingBuffer, Stage
from sampling.exceptions import BatchMismatchError
from sampling.params import (
    FLAG_BIAS,
    FLAG_GREEDY,
    FLAG_MIN_P,
    FLAG_TOP_K,
    FLAG_TOP_P,
    RECORD_DTYPE,
    SamplingParams,
)

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

    #: uint8 [bs * 32] on the device: the packed records the column views below read.
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
    #: (OR, AND) of the rows' flag bits when the caller already reduced them.
    flag_bits: tuple[int, int] | None = attrs.field(default=None, repr=False)
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
        if batch.device != pool.device and not _same_device(batch.device, pool.device):
            raise DeviceMismatchError(f"'batch.device' must be the pool's device {pool.device} (got {batch.device})")
        joined = b"".join([r.sampling_params.record for r in reqs])
        host_records = np.frombuffer(joined, RECORD_DTYPE)
        flags = host_records["flags"]
        any_flags = int(np.bitwise_or.reduce(flags))
        bias_total = 0
        if any_flags & FLAG_BIAS:
            n_bias = host_records["n_bias"]
            bias_total = int(n_bias.sum())
            _check_bias_tokens(host_records, vocab_size)
        owned_bytes = None
        if owned:
            owned_bytes = bs * RECORD_BYTES + bias_total * 12 + 2 * pool.settings.alignment
        with pool.stage(owned_bytes=owned_bytes) as st:
            records_host, records = st.reserve(bs * RECORD_BYTES, torch.uint8, name="sampling records")
            records_host[:] = np.frombuffer(joined, np.uint8)  # one memmove of the joined records
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
            flag_bits=(any_flags, int(np.bitwise_and.reduce(flags))),
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
            got = keep.tolist()[:8]  # sync-ok: numpy host array, no device read
            raise BatchMismatchError(f"'keep_indices' must be non-empty and in [0, {bs}) (got {got})")
        if keep_device is None:
            with self.pool.stage() as st:
                keep_device = st.put(keep, torch.int64, name="keep_indices")
        elif keep_device.device != self.records.device or keep_device.shape != (keep.size,):
            raise BatchMismatchError(
                f"'keep_device' must be shape ({keep.size},) on {self.records.device} "
                f"(got {tuple(keep_device.shape)} on {keep_device.device})"
            )
        self.check_live()
        self.records = self.records.view(-1, RECORD_BYTES).index_select(0, keep_device).view(-1)
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
        self.check_live()
        other.check_live()
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

    @property
    def device(self) -> torch.device:
        return self.records.device

    def check_live(self) -> None:
        """Raise ``StaleLeaseError`` if this batch's ring slot was recycled (owned batches never are)."""
        if self.lease is not None:
            self.lease.check_live("SamplingBatchInfo")

    def _dense_bias(self) -> torch.Tensor:
        if self.logit_bias is not None:
            return self.logit_bias
        return torch.zeros(len(self), self.vocab_size, dtype=torch.float32, device=self.records.device)

    def _derive(self) -> None:
        bs = len(self.host_records)
        columns = _column_views(self.records, bs, self.pool if self.lease is not None else None)
        self.temperatures, self.top_ps, self.top_ks, self.min_ps, seeds = columns
        self.sampling_seed = seeds if self.deterministic else None
        if self.flag_bits is None:
            flags = self.host_records["flags"]
            self.flag_bits = (int(np.bitwise_or.reduce(flags)), int(np.bitwise_and.reduce(flags)))
        any_bits, all_bits = self.flag_bits
        self.flag_bits = None  # valid for this row set only; recomputed after filter/merge
        self.is_all_greedy = bool(all_bits & FLAG_GREEDY)
        self.need_top_p_sampling = bool(any_bits & FLAG_TOP_P)
        self.need_top_k_sampling = bool(any_bits & FLAG_TOP_K)
        self.need_min_p_sampling = bool(any_bits & FLAG_MIN_P)


_Columns = tuple[torch.Tensor, torch.Tensor, torch.Tensor, torch.Tensor, torch.Tensor]
# Ring-staged records of the same batch size land at the same slot offsets lap after
# lap: the column views of that memory are the same, so they are built once. Keyed by
# the records' address and batch size; only ring memory (owned by the pool for its whole
# life) is cached, never owned buffers, whose addresses the allocator reuses.
# The cache lives as long as its pool (weak key), so a closed pool's mirror is not pinned.
_RING_COLUMNS: weakref.WeakKeyDictionary[PinnedRingBuffer, dict[tuple[int, int], _Columns]] = (
    weakref.WeakKeyDictionary()
)
_RING_COLUMNS_LIMIT = 256


def _column_views(records: torch.Tensor, bs: int, pool: PinnedRingBuffer | None) -> _Columns:
    cache = None
    if pool is not None:
        cache = _RING_COLUMNS.get(pool)
        if cache is None:
            cache = _RING_COLUMNS[pool] = {}
        key = (records.data_ptr(), bs)
        hit = cache.get(key)
        if hit is not None:
            return hit
    f32 = records.view(torch.float32).view(bs, RECORD_BYTES // 4)
    columns = (
        f32[:, _F32["temperature"] : _F32["temperature"] + 1],
        f32[:, _F32["top_p"]],
        records.view(torch.int32).view(bs, RECORD_BYTES // 4)[:, _TOP_K_I32],
        f32[:, _F32["min_p"]],
        records.view(torch.int64).view(bs, RECORD_BYTES // 8)[:, _SEED_I64],
    )
    if cache is not None:
        if len(cache) >= _RING_COLUMNS_LIMIT:
            cache.clear()
        cache[key] = columns
    return columns


def _check_bias_tokens(host_records: np.ndarray[Any, Any], vocab_size: int) -> None:
    over = np.nonzero(host_records["bias_max_token"] >= vocab_size)[0]  # sync-ok: numpy, host records
    if over.size:
        i = int(over[0])
        raise BatchMismatchError(
            f"'logit_bias' token ids must be < vocab_size {vocab_size} "
            f"(got {int(host_records['bias_max_token'][i])} in request {i})"
        )


def _stage_bias(
    st: Stage, reqs: Sequence[RequestLike], n_bias: np.ndarray[Any, Any], total: int, vocab_size: int
) -> tuple[torch.Tensor, torch.Tensor]:
    index_host, index_device = st.reserve(total, torch.int64, name="logit_bias index")
    value_host, value_device = st.reserve(total, torch.float32, name="logit_bias values")
    at = 0
    for i in np.nonzero(n_bias)[0].tolist():  # sync-ok: numpy host records; only requests with a bias
        bias = reqs[i].sampling_params.logit_bias
        assert bias is not None
        tokens, values = bias
        n = len(tokens)
        index_host[at : at + n] = tokens
        index_host[at : at + n] += i * vocab_size
        value_host[at : at + n] = values
        at += n
    return index_device, value_device


def _same_device(value: torch.device | str, device: torch.device) -> bool:
    """Whether ``value`` (a scheduler's device, maybe a string) names ``device``.

    sglang's ``ScheduleBatch.device`` is the string ``"cuda"``: it means the current CUDA
    device, as it does for a torch allocation, so it matches ``cuda:<current>``.
    """
    try:
        named = torch.device(value)
    except (RuntimeError, TypeError):
        return False
    if named.type == "cuda" and named.index is None and device.type == "cuda":
        return torch.cuda.is_available() and torch.cuda.current_device() == device.index
    return named == device
