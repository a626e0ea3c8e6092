"""Bad input that is not typed: each case raises (or warns) a typed pinpool error naming the parameter and the value.

One row per case from issue 27. Each row also checks the house pattern (``must ... (got
...)``), the standard base class a caller would already catch, and that a pool made before
the bad call still stages afterwards (a failed constructor must not disturb other pools).
"""

from __future__ import annotations

from collections.abc import Callable
from typing import Any

import pytest
import torch

from pinpool import PinnedRingBuffer, PinpoolError, PoolSettings, SettingsError
from pinpool.exceptions import SettingsTypeError, SettingsWarning

HUGE = 1 << 50  # a petabyte per slot: more than any machine's memory


def _settings(**kw: Any) -> Callable[[], object]:
    return lambda: PoolSettings(**{"device": "cpu", **kw})


def _from_env(env: dict[str, str]) -> Callable[[], object]:
    return lambda: PoolSettings.from_env({"PINPOOL_DEVICE": "cpu", **env})


CASES: list[tuple[str, Callable[[], object], type[BaseException] | type[Warning], type[Exception], tuple[str, ...]]] = [
    # (id, the bad call, what it raises or warns, the standard base, fragments the message must hold)
    ("bool-yes", _settings(debug="yes"), SettingsTypeError, TypeError, ("'debug'", "'yes'")),
    ("bool-str-1", _settings(log_stalls="1"), SettingsTypeError, TypeError, ("'log_stalls'", "'1'")),
    ("bool-int-1", _settings(zero_copy=1), SettingsTypeError, TypeError, ("'zero_copy'", "(got 1)")),
    ("ring-str", lambda: PinnedRingBuffer("cpu"), SettingsTypeError, TypeError, ("'settings'", "'cpu'")),
    (
        "ring-dict",
        lambda: PinnedRingBuffer({"device": "cpu"}),
        SettingsTypeError,
        TypeError,
        ("'settings'", "{'device': 'cpu'}"),
    ),
    ("device-meta", _settings(device="meta"), SettingsError, ValueError, ("'device'", "'meta'")),
    ("huge-slot", _settings(slot_bytes=HUGE), SettingsError, ValueError, ("'slot_bytes'", str(HUGE))),
    ("env-typo", _from_env({"PINPOOL_SLOTBYTES": "4096"}), SettingsWarning, UserWarning, ("PINPOOL_SLOTBYTES",)),
    ("env-bool", _from_env({"PINPOOL_DEBUG": "maybe"}), SettingsError, ValueError, ("'PINPOOL_DEBUG'", "'maybe'")),
    ("env-int", _from_env({"PINPOOL_NUM_SLOTS": "four"}), SettingsError, ValueError, ("'PINPOOL_NUM_SLOTS'", "'four'")),
]


@pytest.mark.parametrize(("call", "kind", "base", "fragments"), [c[1:] for c in CASES], ids=[c[0] for c in CASES])
def test_bad_input_gets_a_typed_error_naming_parameter_and_value(
    call: Callable[[], object], kind: type[Exception], base: type[Exception], fragments: tuple[str, ...]
) -> None:
    """Catches bad input that raises attrs' tuple TypeError, a bare AttributeError or an allocator's
    message, is accepted (device='meta'), or is ignored in silence (a mistyped PINPOOL_* name)."""
    pool = PinnedRingBuffer(PoolSettings(device="cpu", slot_bytes=1024, num_slots=2))
    if issubclass(kind, Warning):
        with pytest.warns(kind) as caught:
            call()
        message = str(caught[0].message)
        assert isinstance(caught[0].message, base)
    else:
        with pytest.raises(kind) as info:
            call()
        message = str(info.value)
        assert isinstance(info.value, base) and isinstance(info.value, PinpoolError)
        assert " must " in message and "(got " in message, message  # the house pattern
    for fragment in fragments:
        assert fragment in message, (fragment, message)
    with pool.stage() as st:
        staged = st.put([7, 8, 9], torch.int64)
    assert staged.tolist() == [7, 8, 9]
    pool.close()


def test_the_env_typo_names_the_closest_known_variable() -> None:
    """Catches a warning that says a name is unknown without the one that was meant."""
    with pytest.warns(SettingsWarning, match="did you mean PINPOOL_SLOT_BYTES"):
        PoolSettings.from_env({"PINPOOL_DEVICE": "cpu", "PINPOOL_SLOTBYTES": "4096"})
