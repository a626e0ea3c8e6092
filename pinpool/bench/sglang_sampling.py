"""sglang's ``SamplingBatchInfo.from_schedule_batch``, for side-by-side checks and benchmarks.

Lab code, not library code. ``load()`` execs sglang 0.5.23's own
``python/sglang/srt/sampling/sampling_batch_info.py`` from ``.sglang/`` (extracted from the
PyPI wheel; ignored by git, nothing of it is copied into this repository), with the heavy
optional modules it imports replaced by stubs:

- penalizers: a no-op orchestrator (pinpool has none; its cost is left out of sglang's
  side, which favours sglang);
- grammars, custom logit processors, watermarking: absent (their feature flags are off);
- ``get_exec()``: deterministic inference on, so the seeds are built;
- ``is_pin_memory_available``: True on CUDA, as on a GPU host.

Without ``.sglang/`` (CI), ``load()`` returns ``rebuild``: the same steps written here from
reading that file (five pinned per-field uploads, the dense logit bias filled from pinned
row/column/value uploads, the host flag scans, the sampling-mask lists), stated as a
rebuild in every table that uses it.
"""

from __future__ import annotations

import types
from collections.abc import Callable
from pathlib import Path
from typing import Any

import torch

from pinpool.bench.sglang_files import exec_file, sglang_dir, stub

TOP_K_ALL = 1 << 30
_RELATIVE = Path("sglang/srt/sampling/sampling_batch_info.py")
Build = Callable[[Any, int], Any]


class _Orchestrator:
    """Penalizers left out: pinpool has none, and a caller keeps sglang's (see the README)."""

    is_required = False

    def __init__(self, *args: Any, **kwargs: Any) -> None:
        pass

    def filter(self, keep_indices_device: Any) -> None:
        pass

    def merge(self, other: Any) -> None:
        pass


#: sglang's runtime switches as its build reads them: ``deterministic`` is flipped by ``Build``.
_EXEC = types.SimpleNamespace(
    deterministic=types.SimpleNamespace(enable_deterministic_inference=True),
    features=types.SimpleNamespace(enable_custom_logit_processor=False, enable_watermark=False),
)


def _exec_config() -> Any:
    return _EXEC


def set_deterministic(on: bool) -> None:
    """Switch sglang's deterministic inference (its build then stages the seeds) for later builds."""
    _EXEC.deterministic.enable_deterministic_inference = on


def _pin(device: Any = None) -> bool:
    return torch.cuda.is_available() and torch.device(device or "cuda").type == "cuda"


def load() -> tuple[Build, str]:
    """(from_schedule_batch(batch, vocab_size), where it came from)."""
    root = sglang_dir(_RELATIVE)
    if root is None:
        return rebuild, "rebuild (no .sglang/: written here from sglang 0.5.23's source, not its code)"
    stub("sglang.srt.sampling.penaltylib", BatchedPenalizerOrchestrator=_Orchestrator)
    stub("sglang.srt.sampling.penaltylib.repetition_penalty")
    stub("sglang.srt.constrained.base_grammar_backend")
    stub("sglang.srt.runtime_context", get_exec=_exec_config)
    stub("sglang.srt.sampling.custom_logit_processor")
    stub("sglang.srt.sampling.sampling_params", TOP_K_ALL=TOP_K_ALL)
    stub("sglang.srt.sampling.watermarking.core")
    stub("sglang.srt.utils.common", is_pin_memory_available=_pin)
    stub("sglang.srt.managers.schedule_batch")
    path = root / _RELATIVE
    module = exec_file("sglang.srt.sampling.sampling_batch_info", path)
    build: Build = module.SamplingBatchInfo.from_schedule_batch
    return build, f"sglang 0.5.23's own from_schedule_batch ({path}), penalizers/grammars/watermarks stubbed"


_PARAMS_RELATIVE = Path("sglang/srt/sampling/sampling_params.py")


def load_params_class() -> tuple[Callable[..., Any], str]:
    """(sglang's own ``SamplingParams`` class when ``.sglang/`` and msgspec are here, else
    ``SglangParams``, the stand-in; where it came from). Both normalise at construction."""
    root = sglang_dir(_PARAMS_RELATIVE)
    try:
        import msgspec  # noqa: F401  (sglang's params class is a msgspec struct)
    except ImportError:
        root = None
    if root is None:
        return SglangParams, "stand-in SglangParams (no .sglang/ or no msgspec): sglang's fields, not its class"
    stub("sglang.srt.sampling.watermarking.core", WatermarkRequestConfig=object, normalize_watermark_request=_same)
    module = exec_file("sglang.srt.sampling.sampling_params", root / _PARAMS_RELATIVE)
    return module.SamplingParams, f"sglang 0.5.23's own SamplingParams ({root / _PARAMS_RELATIVE})"


def _same(value: Any) -> Any:
    return value


def rebuild(batch: Any, vocab_size: int) -> Any:
    """sglang 0.5.23's from_schedule_batch steps, rebuilt (see the module doc)."""
    reqs, device = batch.reqs, batch.device
    pin = _pin(device)

    def up(values: list[Any], dtype: torch.dtype) -> torch.Tensor:
        return torch.tensor(values, dtype=dtype, pin_memory=pin).to(device, non_blocking=True)

    sps = [r.sampling_params for r in reqs]
    out = types.SimpleNamespace(
        temperatures=up([p.temperature for p in sps], torch.float).view(-1, 1),
        top_ps=up([p.top_p for p in sps], torch.float),
        top_ks=up([p.top_k for p in sps], torch.int32),
        min_ps=up([p.min_p for p in sps], torch.float),
        sampling_seed=up([42 if p.sampling_seed is None else p.sampling_seed for p in sps], torch.int64),
        logit_bias=None,
    )
    if any(p.logit_bias is not None for p in sps):
        out.logit_bias = torch.zeros(len(reqs), vocab_size, device=device)
        rows, cols, vals = [], [], []
        for i, p in enumerate(sps):
            if p.logit_bias is not None:
                for token, value in {int(k): v for k, v in p.logit_bias.items()}.items():
                    rows.append(i)
                    cols.append(token)
                    vals.append(value)
        if rows:
            out.logit_bias[up(rows, torch.long), up(cols, torch.long)] = up(vals, torch.float)
    masks = [r.return_sampling_mask for r in reqs]
    out.sampling_mask_top_ks = [p.top_k if m else 1 for p, m in zip(sps, masks, strict=True)]
    mask_rows = [i for i, m in enumerate(masks) if m]
    out.sampling_mask_batch_indices = up(mask_rows, torch.long) if mask_rows else None
    out.is_all_greedy = all(p.top_k <= 1 for p in sps)
    out.is_any_greedy = any(p.top_k <= 1 for p in sps)
    out.need_top_p_sampling = any(p.top_p != 1.0 for p in sps)
    out.need_top_k_sampling = any(p.top_k != TOP_K_ALL for p in sps)
    out.need_min_p_sampling = any(p.min_p > 0 for p in sps)
    out.npu_top_k_top_p_eligible = all(1 <= p.top_k <= 1024 for p in sps)
    out.max_top_k = max(p.top_k for p in sps) if all(1 <= p.top_k < TOP_K_ALL for p in sps) else None
    return out


class SglangParams:
    """Stands in for sglang's ``SamplingParams`` (a msgspec struct): the fields a batch build reads,
    normalised as its ``__post_init__`` leaves them."""

    __slots__ = ("custom_params", "logit_bias", "min_p", "sampling_seed", "temperature", "top_k", "top_p")

    def __init__(
        self,
        temperature: float = 1.0,
        top_p: float = 1.0,
        top_k: int = -1,
        min_p: float = 0.0,
        sampling_seed: int | None = None,
        logit_bias: dict[str, float] | None = None,
    ) -> None:
        if 0 <= temperature < 1e-6:
            temperature, top_k = 1.0, 1
        self.temperature, self.top_p, self.min_p = temperature, top_p, min_p
        self.top_k = TOP_K_ALL if top_k == -1 else top_k
        self.sampling_seed, self.logit_bias, self.custom_params = sampling_seed, logit_bias, None


class SglangReq:
    """The request fields sglang's from_schedule_batch reads."""

    __slots__ = ("custom_logit_processor", "return_sampling_mask", "sampling_logprobs_mode", "sampling_params")

    def __init__(self, params: Any) -> None:
        self.sampling_params = params
        self.custom_logit_processor = None
        self.return_sampling_mask = False
        self.sampling_logprobs_mode = None


class SglangBatch:
    def __init__(self, reqs: list[SglangReq], device: torch.device | str) -> None:
        self.reqs = reqs
        self.device = device
