"""pinpool.log: events reach stderr at info and above unless the application configures structlog."""

from __future__ import annotations

import logging
from collections.abc import Iterator, Mapping, MutableMapping
from typing import Any

import pytest
import structlog

from pinpool import log


@pytest.fixture(autouse=True)
def _info_level() -> Iterator[None]:
    previous = log.set_fallback_level(logging.INFO)
    yield
    log.set_fallback_level(previous)


def test_unconfigured_events_go_to_stderr_not_stdout(capsys: pytest.CaptureFixture[str]) -> None:
    """Catches library events printed into the application's stdout (structlog's own default)."""
    log.get_logger("pinpool").info("pool.created", num_slots=4)
    out, err = capsys.readouterr()
    assert out == ""
    assert "pool.created" in err and "num_slots=4" in err


def test_debug_events_are_dropped_by_default(capsys: pytest.CaptureFixture[str]) -> None:
    """Catches routine debug events (stage.aborted) shown to every user at the default level."""
    logger = log.get_logger("pinpool")
    logger.debug("stage.aborted", slot=0)
    assert capsys.readouterr() == ("", "")
    log.set_fallback_level(logging.DEBUG)
    logger.debug("stage.aborted", slot=0)
    assert "stage.aborted" in capsys.readouterr().err


def test_a_configured_application_gets_the_events(capsys: pytest.CaptureFixture[str]) -> None:
    """Catches pinpool bypassing an application's structlog configuration (its processors, its sink)."""
    logger = log.get_logger("pinpool")  # made before the application configures: the choice is per call
    seen: list[str] = []

    def keep(_: Any, __: str, event_dict: MutableMapping[str, Any]) -> Mapping[str, Any]:
        seen.append(str(event_dict["event"]))
        raise structlog.DropEvent

    structlog.configure(processors=[keep])
    logger.warning("slot.stall", slot=1)
    assert seen == ["slot.stall"]
    assert capsys.readouterr() == ("", "")


def test_log_level_env_is_validated(monkeypatch: pytest.MonkeyPatch) -> None:
    """Catches a typo in PINPOOL_LOG_LEVEL silently falling back to some other level."""
    monkeypatch.delenv(log.LOG_LEVEL_ENV, raising=False)
    assert log.level_from_env(logging.WARNING) == logging.WARNING
    monkeypatch.setenv(log.LOG_LEVEL_ENV, "DEBUG")
    assert log.level_from_env() == logging.DEBUG
    monkeypatch.setenv(log.LOG_LEVEL_ENV, "loud")
    with pytest.raises(ValueError, match="PINPOOL_LOG_LEVEL"):
        log.level_from_env()
