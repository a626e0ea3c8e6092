"""Errors raised by the sampling package (all are ``pinpool.PinpoolError`` too)."""

from __future__ import annotations

from pinpool.exceptions import PinpoolError


class SamplingParamError(PinpoolError, ValueError):
    """A sampling parameter broke its rule (named, with the rule and the value)."""


class BatchMismatchError(PinpoolError, ValueError):
    """Two batches, or a batch and its inputs, disagree (vocab size, device, lengths)."""
