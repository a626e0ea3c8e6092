"""``SamplingBatchInfo``: a batch's sampling tensors, staged through the pool in one copy.

Each request carries its packed 32-byte record (``sampling.params.RECORD_DTYPE``; for
sglang-named params, ``sampling.sglang_params`` packs it once and caches it). Building a
batch joins the records, writes them into a pool slot as contiguous columns
(``sampling.columns``) plus any sparse logit-bias entries (``sampling.logit_bias``), and
lands them in one copy. Flags are computed from the host copy of the records: no device
value is ever read back.

``from_schedule_batch(..., stage=st)`` builds into a stage the caller already holds open
instead: the batch then shares that stage's one copy (a ring stage), or is read in place
with no copy at all (a zero-copy stage, ``pool.stage(zero_copy=True)``). Such a batch lives
only for its stage (see ``from_schedule_batch``).
"""

from __future__ import annotations

from collections.abc import Sequence
from typing import Any, Protocol

import attrs
import numpy as np
import torch

from pinpool import DeviceMismatchError, PinnedRingBuffer, PoolStateError, Stage
from sampling import columns
from sampling.columns import Columns, Parts
from sampling.exceptions import BatchMismatchError
from sampling.host_records import check_bias_tokens, gather_records, same_device, take_rows
from sampling.logit_bias import BiasOf, SparseLogitBias, merged_block
from sampling.params import (
    FLAG_BIAS,
    FLAG_GREEDY,
    FLAG_MIN_P,
    FLAG_TOP_K,
    FLAG_TOP_P,
    RECORD_DTYPE,
    TOP_K_ALL,
    SamplingParams,
)


class RequestLike(Protocol):
    """A request: its ``sampling_params`` are pinpool's ``SamplingParams``, or an object with
    sglang's fields (``temperature``, ``top_p``, ``top_k``, ``min_p``, ``sampling_seed``,
    ``logit_bias``), such as sglang's own ``SamplingParams``."""

    @property
    def sampling_params(self) -> SamplingParams | Any: ...


class ScheduleBatchLike(Protocol):
    """What ``from_schedule_batch`` needs of a scheduler's batch."""

    @property
    def reqs(self) -> Sequence[RequestLike]: ...

    @property
    def device(self) -> torch.device | str: ...


@attrs.define(eq=False)
class SamplingBatchInfo:
    """Sampling tensors of a running batch; filtered and merged in place like sglang's."""

    #: int32 [6 * bs] on the device: the column block the tensors below view (``sampling.columns``).
    columns: torch.Tensor
    #: The host copy of the records (numpy, RECORD_DTYPE): flags come from here.
    host_records: np.ndarray[Any, Any]
    vocab_size: int
    deterministic: bool
    pool: PinnedRingBuffer
    #: Ring lease while the columns live in a pool slot; None once they are owned.
    lease: Stage | None = None
    #: Sparse (row, token, value) entries, or None when no row carries a bias.
    sparse_logit_bias: SparseLogitBias | None = None
    #: (OR, AND) of the rows' flag bits: given when the caller already reduced them, else
    #: reduced by ``_derive``; kept for the current row set (``merge_batch`` combines two).
    flag_bits: tuple[int, int] | None = attrs.field(default=None, repr=False)
    #: Built into a caller's stage (``from_schedule_batch(stage=...)``): ``lease`` is that
    #: stage, and the batch lives only for it (no filter or merge).
    stage_bound: bool = False
    temperatures: torch.Tensor = attrs.field(init=False)  # float32 [bs, 1], contiguous
    top_ps: torch.Tensor = attrs.field(init=False)  # float32 [bs], contiguous
    top_ks: torch.Tensor = attrs.field(init=False)  # int32 [bs], contiguous
    min_ps: torch.Tensor = attrs.field(init=False)  # float32 [bs], contiguous
    sampling_seed: torch.Tensor | None = attrs.field(init=False)  # int64 [bs] or None
    is_all_greedy: bool = attrs.field(init=False)
    is_any_greedy: bool = attrs.field(init=False)
    need_top_p_sampling: bool = attrs.field(init=False)
    need_top_k_sampling: bool = attrs.field(init=False)
    need_min_p_sampling: bool = attrs.field(init=False)
    _dense_bias: torch.Tensor | None = attrs.field(init=False, default=None, repr=False)
    #: ``columns`` cut into its five int32 pieces (``sampling.columns.Parts``), for ``merge_batch``.
    _parts: Parts = attrs.field(init=False, repr=False)

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
        stage: Stage | None = None,
    ) -> SamplingBatchInfo:
        """Stage ``batch``'s sampling parameters in one copy.

        ``owned=False`` leaves the tensors in a ring slot: valid for ``num_slots - 1`` further claims,
        no allocation. ``owned=True`` copies them (still one copy) into device memory the
        batch owns, for a batch that lives across decode steps (the pool's rule 4).

        ``stage``: an open stage of ``pool`` to build into instead of opening one; the
        batch's tensors are then that stage's views and the batch **lives only for that
        stage**:

        - a zero-copy stage (``pool.stage(zero_copy=True)``): no copy; launch every reader
          (the sampler, ``apply_logits_bias``, ``logit_bias``) *before the stage closes*.
          After close ``check_live`` (so the sampler) raises ``StaleLeaseError``;
        - a ring stage (``pool.stage()``): the values land with the stage's one copy, so
          launch readers after ``st.flush()`` or after close (earlier, ``check_live``
          raises ``PoolStateError``), within the ring's ``num_slots`` claims.

        ``filter_batch`` / ``merge_batch`` refuse such a batch. Not with ``owned=True``,
        nor with an owned stage (build an owned batch without ``stage`` instead).
        """
        if isinstance(vocab_size, bool) or not isinstance(vocab_size, int) or vocab_size < 1:
            raise BatchMismatchError(f"'vocab_size' must be an int >= 1 (got {vocab_size!r})")
        if batch.device != pool.device and not same_device(batch.device, pool.device):
            raise DeviceMismatchError(f"'batch.device' must be the pool's device {pool.device} (got {batch.device})")
        reqs = batch.reqs
        bs = len(reqs)
        if bs == 0:  # sglang's idle batch (ScheduleBatch.prepare_for_idle) builds from no requests
            if stage is not None:
                _check_stage(stage, pool, owned)
            return cls._empty(pool, vocab_size, deterministic)
        joined, bias_of = gather_records(reqs, deterministic)
        host_records = joined if isinstance(joined, np.ndarray) else np.frombuffer(joined, RECORD_DTYPE)
        flags = host_records["flags"]
        any_flags = int(np.bitwise_or.reduce(flags))
        bias_total = 0
        if any_flags & FLAG_BIAS:
            n_bias = host_records["n_bias"]
            bias_total = int(n_bias.sum())
            check_bias_tokens(host_records, vocab_size)
        if stage is not None:
            return cls._build_into(
                stage, pool, owned, joined, host_records, any_flags, bias_total, bias_of, vocab_size, deterministic
            )
        owned_bytes = None
        if owned:
            owned_bytes = bs * 4 * columns.COLUMN_WORDS + bias_total * 12 + 2 * pool.settings.alignment
        sparse = None
        with pool.stage(owned=owned_bytes) as st:
            host, block = st.reserve(columns.COLUMN_WORDS * bs, torch.int32, name="sampling columns")
            columns.write_columns(host, joined, bs)
            if bias_total:
                sparse = SparseLogitBias.stage(st, n_bias, bias_total, bias_of)
        return cls(
            block,
            host_records,
            vocab_size,
            deterministic,
            pool,
            lease=None if owned else st,
            sparse_logit_bias=sparse,
            flag_bits=(any_flags, int(np.bitwise_and.reduce(flags))),
        )

    @classmethod
    def _empty(cls, pool: PinnedRingBuffer, vocab_size: int, deterministic: bool) -> SamplingBatchInfo:
        """A batch of no requests, owned (nothing staged): ``merge_batch`` grows it, ``filter_batch([])`` keeps it."""
        block = torch.empty(0, dtype=torch.int32, device=pool.device)
        return cls(block, np.empty(0, RECORD_DTYPE), vocab_size, deterministic, pool)

    @classmethod
    def _build_into(
        cls,
        st: Stage,
        pool: PinnedRingBuffer,
        owned: bool,
        joined: bytes | np.ndarray[Any, Any],
        host_records: np.ndarray[Any, Any],
        any_flags: int,
        bias_total: int,
        bias_of: BiasOf,
        vocab_size: int,
        deterministic: bool,
    ) -> SamplingBatchInfo:
        """``from_schedule_batch`` into the caller's open stage ``st`` (its ``stage=`` path)."""
        _check_stage(st, pool, owned)
        bs = len(host_records)
        host, block = st.reserve(columns.COLUMN_WORDS * bs, torch.int32, name="sampling columns")
        columns.write_columns(host, joined, bs)
        sparse = None
        if bias_total:
            sparse = SparseLogitBias.stage(st, host_records["n_bias"], bias_total, bias_of)
        return cls(
            block,
            host_records,
            vocab_size,
            deterministic,
            pool,
            lease=st,
            sparse_logit_bias=sparse,
            flag_bits=(any_flags, int(np.bitwise_and.reduce(host_records["flags"]))),
            stage_bound=True,
        )

    # -- batch edits (no host sync) ----------------------------------------------------
    def filter_batch(
        self, keep_indices: Sequence[int] | np.ndarray[Any, Any], keep_indices_device: torch.Tensor | None = None
    ) -> None:
        """Keep the rows ``keep_indices`` (host ints), in that order.

        ``keep_indices_device``: the same indices already on the device (int64). Without it they
        are staged through the pool (one small copy). Rows with a logit bias cost one
        more copy: their entries, renumbered on the host, into memory the batch owns.
        """
        if self.stage_bound:
            self._refuse_edit("filter_batch")
        bs = len(self.host_records)
        keep, kept_records = take_rows(self.host_records, keep_indices)  # host only: checks the indices
        # Before anything is staged: staging claims a slot, and that claim may be the one
        # that recycles this batch's own (a ring batch is live for num_slots - 1 claims).
        self.check_live()
        if keep_indices_device is None and not keep.size:  # nothing kept: nothing to stage
            keep_indices_device = torch.zeros(0, dtype=torch.int64, device=self.columns.device)
        elif keep_indices_device is None:
            # A ring batch's columns stay in the ring's device mirror until the gather below
            # reads them; an owned stage never writes the mirror, so even a claim of the
            # batch's own slot leaves them intact. An owned batch takes a ring stage.
            owned_bytes = keep.nbytes if self.lease is not None else None  # keep is int64 (take_rows)
            with self.pool.stage(owned=owned_bytes) as st:
                keep_indices_device = st.put(keep, torch.int64, name="keep_indices")
        elif (
            keep_indices_device.dtype != torch.int64
            or keep_indices_device.shape != (keep.size,)
            or keep_indices_device.get_device() != self.columns.get_device()
        ):
            raise BatchMismatchError(
                f"'keep_indices_device' must be int64 shape ({keep.size},) on {self.columns.device} "
                f"(got {keep_indices_device.dtype} {tuple(keep_indices_device.shape)} on {keep_indices_device.device})"
            )
        # Everything that can raise (the bias copy opens a stage) comes before the first
        # assignment: a failed filter leaves the batch as it was, never half-changed.
        sparse = None
        if self.sparse_logit_bias is not None:
            block = self.sparse_logit_bias.filtered(self.host_records["n_bias"], keep)
            sparse = SparseLogitBias.land(self.pool, block)
        selected, *cut = columns.select_parts(self.columns, self._parts, bs, keep_indices_device)
        self.columns = selected
        self.host_records = kept_records
        self.sparse_logit_bias = sparse
        self.lease = None
        self.flag_bits = None  # the kept rows' bits are reduced anew
        self._derive(*cut)

    def merge_batch(self, other: SamplingBatchInfo) -> None:
        """Append ``other``'s rows after this batch's."""
        if self.stage_bound or other.stage_bound:
            self._refuse_edit("merge_batch")
        if other.vocab_size != self.vocab_size:
            raise BatchMismatchError(f"'other.vocab_size' must be {self.vocab_size} (got {other.vocab_size})")
        if other.deterministic != self.deterministic:
            raise BatchMismatchError("'other.deterministic' must match this batch's deterministic setting")
        if other.columns.device != self.columns.device:
            raise BatchMismatchError(f"'other' must be on {self.columns.device} (got {other.columns.device})")
        self.check_live()
        other.check_live()
        # As in filter_batch: what can raise comes before the first assignment.
        sparse = None
        if self.sparse_logit_bias is not None or other.sparse_logit_bias is not None:
            block = merged_block(self.sparse_logit_bias, len(self), other.sparse_logit_bias)
            sparse = SparseLogitBias.land(self.pool, block)
        # The joined rows' bits follow from the two batches' own: no pass over the records.
        assert self.flag_bits is not None and other.flag_bits is not None  # set by every _derive
        bits = (self.flag_bits[0] | other.flag_bits[0], self.flag_bits[1] & other.flag_bits[1])
        joined = columns.concat_parts(self._parts, other._parts)
        self.columns = joined
        # As bytes (numpy's concatenate of structured arrays re-derives their common dtype), into
        # a bytearray: writable records without a copy.
        self.host_records = np.frombuffer(
            bytearray().join((self.host_records.data, other.host_records.data)), RECORD_DTYPE
        )
        self.sparse_logit_bias = sparse
        self.lease = None
        self.flag_bits = bits
        self._derive()

    def apply_logits_bias(self, logits: torch.Tensor) -> torch.Tensor:
        """Add the logit bias to ``logits`` [bs, vocab] in place (one kernel); returns it."""
        if self.sparse_logit_bias is not None:
            if logits.shape != (len(self), self.vocab_size):
                raise BatchMismatchError(
                    f"'logits' must be shape ({len(self)}, {self.vocab_size}) (got {tuple(logits.shape)})"
                )
            self.check_live()
            self.sparse_logit_bias.apply(logits)
        return logits

    # -- sglang's derived fields -------------------------------------------------------
    @property
    def logit_bias(self) -> torch.Tensor | None:
        """sglang's dense float32 [bs, vocab] bias, or None: built on the device on first read.

        For code that reads sglang's field (speculative decoding); ``apply_logits_bias``
        and the ``Sampler`` use the sparse entries and never build it.
        """
        if self.sparse_logit_bias is None:
            return None
        if self._dense_bias is None:
            self.check_live()
            self._dense_bias = self.sparse_logit_bias.dense(len(self), self.vocab_size)
        return self._dense_bias

    @property
    def max_top_k(self) -> int | None:
        """sglang's bound on every row's top_k, or None when some row samples the whole vocabulary."""
        top_k = self.host_records["top_k"]
        return int(top_k.max()) if len(top_k) and bool((top_k < TOP_K_ALL).all()) else None

    # -- internals ---------------------------------------------------------------------
    def __len__(self) -> int:
        return len(self.host_records)

    @property
    def device(self) -> torch.device:
        return self.columns.device

    def check_live(self) -> None:
        """Raise ``StaleLeaseError`` if this batch's ring slot was recycled (owned batches never are),
        or, built into a caller's stage, if readers may no longer (zero-copy: closed) or not yet
        (ring stage: copy not issued) read it."""
        lease = self.lease
        if lease is not None:
            lease.check_live("SamplingBatchInfo")  # also refuses a caller's stage whose copy is not issued yet

    def _refuse_edit(self, what: str) -> None:
        raise PoolStateError(
            f"{what}() needs batches that outlive their stage (got one built into a caller's stage with "
            "'stage='; such a batch lives only for that stage): build the running batch with owned=True, "
            "and use stage= for per-step batches that are sampled and dropped inside the stage"
        )

    def _derive(self, parts: Parts | None = None, views: Columns | None = None) -> None:
        """Set the column views and flags from ``columns`` and ``host_records`` (``parts`` and
        ``views``: the columns' pieces and views, when the caller already cut them)."""
        bs = len(self.host_records)
        if parts is not None and views is not None:
            self._parts = parts
        elif self.lease is not None:
            self._parts, views = columns.ring_views(self.columns, bs, self.pool)
        else:
            self._parts, views = columns.parts_and_views(self.columns, bs)
        self.temperatures, self.top_ps, self.top_ks, self.min_ps, seeds = views
        self.sampling_seed = seeds if self.deterministic else None
        self._dense_bias = None
        if self.flag_bits is None:
            flags = self.host_records["flags"]
            self.flag_bits = (int(np.bitwise_or.reduce(flags)), int(np.bitwise_and.reduce(flags)))
        any_bits, all_bits = self.flag_bits
        self.is_all_greedy = bool(all_bits & FLAG_GREEDY)
        self.is_any_greedy = bool(any_bits & FLAG_GREEDY)
        self.need_top_p_sampling = bool(any_bits & FLAG_TOP_P)
        self.need_top_k_sampling = bool(any_bits & FLAG_TOP_K)
        self.need_min_p_sampling = bool(any_bits & FLAG_MIN_P)


def _check_stage(st: Stage, pool: PinnedRingBuffer, owned: bool) -> None:
    """Refuse a ``stage=`` that a batch cannot be built into (owned, another pool's, not open)."""
    if owned or st.owned:
        got = "owned=True" if owned else "an owned stage"
        raise PoolStateError(
            f"'stage' cannot be combined with owned memory (got {got}): a batch built into a caller's stage "
            "lives only for that stage; build a batch that outlives it with owned=True and no 'stage'"
        )
    if st.pool is not pool:
        if st.pool.device != pool.device:
            raise DeviceMismatchError(
                f"'stage' must be a stage of the pool on {pool.device} (got one on {st.pool.device})"
            )
        raise PoolStateError(
            "'stage' must be a stage of 'pool' (got a stage of another pool): open it with pool.stage(...)"
        )
    if st.flushed or not st.is_open:
        state = "flushed" if st.is_open else "closed"
        raise PoolStateError(
            f"'stage' must be open and not yet flushed (got stage {st.generation}, {st.__class__.__name__}, "
            f"{state}): build the batch before st.flush(), inside the stage"
        )
