"""Sampling inside a captured CUDA graph: the batch's tensors at fixed addresses, one code path.

Why. A captured graph replays the kernels it recorded, reading the addresses it saw at
capture, and it replays one path: a branch the host took while capturing (greedy or not,
top-p on or off) is frozen into the graph. A ``SamplingBatchInfo`` fits neither rule: its
tensors live in whichever ring slot (or owned buffer) the step's copy used, and its
``need_*`` flags and ``is_all_greedy`` follow the batch at hand. ``StaticSamplingInfo``
reads the five per-request fields from views of a ``pinpool.DeviceBlock`` (the same
tensors every step, restaged in place by one copy), and fixes the path: deterministic,
every filter flag on, never the all-greedy shortcut, no logit bias.

One path serves every batch because the sampler is batch-independent (``sampling.draw``):
a row with top_p 1, top_k ``TOP_K_ALL`` or min_p 0 keeps every token with that filter on,
so a row's token never depends on the flags its neighbours would have set. Greedy rows are
stored as temperature 1 and top_k 1 (``SamplingParams`` and ``pack_foreign`` normalise them
so): they take the same softmax, sort and draw as every other row, and the draw keeps only
their top token. Padding rows hold the fields' ``pad`` values (temperature 1, top_p 1,
top_k ``TOP_K_ALL``, min_p 0, seed ``DEFAULT_SEED``): a plain seeded draw whose token the
engine ignores.

Per engine::

    block = DeviceBlock(pool, Layout([*SAMPLING_FIELDS, *engine_fields], max_rows))
    info = StaticSamplingInfo(block.views(rows), rows, vocab_size)   # once per graph size
    # capture: tokens = Sampler()(logits_static, info, block.views(rows)["positions"])

and each step, for the live requests' records (``b"".join(p.record for p in params)``, or
``pack_foreign``'s array for sglang-named params)::

    cols = sampling_columns(records)           # when the batch changes; cache it
    with block.stage(rows, live) as st:
        for name, values in cols.items():
            st.put(name, values)
        st.put("positions", positions)
    graph.replay()

Refused: logit bias. Its entries vary in number per step (a sparse kernel over a
data-dependent count, or a dense [bs, vocab] add), which a fixed graph does not capture;
``sampling_columns`` raises ``BatchMismatchError`` for a record carrying one. Run such a
batch eagerly, with a ``SamplingBatchInfo``.

Eager and graph tokens agree row for row with a deterministic ``SamplingBatchInfo`` of the
live requests, with one corner: an *all-greedy* eager batch takes ``argmax`` of the logits,
where the graph takes the top token of softmax(logits / 1). They differ only where the two
largest logits are so close that their float32 probabilities are equal (then the graph's
stable sort picks the smaller token id).
"""

from __future__ import annotations

from collections.abc import Mapping
from typing import TYPE_CHECKING, Any

import numpy as np
import torch

from pinpool import Field
from pinpool.encode import NUMPY_DTYPE
from sampling.exceptions import BatchMismatchError
from sampling.params import DEFAULT_SEED, FLAG_BIAS, RECORD_DTYPE, TOP_K_ALL

if TYPE_CHECKING:
    from sampling.draw import SamplingTensors

#: The sampling fields of a ``DeviceBlock`` layout: an engine adds its own fields to these.
#: Padding rows hold a neutral seeded draw (module doc).
SAMPLING_FIELDS: tuple[Field, ...] = (
    Field("temperature", torch.float32, 1.0),
    Field("top_p", torch.float32, 1.0),
    Field("top_k", torch.int32, TOP_K_ALL),
    Field("min_p", torch.float32, 0.0),
    Field("seed", torch.int64, DEFAULT_SEED),
)

_RECORD_BYTES = RECORD_DTYPE.itemsize
_FLAGS_OFFSET: int = RECORD_DTYPE.fields["flags"][1]  # type: ignore[index]
_SEED_OFFSET: int = RECORD_DTYPE.fields["seed"][1]  # type: ignore[index]
# temperature, top_p, top_k, min_p are the record's first four 32-bit words (one transposed copy below).
assert [RECORD_DTYPE.fields[f.name][1] for f in SAMPLING_FIELDS] == [0, 4, 8, 12, 16]  # type: ignore[index]


class StaticSamplingInfo:
    """The ``SamplingTensors`` of a padded batch of ``rows`` rows, read from fixed device views.

    ``views``: name -> 1-D device tensor of ``rows`` elements holding at least the
    ``SAMPLING_FIELDS`` (what ``DeviceBlock.views(rows)`` returns; other fields are
    ignored). The tensors below *are* those views (``temperatures`` viewed as [rows, 1]),
    so a graph captured with this info reads whatever the block's latest stage landed.
    """

    __slots__ = (
        "deterministic",
        "is_all_greedy",
        "min_ps",
        "need_min_p_sampling",
        "need_top_k_sampling",
        "need_top_p_sampling",
        "rows",
        "sampling_seed",
        "temperatures",
        "top_ks",
        "top_ps",
        "vocab_size",
    )

    def __init__(self, views: Mapping[str, torch.Tensor], rows: int, vocab_size: int) -> None:
        if isinstance(rows, bool) or not isinstance(rows, int) or rows < 1:
            raise BatchMismatchError(f"'rows' must be an int >= 1 (got {rows!r})")
        if isinstance(vocab_size, bool) or not isinstance(vocab_size, int) or vocab_size < 1:
            raise BatchMismatchError(f"'vocab_size' must be an int >= 1 (got {vocab_size!r})")
        if not isinstance(views, Mapping):
            raise BatchMismatchError(
                f"'views' must be a mapping of field name to tensor, as DeviceBlock.views(rows) returns "
                f"(got {type(views).__name__})"
            )
        missing = [f.name for f in SAMPLING_FIELDS if f.name not in views]
        if missing:
            raise BatchMismatchError(
                f"'views' must hold every sampling field {[f.name for f in SAMPLING_FIELDS]} (missing: {missing}); "
                "declare the block with SAMPLING_FIELDS"
            )
        device: torch.device | None = None
        for f in SAMPLING_FIELDS:
            t = views[f.name]
            if not isinstance(t, torch.Tensor):
                raise BatchMismatchError(f"'views[{f.name!r}]' must be a tensor (got {type(t).__name__})")
            if t.dtype != f.dtype or t.dim() != 1 or not t.is_contiguous():
                raise BatchMismatchError(
                    f"'views[{f.name!r}]' must be a contiguous 1-D {f.dtype} tensor (got {t.dtype} of shape "
                    f"{tuple(t.shape)}, strides {t.stride()})"
                )
            if t.shape[0] != rows:
                raise BatchMismatchError(
                    f"'views[{f.name!r}]' must hold rows={rows} elements (got {t.shape[0]}): pass the views of "
                    "the same graph size, block.views(rows)"
                )
            if device is None:
                device = t.device
            elif t.device != device:
                raise BatchMismatchError(
                    f"'views' must all be on one device (got {f.name!r} on {t.device}, the others on {device})"
                )
        self.rows = rows
        self.vocab_size = vocab_size
        self.temperatures: torch.Tensor = views["temperature"].view(rows, 1)
        self.top_ps: torch.Tensor = views["top_p"]
        self.top_ks: torch.Tensor = views["top_k"]
        self.min_ps: torch.Tensor = views["min_p"]
        self.sampling_seed: torch.Tensor | None = views["seed"]
        # One path whatever the batch holds (module doc): these never follow the values.
        self.deterministic: bool = True
        self.is_all_greedy: bool = False
        self.need_top_p_sampling: bool = True
        self.need_top_k_sampling: bool = True
        self.need_min_p_sampling: bool = True

    def __len__(self) -> int:
        return self.rows

    @property
    def device(self) -> torch.device:
        return self.top_ps.device

    @property
    def logit_bias(self) -> torch.Tensor | None:
        """Always None: logit bias is not captured (module doc)."""
        return None

    def check_live(self) -> None:
        """Nothing to check: the views are the block's own device memory, never recycled.

        Ordering of the block's copy against the reads is the block's stream rules
        (``DeviceBlock.register_reader``). Reads no state, so capture records nothing here.
        """

    def __repr__(self) -> str:
        return f"StaticSamplingInfo(rows={self.rows}, vocab_size={self.vocab_size}, device={self.device})"


def sampling_columns(records: np.ndarray[Any, Any] | bytes | bytearray | memoryview) -> dict[str, np.ndarray[Any, Any]]:
    """The live requests' five sampling columns, to ``put`` into a stage: name -> contiguous array.

    ``records``: a RECORD_DTYPE [live] array (``pack_foreign``)
    or the joined record bytes (``b"".join(p.record for p in params)``). Two numpy copies
    (the four 32-bit fields transposed at once, then the seeds) and one flags reduction; the
    arrays have the block's dtypes, so ``Stage.put`` takes its direct path. Call it
    when the batch changes and keep the result.

    Raises ``BatchMismatchError`` for a record carrying a logit bias (not captured in the
    graph), or records of the wrong type, dtype or length.
    """
    if isinstance(records, np.ndarray):
        if records.dtype != RECORD_DTYPE or records.ndim != 1:
            raise BatchMismatchError(
                f"'records' must be a 1-D RECORD_DTYPE array (got {records.dtype} of shape {records.shape})"
            )
        buf: Any = records if records.flags.c_contiguous else np.ascontiguousarray(records)
        n = records.shape[0]
    elif isinstance(records, (bytes, bytearray, memoryview)):
        view = memoryview(records)
        if not view.c_contiguous or view.nbytes % _RECORD_BYTES:
            raise BatchMismatchError(
                f"'records' bytes must be contiguous, whole {_RECORD_BYTES}-byte records (got {view.nbytes} bytes)"
            )
        buf = view.cast("B") if view.format != "B" or view.ndim != 1 else view
        n = view.nbytes // _RECORD_BYTES
    else:
        raise BatchMismatchError(
            f"'records' must be a RECORD_DTYPE array or joined record bytes (got {type(records).__name__})"
        )
    if n == 0:  # a step of padding only (numpy refuses a field offset into an empty buffer)
        return {f.name: np.zeros(0, NUMPY_DTYPE[f.dtype]) for f in SAMPLING_FIELDS}
    flags = np.ndarray((n,), np.uint16, buf, _FLAGS_OFFSET, (_RECORD_BYTES,))
    if int(np.bitwise_or.reduce(flags)) & FLAG_BIAS:
        i = int(np.flatnonzero(flags & FLAG_BIAS)[0])  # sync-ok: numpy records on the host
        raise BatchMismatchError(
            f"requests sampled in a captured graph must carry no logit bias (got one in request {i}): the bias "
            "is not captured in the graph (its entries vary per step); sample such a batch eagerly with a "
            "SamplingBatchInfo"
        )
    quad = np.empty((4, n), np.int32)
    quad[...] = np.ndarray((4, n), np.int32, buf, 0, (4, _RECORD_BYTES))
    seeds = np.ndarray((n,), np.int64, buf, _SEED_OFFSET, (_RECORD_BYTES,)).copy()
    return {
        "temperature": quad[0].view(np.float32),
        "top_p": quad[1].view(np.float32),
        "top_k": quad[2],
        "min_p": quad[3].view(np.float32),
        "seed": seeds,
    }


if TYPE_CHECKING:

    def _implements_sampling_tensors(info: StaticSamplingInfo) -> SamplingTensors:
        return info  # mypy checks StaticSamplingInfo against the protocol here
