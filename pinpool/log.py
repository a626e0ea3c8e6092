"""The structlog loggers pinpool's packages log through, and where their events go.

The library never calls ``structlog.configure``: that belongs to the application. Where
the application has configured structlog, pinpool's events follow its configuration.
Where it has not, they go to **stderr, at info and above**, never to stdout, so a
program's own output stays its own. Filtered levels cost one call that returns at once.

Event names are stable API (dashboards match on them): ``pool.created``, ``pool.closed``,
``consumer.registered`` (info); ``slot.stall``, ``stage.overflow`` (warning);
``stage.aborted`` (debug: a routine exception unwinding a stage).

Example::

    from pinpool.log import get_logger

    log = get_logger("pinpool")
    log.info("pool.created", num_slots=4)  # stderr: "pool.created  num_slots=4"
    log.debug("stage.aborted", slot=0)     # dropped unless the level is debug

``PINPOOL_LOG_LEVEL`` (debug, info, warning, error) sets the level of the fallback
logger in the ``pinpool`` command line; read it with :func:`level_from_env`.
"""

from __future__ import annotations

import logging
import os
import sys
from typing import Any

import structlog

#: The environment variable the ``pinpool`` command line reads its log level from.
LOG_LEVEL_ENV = "PINPOOL_LOG_LEVEL"
_LEVELS = {"debug": logging.DEBUG, "info": logging.INFO, "warning": logging.WARNING, "error": logging.ERROR}


class _Stderr:
    """Whatever ``sys.stderr`` is at write time (pytest and applications swap it)."""

    def write(self, text: str) -> int:
        return sys.stderr.write(text)

    def flush(self) -> None:
        sys.stderr.flush()


def _fallback(level: int) -> Any:
    return structlog.wrap_logger(
        structlog.PrintLogger(_Stderr()),  # type: ignore[arg-type]
        wrapper_class=structlog.make_filtering_bound_logger(level),
        processors=[
            structlog.processors.add_log_level,
            structlog.processors.TimeStamper(fmt="%H:%M:%S", utc=True),
            structlog.dev.ConsoleRenderer(colors=False),
        ],
    )


_fallback_level = logging.INFO
_fallback_logger: Any = _fallback(_fallback_level)
# One bound logger per package name, so that a call binds nothing (cleared on a level change).
_fallback_by_name: dict[str, Any] = {}


def fallback_level() -> int:
    """The level of the stderr logger used while the application has not configured structlog."""
    return _fallback_level


def set_fallback_level(level: int) -> int:
    """Set the level of the stderr logger used while the application has not configured structlog.

    Returns the level it replaces, so that a caller can put it back.
    """
    global _fallback_logger, _fallback_level
    previous, _fallback_level = _fallback_level, level
    _fallback_logger = _fallback(level)
    _fallback_by_name.clear()
    return previous


def level_from_env(default: int = logging.INFO) -> int:
    """The level ``PINPOOL_LOG_LEVEL`` names, or ``default`` when it is unset.

    Raises ``ValueError`` naming the variable and the accepted values for anything else.
    """
    raw = os.environ.get(LOG_LEVEL_ENV, "").strip().lower()
    if not raw:
        return default
    if raw not in _LEVELS:
        raise ValueError(f"'{LOG_LEVEL_ENV}' must be one of {', '.join(_LEVELS)} (got {raw!r})")
    return _LEVELS[raw]


class PinpoolLogger:
    """A logger that follows the application's structlog config, or falls back to stderr.

    The choice is made at each call, so an application that configures structlog after
    importing pinpool still gets pinpool's events through its own pipeline.

    >>> log = PinpoolLogger("pinpool")
    >>> log.debug("stage.aborted", slot=0)  # below the fallback's info level: nothing printed
    """

    __slots__ = ("_name",)

    def __init__(self, name: str) -> None:
        self._name = name

    def _target(self) -> Any:
        if structlog.is_configured():
            return structlog.get_logger(self._name)
        bound = _fallback_by_name.get(self._name)
        if bound is None:
            bound = _fallback_by_name[self._name] = _fallback_logger.bind(logger=self._name)
        return bound

    def debug(self, event: str, **kw: Any) -> None:
        self._target().debug(event, **kw)

    def info(self, event: str, **kw: Any) -> None:
        self._target().info(event, **kw)

    def warning(self, event: str, **kw: Any) -> None:
        self._target().warning(event, **kw)

    def error(self, event: str, **kw: Any) -> None:
        self._target().error(event, **kw)


def get_logger(name: str) -> PinpoolLogger:
    """The logger for one of pinpool's packages (``"pinpool"``, ``"memcache"``, ...)."""
    return PinpoolLogger(name)
