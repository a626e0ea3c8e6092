"""``PoolSettings``: the one frozen, validated configuration of a ``PinnedRingBuffer`` (docs/rules.md, Settings)."""

from __future__ import annotations

import difflib
import os
import warnings
from collections.abc import Mapping
from typing import Any

import attrs
import torch

from pinpool.exceptions import SettingsError, SettingsTypeError, SettingsWarning

ENV_PREFIX = "PINPOOL_"
TYPO_CUTOFF = 0.85  # how near a field's variable an unknown ``PINPOOL_*`` name must be to warn as its typo
DEVICE_TYPES = ("cpu", "cuda")  # transports exist for these only
_TRUE, _FALSE = ("1", "true", "yes", "on"), ("0", "false", "no", "off", "")


def _int_at_least(minimum: int, power_of_two: bool = False) -> Any:
    rule = f"a power of two >= {minimum}" if power_of_two else f"an int >= {minimum}"

    def check(instance: Any, attribute: attrs.Attribute[int], value: int) -> None:
        is_int = isinstance(value, int) and not isinstance(value, bool)
        if not is_int or value < minimum or (power_of_two and value & (value - 1)):
            raise SettingsError(f"'{attribute.name}' must be {rule} (got {value!r})")

    return check


def _bool(instance: Any, attribute: attrs.Attribute[bool], value: bool) -> None:
    if not isinstance(value, bool):  # 1 and '1' are refused: a truthy guess would read 'false' as True
        raise SettingsTypeError(f"'{attribute.name}' must be True or False (got {value!r})")


def _to_device(value: str | torch.device) -> torch.device:
    try:
        device = torch.device(value)
    except (RuntimeError, TypeError) as exc:
        raise SettingsError(f"'device' must name a torch device such as 'cuda:0' or 'cpu' (got {value!r})") from exc
    if device.type not in DEVICE_TYPES:  # 'meta' has no memory to stage into; others have no transport
        raise SettingsError(f"'device' must be a {' or '.join(DEVICE_TYPES)} device (got {value!r})")
    if device.type == "cuda" and device.index is None:  # pinned now, whatever the current device becomes
        device = torch.device("cuda", torch.cuda.current_device() if torch.cuda.is_available() else 0)
    return device


@attrs.frozen(kw_only=True)
class PoolSettings:
    """How big the ring is, where its mirror lives, and how strict it is."""

    device: torch.device = attrs.field(  # the current CUDA device if there is one, else the CPU
        default=attrs.Factory(lambda: torch.device("cuda" if torch.cuda.is_available() else "cpu")),
        converter=_to_device,
    )
    slot_bytes: int = attrs.field(default=1 << 20, validator=_int_at_least(64))  #: the most one stage carries
    num_slots: int = attrs.field(default=4, validator=_int_at_least(2))  #: >= the stages the GPU may lag the host
    alignment: int = attrs.field(default=16, validator=_int_at_least(1, power_of_two=True))  #: of every put
    debug: bool = attrs.field(default=False, validator=_bool)  #: owner-thread and lease checks, poisoned slots
    log_stalls: bool = attrs.field(default=False, validator=_bool)  #: log ``slot.stall`` at every host wait
    zero_copy: bool = attrs.field(default=False, validator=_bool)  #: run the platform check, allow in-place stages

    def __attrs_post_init__(self) -> None:
        if self.alignment < 8:
            raise SettingsError(f"'alignment' must be >= 8 so 8-byte dtypes stay aligned (got {self.alignment})")
        if self.slot_bytes % self.alignment:
            raise SettingsError(
                f"'slot_bytes' must be a multiple of 'alignment' ({self.alignment}) (got {self.slot_bytes})"
            )
        try:
            memory = os.sysconf("SC_PAGE_SIZE") * os.sysconf("SC_PHYS_PAGES")
        except (AttributeError, ValueError, OSError):  # the platform does not say: no check
            memory = 0
        if memory and self.total_bytes > memory:  # refused here, not by the allocator
            raise SettingsError(
                f"'slot_bytes' times 'num_slots' must fit in this machine's {memory} bytes of memory "
                f"(got {self.slot_bytes} * {self.num_slots} = {self.total_bytes}); lower slot_bytes or num_slots"
            )

    @property
    def total_bytes(self) -> int:
        """Pinned host bytes (and as many device bytes) the pool allocates once."""
        return self.slot_bytes * self.num_slots

    @classmethod
    def from_env(cls, environ: Mapping[str, str] | None = None, **overrides: Any) -> PoolSettings:
        """Settings from ``PINPOOL_<FIELD>`` variables, overrides winning; a near-miss name warns as a typo."""
        env = os.environ if environ is None else environ
        fields = {ENV_PREFIX + field.name.upper(): field for field in attrs.fields(cls)}
        for var in sorted(name for name in env if name.startswith(ENV_PREFIX) and name not in fields):
            if close := difflib.get_close_matches(var, sorted(fields), n=1, cutoff=TYPO_CUTOFF):
                msg = f"'{var}' is not a pinpool variable and is ignored (did you mean {close[0]}?)"
                warnings.warn(msg, SettingsWarning, stacklevel=2)
        values = {field.name: _parse_env(var, env[var], field.type) for var, field in fields.items() if var in env}
        return cls(**{**values, **overrides})


def _parse_env(var: str, raw: str, kind: Any) -> Any:
    if kind in ("int", int):
        try:
            return int(raw, 0)
        except ValueError as exc:
            raise SettingsError(f"'{var}' must be an integer (got {raw!r})") from exc
    if kind in ("bool", bool):
        if (word := raw.strip().lower()) in _TRUE + _FALSE:
            return word in _TRUE
        raise SettingsError(f"'{var}' must be one of 1/0/true/false/yes/no/on/off (got {raw!r})")
    return raw
