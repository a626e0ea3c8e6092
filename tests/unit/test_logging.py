"""pinpool.log: events go through stdlib logging under the package's logger; the application sets level and handlers."""

from __future__ import annotations

import logging
import os
import subprocess
import sys
from collections.abc import Iterator, Mapping, MutableMapping
from pathlib import Path
from typing import Any

import pytest
import structlog

from pinpool import log
from pinpool.bench import stderr_log

ROOT = Path(__file__).resolve().parents[2]


@pytest.fixture(autouse=True)
def _no_stderr_handler() -> Iterator[None]:
    """A test that turns on the CLI's stderr handler must not leave it on for the next."""
    yield
    stderr_log.log_to_stderr(None)


def test_unconfigured_library_shows_nothing_below_warning(tmp_path: Path) -> None:
    """Catches info events (pool.created) printed by a library whose user configured no logging."""
    script = (
        "from pinpool.log import get_logger\n"
        "logger = get_logger('pinpool')\n"
        "logger.debug('stage.aborted', slot=0)\n"
        "logger.info('pool.created', num_slots=4)\n"
        "logger.warning('slot.stall', slot=1)\n"
    )
    env = {**os.environ, "PYTHONPATH": str(ROOT)}
    done = subprocess.run([sys.executable, "-c", script], capture_output=True, text=True, env=env, cwd=tmp_path)
    assert done.returncode == 0, done.stderr
    assert done.stdout == ""
    # stdlib's last-resort handler: warnings still reach someone when nothing is configured.
    assert done.stderr == "slot.stall slot=1\n"


def test_the_stdlib_logger_level_controls_the_events(caplog: pytest.LogCaptureFixture) -> None:
    """Catches `logging.getLogger("pinpool").setLevel(...)` having no effect (the engines' way to tune it)."""
    logger = log.get_logger("pinpool")
    caplog.set_level(logging.DEBUG, logger="pinpool")
    logger.debug("stage.aborted", slot=0, generation=3)
    (record,) = caplog.records
    assert (record.name, record.levelno, record.event) == ("pinpool", logging.DEBUG, "stage.aborted")  # type: ignore[attr-defined]
    assert record.getMessage() == "stage.aborted slot=0 generation=3"
    caplog.clear()
    logging.getLogger("pinpool").setLevel(logging.ERROR)
    logger.warning("slot.stall", slot=1)
    assert caplog.records == []


def test_each_package_logs_under_its_own_name(caplog: pytest.LogCaptureFixture) -> None:
    """Catches memcache's events logged under pinpool's logger (an application could not tell them apart)."""
    caplog.set_level(logging.INFO)
    log.get_logger("memcache").info("pool.created", rows=2)
    assert [r.name for r in caplog.records] == ["memcache"]


def test_a_configured_structlog_application_gets_the_events(capsys: pytest.CaptureFixture[str]) -> None:
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


def test_log_to_stderr_is_undone_by_none(capsys: pytest.CaptureFixture[str]) -> None:
    """Catches the CLI's stderr handler or level left on pinpool's loggers after an in-process run."""
    logger = logging.getLogger("pinpool")
    before = logger.level
    assert stderr_log.log_to_stderr(logging.INFO) is None
    log.get_logger("pinpool").info("pool.created", num_slots=4)
    assert "pool.created num_slots=4" in capsys.readouterr().err
    assert stderr_log.log_to_stderr(None) == logging.INFO
    assert logger.level == before and logger.handlers == []
    assert stderr_log.stderr_level() is None


def test_log_level_env_is_validated(monkeypatch: pytest.MonkeyPatch) -> None:
    """Catches a typo in PINPOOL_LOG_LEVEL silently falling back to some other level."""
    monkeypatch.delenv(stderr_log.LOG_LEVEL_ENV, raising=False)
    assert stderr_log.level_from_env() == logging.WARNING
    monkeypatch.setenv(stderr_log.LOG_LEVEL_ENV, "DEBUG")
    assert stderr_log.level_from_env() == logging.DEBUG
    monkeypatch.setenv(stderr_log.LOG_LEVEL_ENV, "loud")
    with pytest.raises(ValueError, match="PINPOOL_LOG_LEVEL"):
        stderr_log.level_from_env()
