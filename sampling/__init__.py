"""sampling: per-request sampling parameters, their batch staged through pinpool, and the sampler."""

from sampling.batch_info import RequestLike, SamplingBatchInfo, ScheduleBatchLike
from sampling.draw import draw_reference, filter_sorted_probs, hashed_uniform, launch_draw_sorted, mask_sorted_probs
from sampling.exceptions import BatchMismatchError, SamplingParamError
from sampling.params import DEFAULT_SEED, GREEDY_EPS, RECORD_DTYPE, TOP_K_ALL, SamplingParams
from sampling.sampler import Sampler, SamplingTensors

__all__ = [
    "DEFAULT_SEED",
    "GREEDY_EPS",
    "RECORD_DTYPE",
    "TOP_K_ALL",
    "BatchMismatchError",
    "RequestLike",
    "Sampler",
    "SamplingBatchInfo",
    "SamplingParamError",
    "SamplingParams",
    "SamplingTensors",
    "ScheduleBatchLike",
    "draw_reference",
    "filter_sorted_probs",
    "hashed_uniform",
    "launch_draw_sorted",
    "mask_sorted_probs",
]
