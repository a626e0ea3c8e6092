"""``PoolSettings``: the one frozen, validated configuration of a ``PinnedRingBuffer``."""

from __future__ import annotations

import difflib
import enum
import os
import warnings
from collections.abc import Mapping
from typing import Any

import attrs
import torch

from pinpool.exceptions import SettingsError, SettingsTypeError, SettingsWarning

ENV_PREFIX = "PINPOOL_"
#: ``PINPOOL_*`` variables read outside the settings, and where: ``from_env`` warns about any
#: other name with the prefix that is not a settings field (a typo would otherwise be ignored).
OTHER_ENV = {
    "PINPOOL_LOG_LEVEL": "the pinpool command line's log level (pinpool.log)",
    "PINPOOL_GRAPH_CONFIGS": "pinpool.bench.engine.graph_bench",
    "PINPOOL_SETUP_DRY_RUN": "tests/run.py",
    "PINPOOL_SOAK": "tests/bench/run_on_device.sh",
    "PINPOOL_SOAK_ARGS": "tests/bench/run_on_device.sh",
    "PINPOOL_DIAG": "tests/bench/run_on_device.sh",
    "PINPOOL_PROFILE": "tests/bench/run_on_device.sh",
    "PINPOOL_BOX_SCALE": "tests/bench/run_on_device.sh",
    "PINPOOL_WORKLOADS": "tests/bench/run_on_device.sh",
    "PINPOOL_GRAPH": "tests/bench/run_on_device.sh",
    "PINPOOL_UNIT": "tests/bench/run_on_device.sh",
    "PINPOOL_BREAKDOWN": "tests/bench/run_on_device.sh",
    "PINPOOL_SERVE_CONFIGS": "pinpool.bench.engine.serve_bench",
    "PINPOOL_SERVE_LOADS": "pinpool.bench.engine.serve_bench",
    "PINPOOL_SERVE_REQUESTS": "pinpool.bench.engine.serve_bench",
    "PINPOOL_GATE": "tests/bench/run_on_device.sh",
    "PINPOOL_OLD_STREAMS": "tests/bench/run_on_device.sh",
    "PINPOOL_SERVE": "tests/bench/run_on_device.sh",
    "PINPOOL_SERVE_BOX": "tests/bench/run_on_device.sh",
    "PINPOOL_SERVE_SOAK": "tests/bench/run_on_device.sh",
    "PINPOOL_SERVE_SOAK_BOX": "tests/bench/run_on_device.sh",
    "PINPOOL_GATE_WORKLOADS": "tests/bench/run_on_device.sh",
    "PINPOOL_GATE_BOX": "tests/bench/run_on_device.sh",
    "PINPOOL_GPU_TESTS": "tests/bench/run_on_device.sh",
    "PINPOOL_GPU_BOX": "tests/bench/run_on_device.sh",
}
#: Where a pool's slab and mirror can live: transports exist for these only.
DEVICE_TYPES = ("cpu", "cuda")


class OverflowPolicy(enum.Enum):
    """What ``put`` does when a value does not fit the rest of its slot."""

    #: Raise ``CapacityError`` before anything is written (the default: a silent
    #: fallback would hide a mis-sized pool).
    RAISE = "raise"
    #: Stage that value through a one-off pinned buffer and a second copy, log
    #: ``stage.overflow`` and count it. Correct, but allocates: for bursts only.
    SPILL = "spill"


def _positive_power_of_two(instance: Any, attribute: attrs.Attribute[int], value: int) -> None:
    if isinstance(value, bool) or not isinstance(value, int) or value < 1 or value & (value - 1):
        raise SettingsError(f"'{attribute.name}' must be a power of two >= 1 (got {value!r})")


def _at_least(minimum: int) -> Any:
    def check(instance: Any, attribute: attrs.Attribute[int], value: int) -> None:
        if isinstance(value, bool) or not isinstance(value, int) or value < minimum:
            raise SettingsError(f"'{attribute.name}' must be an int >= {minimum} (got {value!r})")

    return check


def _bool(instance: Any, attribute: attrs.Attribute[bool], value: bool) -> None:
    # 1, 'yes' and '1' are refused rather than read as True: from_env parses strings, and a
    # truthy guess here would turn 'false' into True.
    if not isinstance(value, bool):
        raise SettingsTypeError(f"'{attribute.name}' must be True or False (got {value!r})")


def _to_device(value: str | torch.device) -> torch.device:
    try:
        device = torch.device(value)
    except (RuntimeError, TypeError) as exc:
        raise SettingsError(f"'device' must name a torch device such as 'cuda:0' or 'cpu' (got {value!r})") from exc
    if device.type not in DEVICE_TYPES:
        # 'meta' has no memory to stage into; other backends have no transport.
        raise SettingsError(f"'device' must be a {' or '.join(DEVICE_TYPES)} device (got {value!r})")
    if device.type == "cuda" and device.index is None:
        # Pin the index now: events, streams and the mirror must all agree on one device
        # even if the caller changes the current device later.
        index = torch.cuda.current_device() if torch.cuda.is_available() else 0
        device = torch.device("cuda", index)
    return device


def _to_policy(value: str | OverflowPolicy) -> OverflowPolicy:
    if isinstance(value, OverflowPolicy):
        return value
    try:
        return OverflowPolicy(value)
    except ValueError as exc:
        allowed = ", ".join(p.value for p in OverflowPolicy)
        raise SettingsError(f"'overflow' must be one of {allowed} (got {value!r})") from exc


@attrs.frozen(kw_only=True)
class PoolSettings:
    """How big the ring is, where its mirror lives, and how strict it is.

    ``num_slots`` must be at least the number of stages the GPU may lag behind the host
    (the in-flight depth): a shallower ring makes the host wait on slot events.
    """

    #: Where the mirror lives. The default is the current CUDA device when there is one,
    #: else the CPU (rule 7: same API, plain memory, no events).
    device: torch.device = attrs.field(
        default=attrs.Factory(lambda: torch.device("cuda" if torch.cuda.is_available() else "cpu")),
        converter=_to_device,
    )
    #: Bytes per slot: the most one stage can carry. Rounded views need it to be a
    #: multiple of ``alignment``.
    slot_bytes: int = attrs.field(default=1 << 20, validator=_at_least(64))
    num_slots: int = attrs.field(default=4, validator=_at_least(2))
    #: Every put starts on this boundary so that any dtype view (up to 8-byte
    #: elements) and vectorised kernel loads stay aligned.
    alignment: int = attrs.field(default=16, validator=_positive_power_of_two)
    overflow: OverflowPolicy = attrs.field(default=OverflowPolicy.RAISE, converter=_to_policy)
    #: Debug switches: thread ownership and lease-generation checks, and poisoning of a
    #: recycled slot's device region (0xFF: NaN for floats, -1 for ints).
    debug: bool = attrs.field(default=False, validator=_bool)
    #: Log ``slot.stall`` for every host wait on a slot event (off by default: a lagging
    #: GPU would flood the log; the stats count stalls either way).
    log_stalls: bool = attrs.field(default=False, validator=_bool)
    #: Allow zero-copy stages (``pool.stage(zero_copy=True)``): kernels read the pinned slot
    #: through its device address, no copy. Turning it on runs the platform check at pool
    #: creation (one host sync, start-up only) and builds the slots' device aliases; off,
    #: the pool costs exactly what it did before.
    zero_copy: bool = attrs.field(default=False, validator=_bool)

    def __attrs_post_init__(self) -> None:
        if self.alignment < 8:
            raise SettingsError(f"'alignment' must be >= 8 so 8-byte dtypes stay aligned (got {self.alignment})")
        if self.slot_bytes % self.alignment:
            raise SettingsError(
                f"'slot_bytes' must be a multiple of 'alignment' ({self.alignment}) (got {self.slot_bytes})"
            )
        memory = _host_memory_bytes()
        if memory is not None and self.total_bytes > memory:
            # Refused here with the sizes named, not later as an allocator's message.
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
        """Build settings from ``PINPOOL_*`` variables; keyword overrides win.

        Read here and nowhere else: ``PINPOOL_DEVICE``, ``PINPOOL_SLOT_BYTES``,
        ``PINPOOL_NUM_SLOTS``, ``PINPOOL_ALIGNMENT``, ``PINPOOL_OVERFLOW``,
        ``PINPOOL_DEBUG``, ``PINPOOL_LOG_STALLS``, ``PINPOOL_ZERO_COPY``. Any other
        ``PINPOOL_*`` name outside ``OTHER_ENV`` gets a ``SettingsWarning`` naming the
        closest known one.
        """
        env = os.environ if environ is None else environ
        known = {ENV_PREFIX + field.name.upper() for field in attrs.fields(cls)} | set(OTHER_ENV)
        for var in sorted(name for name in env if name.startswith(ENV_PREFIX) and name not in known):
            close = difflib.get_close_matches(var, sorted(known), n=1)
            hint = f"did you mean {close[0]}?" if close else f"known: {', '.join(sorted(known))}"
            warnings.warn(f"'{var}' is not a pinpool variable and is ignored ({hint})", SettingsWarning, stacklevel=2)
        values: dict[str, Any] = {}
        for field in attrs.fields(cls):
            raw = env.get(ENV_PREFIX + field.name.upper())
            if raw is None:
                continue
            values[field.name] = _parse_env(field.name, raw, field.type)
        values.update(overrides)
        return cls(**values)


def _parse_env(name: str, raw: str, kind: Any) -> Any:
    var = ENV_PREFIX + name.upper()
    if kind in ("int", int):
        try:
            return int(raw, 0)
        except ValueError as exc:
            raise SettingsError(f"'{var}' must be an integer (got {raw!r})") from exc
    if kind in ("bool", bool):
        lowered = raw.strip().lower()
        if lowered in ("1", "true", "yes", "on"):
            return True
        if lowered in ("0", "false", "no", "off", ""):
            return False
        raise SettingsError(f"'{var}' must be one of 1/0/true/false/yes/no/on/off (got {raw!r})")
    return raw


def _host_memory_bytes() -> int | None:
    """Physical memory of this machine, or None where the platform does not say (then no check)."""
    try:
        return int(os.sysconf("SC_PAGE_SIZE")) * int(os.sysconf("SC_PHYS_PAGES"))
    except (AttributeError, ValueError, OSError):
        return None
