"""A batch's logit bias as sparse (row, token, value) entries, kept in row order.

The entries ride in the batch's one copy as an int32 ``[3, n]`` block (rows, token ids,
value bits); ``apply`` adds them to the logits with one kernel (``sampling.bias_kernel``).
A private host copy of the block lets ``filter`` and ``merge`` rebuild the entries with
numpy (no device read), then land them with one owned copy. Entries stay grouped by
row in row order: ``filter`` finds a row's entries by offset from the per-row counts.
"""

from __future__ import annotations

import os
from collections.abc import Callable, Sequence
from typing import Any

import attrs
import numpy as np
import torch

from pinpool import PinnedRingBuffer, Stage
from sampling.bias_kernel import apply_logit_bias_reference, launch_apply_logit_bias

#: (token ids, values) of one request, as ``SamplingParams.logit_bias`` holds them.
BiasOf = Callable[[int], "tuple[Sequence[int], Sequence[float]] | None"]


def _use_kernel(device: torch.device) -> bool:
    # Triton needs a GPU, or its interpreter on CPU tensors (TRITON_INTERPRET=1).
    return device.type == "cuda" or os.environ.get("TRITON_INTERPRET") == "1"


@attrs.define(eq=False)
class SparseLogitBias:
    #: int32 [3, n] host copy: rows, token ids, float32 value bits.
    host: np.ndarray[Any, Any]
    #: int32 [3 * n] on the device: the same block.
    device: torch.Tensor

    def __len__(self) -> int:
        return int(self.host.shape[1])

    @property
    def rows(self) -> torch.Tensor:
        return self.device[: len(self)]

    @property
    def tokens(self) -> torch.Tensor:
        n = len(self)
        return self.device[n : 2 * n]

    @property
    def values(self) -> torch.Tensor:
        n = len(self)
        return self.device[2 * n :].view(torch.float32)

    def apply(self, logits: torch.Tensor) -> torch.Tensor:
        """Add the entries to ``logits`` [bs, vocab] in place (one launch); returns it."""
        launch = launch_apply_logit_bias if _use_kernel(logits.device) else apply_logit_bias_reference
        return launch(logits, self.rows, self.tokens, self.values)

    def dense(self, bs: int, vocab_size: int) -> torch.Tensor:
        """float32 [bs, vocab_size] on the device: sglang's ``logit_bias`` field, built there."""
        return self.apply(torch.zeros(bs, vocab_size, dtype=torch.float32, device=self.device.device))

    # -- building ----------------------------------------------------------------------
    @staticmethod
    def stage(st: Stage, n_bias: np.ndarray[Any, Any], total: int, bias_of: BiasOf) -> SparseLogitBias:
        """Write every request's entries into ``st`` (rows in order); nothing is copied yet."""
        host, device = st.reserve(3 * total, torch.int32, name="logit_bias entries")
        block = host.reshape(3, total)
        rows = np.flatnonzero(n_bias)  # sync-ok: numpy host records
        tokens: list[int] = []
        values: list[float] = []
        for i in rows.tolist():  # sync-ok: numpy host array; only requests with a bias
            bias = bias_of(i)
            assert bias is not None  # n_bias > 0 for this row
            t, v = bias
            tokens += t
            values += v
        block[0] = np.repeat(rows, n_bias[rows])
        block[1] = tokens
        block[2].view(np.float32)[:] = values
        return SparseLogitBias(block.copy(), device)

    @staticmethod
    def land(pool: PinnedRingBuffer, block: np.ndarray[Any, Any]) -> SparseLogitBias | None:
        """Copy a host ``[3, n]`` block into device memory the batch owns (one copy)."""
        n = block.shape[1]
        if n == 0:
            return None
        with pool.stage(owned=12 * n + 2 * pool.settings.alignment) as st:
            device = st.put(block.reshape(-1), torch.int32, name="logit_bias entries")
        return SparseLogitBias(block, device)

    def filtered(self, n_bias: np.ndarray[Any, Any], keep: np.ndarray[Any, Any]) -> np.ndarray[Any, Any]:
        """The host block of the rows ``keep`` (in that order, repeats allowed), renumbered.

        ``n_bias``: entries per row of the batch before filtering.
        """
        starts = np.zeros(len(n_bias) + 1, dtype=np.int64)
        np.cumsum(n_bias, out=starts[1:])
        counts = n_bias[keep].astype(np.int64)
        total = int(counts.sum())
        first = np.zeros(len(keep), dtype=np.int64)
        np.cumsum(counts[:-1], out=first[1:])
        # Entry j of new row r sits at starts[keep[r]] + j: one repeat, one arange.
        pick = np.repeat(starts[keep] - first, counts) + np.arange(total)
        out = self.host[:, pick]
        out[0] = np.repeat(np.arange(len(keep), dtype=np.int32), counts)
        return out


def merged_block(a: SparseLogitBias | None, a_rows: int, b: SparseLogitBias | None) -> np.ndarray[Any, Any]:
    """The host block of batch a's rows followed by batch b's (b's rows shifted by ``a_rows``)."""
    parts = []
    if a is not None:
        parts.append(a.host)
    if b is not None:
        shifted = b.host.copy()
        shifted[0] += a_rows
        parts.append(shifted)
    return np.concatenate(parts, axis=1) if parts else np.zeros((3, 0), np.int32)
