"""sampling: per-request sampling parameters, their batch staged through pinpool, and the sampler."""

from sampling.batch_info import RequestLike, SamplingBatchInfo, ScheduleBatchLike
from sampling.bias_kernel import apply_logit_bias_reference, launch_apply_logit_bias
from sampling.draw import (
    SamplingTensors,
    draw_reference,
    filter_sorted_probs,
    hashed_uniform,
    launch_draw_sorted,
    mask_sorted_probs,
)
from sampling.exceptions import BatchMismatchError, SamplingParamError
from sampling.logit_bias import SparseLogitBias
from sampling.params import DEFAULT_SEED, GREEDY_EPS, RECORD_DTYPE, TOP_K_ALL, SamplingParams
from sampling.sampler import Sampler
from sampling.sglang_params import pack_foreign
from sampling.static import SAMPLING_FIELDS, StaticSamplingInfo, sampling_columns

__all__ = [
    "DEFAULT_SEED",
    "GREEDY_EPS",
    "RECORD_DTYPE",
    "SAMPLING_FIELDS",
    "TOP_K_ALL",
    "BatchMismatchError",
    "RequestLike",
    "Sampler",
    "SamplingBatchInfo",
    "SamplingParamError",
    "SamplingParams",
    "SamplingTensors",
    "ScheduleBatchLike",
    "SparseLogitBias",
    "StaticSamplingInfo",
    "apply_logit_bias_reference",
    "draw_reference",
    "filter_sorted_probs",
    "hashed_uniform",
    "launch_apply_logit_bias",
    "launch_draw_sorted",
    "mask_sorted_probs",
    "pack_foreign",
    "sampling_columns",
]
