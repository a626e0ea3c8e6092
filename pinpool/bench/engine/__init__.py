"""The reference decode loop: pinpool, sampling and memcache used together, as an engine would.

No library package imports this one. ``pinpool bench`` runs it through the
``pinpool.bench`` entry point; ``python -m pinpool.bench.engine.distributed`` runs one worker per GPU.
"""

from pinpool.bench.engine.loop import Engine, EngineConfig
from pinpool.bench.engine.model import ModelConfig, TinyDecoder
from pinpool.bench.engine.requests import Request, Workload, make_requests
from pinpool.bench.engine.uploader import MODES, Mode, Uploader

__all__ = [
    "MODES",
    "Engine",
    "EngineConfig",
    "Mode",
    "ModelConfig",
    "Request",
    "TinyDecoder",
    "Uploader",
    "Workload",
    "make_requests",
]
