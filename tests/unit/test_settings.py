"""PoolSettings: validation names the field, the rule and the value; from_env reads PINPOOL_*."""

from __future__ import annotations

import warnings

import attrs
import pytest
import torch

from pinpool import PoolSettings, SettingsError
from pinpool.exceptions import SettingsTypeError, SettingsWarning


@pytest.mark.parametrize(
    ("kwargs", "fragment"),
    [
        ({"num_slots": 1}, "'num_slots' must be an int >= 2 (got 1)"),
        ({"num_slots": True}, "'num_slots'"),
        ({"slot_bytes": 32}, "'slot_bytes' must be an int >= 64 (got 32)"),
        ({"slot_bytes": 100}, "'slot_bytes' must be a multiple of 'alignment' (16) (got 100)"),
        ({"alignment": 24}, "'alignment' must be a power of two >= 1 (got 24)"),
        ({"alignment": 4}, "'alignment' must be >= 8"),
        ({"device": "gpu:0"}, "'device' must name a torch device"),
        ({"device": "meta"}, "'device' must be a cpu or cuda device (got 'meta')"),
        ({"debug": "yes"}, "'debug' must be True or False (got 'yes')"),
        ({"log_stalls": 1}, "'log_stalls' must be True or False (got 1)"),
        ({"slot_bytes": 1 << 50}, f"(got {1 << 50} * 4 = {1 << 52})"),
    ],
)
def test_each_rule_rejects_its_bad_value(kwargs: dict[str, object], fragment: str) -> None:
    """Catches a settings field that accepts a value its pool cannot work with."""
    with pytest.raises(SettingsError) as info:
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
        "PINPOOL_ALIGNMENT": "32",
        "PINPOOL_DEBUG": "on",
        "UNRELATED": "1",
    }
    settings = PoolSettings.from_env(env, num_slots=3)
    assert settings.device == torch.device("cpu")
    assert settings.num_slots == 3
    assert settings.slot_bytes == 4096
    assert settings.alignment == 32
    assert settings.debug is True
    assert PoolSettings.from_env({"PINPOOL_DEVICE": "cpu"}).debug is False


@pytest.mark.parametrize(("var", "value"), [("PINPOOL_NUM_SLOTS", "four"), ("PINPOOL_DEBUG", "maybe")])
def test_from_env_bad_value_names_the_variable(var: str, value: str) -> None:
    """Catches an env typo that would otherwise fall back to a default silently."""
    with pytest.raises(SettingsError, match=var):
        PoolSettings.from_env({var: value, "PINPOOL_DEVICE": "cpu"})


def test_a_bool_field_given_a_non_bool_is_a_type_error_too() -> None:
    """Catches the typed error breaking callers that caught the TypeError attrs used to raise."""
    with pytest.raises(TypeError) as info:
        PoolSettings(device="cpu", zero_copy="1")  # type: ignore[arg-type]
    assert isinstance(info.value, SettingsTypeError)


def test_an_unknown_variable_warns_with_the_closest_name() -> None:
    """Catches a mistyped PINPOOL_* variable ignored in silence (the pool runs with the default)."""
    with pytest.warns(SettingsWarning) as caught:
        settings = PoolSettings.from_env({"PINPOOL_NUM_SLOT": "8", "PINPOOL_DEVICE": "cpu"})
    assert settings.num_slots == 4
    (warning,) = caught
    assert str(warning.message) == (
        "'PINPOOL_NUM_SLOT' is not a pinpool variable and is ignored (did you mean PINPOOL_NUM_SLOTS?)"
    )
    assert warning.filename == __file__  # points at the caller, not at settings.py


def test_every_pinpool_variable_the_repository_reads_passes_from_env_in_silence() -> None:
    """Catches a tool's ``PINPOOL_*`` knob (a bench's, a script's) that ``from_env`` would take for a
    typo of a settings field and warn about, suggesting the wrong variable."""
    import re
    from pathlib import Path

    root = Path(__file__).resolve().parents[2]
    files = [
        p
        for d in ("pinpool", "sampling", "memcache", "tests")
        for p in (root / d).rglob("*")
        if p.suffix in (".py", ".sh")
    ]
    # A name read from the environment: os.environ / getenv with it, or a shell ${NAME...} / $NAME.
    pattern = re.compile(
        r"(?:environ(?:\.get)?\(|getenv\(|environ\[)\s*['\"](PINPOOL_[A-Z0-9_]+)|\$\{?(PINPOOL_[A-Z0-9_]+)"
    )
    read = {a or b for p in files for a, b in pattern.findall(p.read_text(errors="replace"))}
    assert "PINPOOL_SERVE_RUNS" in read, "the scan missed a variable the device script reads: the pattern is broken"
    fields = {"PINPOOL_" + f.name.upper() for f in attrs.fields(PoolSettings)}
    with warnings.catch_warnings():
        warnings.simplefilter("error")
        PoolSettings.from_env({**dict.fromkeys(read - fields, "1"), "PINPOOL_DEVICE": "cpu", "PATH": "/bin"})


def test_the_removed_overflow_setting_is_refused_as_a_keyword_and_ignored_in_the_environment() -> None:
    """Catches the spill policy half-removed: ``overflow=`` still accepted (a pool that would silently raise
    where its caller asked it to spill), or ``PINPOOL_OVERFLOW`` warning or failing at start-up."""
    with pytest.raises(TypeError, match="overflow"):
        PoolSettings(device="cpu", overflow="spill")  # type: ignore[call-arg]
    with warnings.catch_warnings():
        warnings.simplefilter("error")
        settings = PoolSettings.from_env({"PINPOOL_DEVICE": "cpu", "PINPOOL_OVERFLOW": "spill"})
    assert not hasattr(settings, "overflow")
