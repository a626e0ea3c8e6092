"""A batch's host records: read from its requests, and the host side of its edits.

``gather_records`` reads each request's ``sampling_params`` (pinpool's own, whose records
are packed at construction, or sglang-named ones, packed here on first sight);
``keep_array``, ``take_rows``, ``check_bias_tokens`` and ``same_device`` check what a build and
``filter_batch`` take.
"""

from __future__ import annotations

from collections.abc import Sequence
from operator import attrgetter
from typing import Any

import numpy as np
import torch

from sampling.exceptions import BatchMismatchError
from sampling.logit_bias import BiasOf
from sampling.params import SamplingParams
from sampling.sglang_params import pack_foreign

_PARAMS = attrgetter("sampling_params")
_RECORD = attrgetter("record")


def gather_records(reqs: Sequence[Any], seeds: bool) -> tuple[bytes | np.ndarray[Any, Any], BiasOf]:
    """The requests' records (joined bytes, or a RECORD_DTYPE array), and where to find request i's
    (token ids, values). ``seeds=False``: sglang-named params' seeds are left unread."""
    try:
        params = list(map(_PARAMS, reqs))
    except AttributeError:
        i = next(i for i, r in enumerate(reqs) if not hasattr(r, "sampling_params"))
        raise BatchMismatchError(
            f"'batch.reqs[{i}]' must be a request with a 'sampling_params' attribute (got {type(reqs[i]).__name__})"
        ) from None
    if type(params[0]) is SamplingParams:
        try:
            joined = b"".join(map(_RECORD, params))
        except AttributeError:  # a mixed batch: some requests carry sglang's params
            pass
        else:
            return joined, lambda i: params[i].logit_bias
    records, biases = pack_foreign(params, seeds=seeds)
    return records, biases.get


def keep_array(keep_indices: Sequence[int] | np.ndarray[Any, Any]) -> np.ndarray[Any, Any]:
    """``keep_indices`` as a flat int64 array; a scheduler's list of ints converts at C speed."""
    if type(keep_indices) is list and list(map(type, keep_indices)).count(int) == len(keep_indices):  # no bools
        try:
            return np.fromiter(keep_indices, np.int64, len(keep_indices))
        except OverflowError:  # beyond int64: numpy says what they are below
            pass
    raw = np.asarray(keep_indices)
    if raw.size and raw.dtype.kind not in "iu":
        # A float would be truncated and a bool mask read as indices 0 and 1: wrong rows, silently.
        raise BatchMismatchError(f"'keep_indices' must be integer row indices (got dtype {raw.dtype})")
    return raw.astype(np.int64, copy=False).reshape(-1)


def take_rows(
    host_records: np.ndarray[Any, Any], keep_indices: Sequence[int] | np.ndarray[Any, Any]
) -> tuple[np.ndarray[Any, Any], np.ndarray[Any, Any]]:
    """(``keep_indices`` as a flat integer array, the records of those rows), or
    ``BatchMismatchError`` for an index that is no int or not in [0, len(host_records)).
    Host only: nothing is staged. The indices come back as int64 (converted exactly: a
    narrower dtype would wrap a bad index into a valid one on numpy 1.x)."""
    keep = keep_array(keep_indices)
    # One bound check: a negative index read as unsigned is past any batch size.
    if keep.size and int(np.maximum.reduce(keep.view(np.uint64))) >= len(host_records):
        raise _out_of_range(keep, len(host_records))
    return keep, host_records.take(keep)  # take: a fifth of fancy indexing's cost on records


def _out_of_range(keep: np.ndarray[Any, Any], bs: int) -> BatchMismatchError:
    got = keep.tolist()[:8]  # sync-ok: numpy host array, no device read
    return BatchMismatchError(f"'keep_indices' must be in [0, {bs}) (got {got})")


def check_bias_tokens(host_records: np.ndarray[Any, Any], vocab_size: int) -> None:
    over = np.nonzero(host_records["bias_max_token"] >= vocab_size)[0]  # sync-ok: numpy, host records
    if over.size:
        i = int(over[0])
        raise BatchMismatchError(
            f"'logit_bias' token ids must be < vocab_size {vocab_size} "
            f"(got {int(host_records['bias_max_token'][i])} in request {i})"
        )


def same_device(value: torch.device | str, device: torch.device) -> bool:
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
