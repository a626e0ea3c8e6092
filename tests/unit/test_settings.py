"""PoolSettings: validation names the field, the rule and the value; from_env reads PINPOOL_*."""

from __future__ import annotations

import pytest
import torch

from pinpool import OverflowPolicy, PoolSettings, SettingsError


@pytest.mark.parametrize(
    ("kwargs", "fragment"),
    [
        ({"num_slots": 1}, "'num_slots' must be an int >= 2 (got 1)"),
        ({"num_slots": True}, "'num_slots'"),
        ({"slot_bytes": 32}, "'slot_bytes' must be an int >= 64 (got 32)"),
        ({"slot_bytes": 100}, "'slot_bytes' must be a multiple of 'alignment' (16) (got 100)"),
        ({"alignment": 24}, "'alignment' must be a power of two >= 1 (got 24)"),
        ({"alignment": 4}, "'alignment' must be >= 8"),
        ({"overflow": "grow"}, "'overflow' must be one of raise, spill (got 'grow')"),
        ({"device": "gpu:0"}, "'device' must name a torch device"),
        ({"debug": "yes"}, "'debug'"),
        ({"log_stalls": 1}, "'log_stalls'"),
    ],
)
def test_each_rule_rejects_its_bad_value(kwargs: dict[str, object], fragment: str) -> None:
    """Catches a settings field that accepts a value its pool cannot work with."""
    with pytest.raises((SettingsError, TypeError)) as info:
        PoolSettings(**{"device": "cpu", **kwargs})  # type: ignore[arg-type]
    assert fragment in str(info.value)


def test_settings_are_frozen() -> None:
    """Catches settings mutated after a pool sized itself from them."""
    settings = PoolSettings(device="cpu")
    with pytest.raises(AttributeError):
        settings.num_slots = 9  # type: ignore[misc]


def test_from_env_reads_prefixed_variables_and_overrides_win() -> None:
    """Catches a variable read under the wrong name or parsed with the wrong type."""
    env = {
        "PINPOOL_DEVICE": "cpu",
        "PINPOOL_NUM_SLOTS": "6",
        "PINPOOL_SLOT_BYTES": "0x1000",
        "PINPOOL_OVERFLOW": "spill",
        "PINPOOL_DEBUG": "on",
        "UNRELATED": "1",
    }
    settings = PoolSettings.from_env(env, num_slots=3)
    assert settings.device == torch.device("cpu")
    assert settings.num_slots == 3
    assert settings.slot_bytes == 4096
    assert settings.overflow is OverflowPolicy.SPILL
    assert settings.debug is True
    assert PoolSettings.from_env({"PINPOOL_DEVICE": "cpu"}).debug is False


@pytest.mark.parametrize(("var", "value"), [("PINPOOL_NUM_SLOTS", "four"), ("PINPOOL_DEBUG", "maybe")])
def test_from_env_bad_value_names_the_variable(var: str, value: str) -> None:
    """Catches an env typo that would otherwise fall back to a default silently."""
    with pytest.raises(SettingsError, match=var):
        PoolSettings.from_env({var: value, "PINPOOL_DEVICE": "cpu"})
