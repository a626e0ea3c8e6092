"""The loggers pinpool's packages log through: stdlib ``logging``, by way of structlog.

Each package logs under its own stdlib logger (``pinpool``, ``sampling``, ``memcache``,
``engine``), so its level and handlers are the application's to set, as for any library::

    logging.getLogger("pinpool").setLevel(logging.DEBUG)

The library adds no handler and sets no level. With nothing configured, stdlib's last-resort
handler prints warnings and above on stderr and drops the rest: a library user sees nothing
below warning. With ``logging.basicConfig(level=logging.INFO)``, ``pool.created`` arrives as
a record whose message starts with the event name, then ``key=value`` fields; the record
also carries the bare name as ``record.event``.

Where the application has configured structlog itself, pinpool's events follow that
configuration instead (its processors, its sink): the choice is made at each call, so an
application that configures logging after importing pinpool is still obeyed.

Event names are stable API (dashboards match on them): ``pool.created``, ``pool.closed``,
``consumer.registered`` (info); ``slot.stall``, ``stage.overflow`` (warning);
``stage.aborted`` (debug: a routine exception unwinding a stage).

``PINPOOL_LOG_LEVEL`` (debug, info, warning, error) is read by the ``pinpool`` command line
only, which is an application: it calls :func:`log_to_stderr` with :func:`level_from_env`.
"""

from __future__ import annotations

import logging
import os
import sys
from collections.abc import Mapping, MutableMapping
from typing import Any

import structlog

#: The environment variable the ``pinpool`` command line reads its log level from.
LOG_LEVEL_ENV = "PINPOOL_LOG_LEVEL"
#: The stdlib loggers pinpool's packages log under (one per top-level package).
PACKAGE_LOGGERS = ("pinpool", "sampling", "memcache", "engine")
_LEVELS = {"debug": logging.DEBUG, "info": logging.INFO, "warning": logging.WARNING, "error": logging.ERROR}


def _to_record(_: Any, __: str, event_dict: MutableMapping[str, Any]) -> Mapping[str, Any]:
    """Render an event as stdlib ``logger.<level>()`` keyword arguments.

    The message carries every field, so a plain ``basicConfig`` shows them; ``extra`` gives
    handlers the bare event name without parsing the message.
    """
    event = str(event_dict.pop("event"))
    fields = " ".join(f"{key}={value!r}" for key, value in event_dict.items())
    return {"msg": f"{event} {fields}" if fields else event, "extra": {"event": event}}


class PinpoolLogger:
    """One package's logger: the application's structlog configuration if it has one, else stdlib.

    >>> log = PinpoolLogger("pinpool")
    >>> log.debug("stage.aborted", slot=0)  # below the stdlib default (warning): nothing printed
    """

    __slots__ = ("_name", "_stdlib", "_structured")

    def __init__(self, name: str) -> None:
        self._name = name
        self._stdlib = logging.getLogger(name)
        self._structured: Any = structlog.wrap_logger(
            self._stdlib,
            wrapper_class=structlog.stdlib.BoundLogger,
            processors=[_to_record],
            context_class=dict,
            cache_logger_on_first_use=True,  # built once, not at every event
        )

    def _emit(self, level: int, method: str, event: str, kw: dict[str, Any]) -> None:
        if structlog.is_configured():
            getattr(structlog.get_logger(self._name), method)(event, **kw)
        # A filtered level costs this one check: stdlib caches the answer per logger.
        elif self._stdlib.isEnabledFor(level):
            getattr(self._structured, method)(event, **kw)

    def debug(self, event: str, **kw: Any) -> None:
        self._emit(logging.DEBUG, "debug", event, kw)

    def info(self, event: str, **kw: Any) -> None:
        self._emit(logging.INFO, "info", event, kw)

    def warning(self, event: str, **kw: Any) -> None:
        self._emit(logging.WARNING, "warning", event, kw)

    def error(self, event: str, **kw: Any) -> None:
        self._emit(logging.ERROR, "error", event, kw)


def get_logger(name: str) -> PinpoolLogger:
    """The logger for one of pinpool's packages (``"pinpool"``, ``"memcache"``, ...)."""
    return PinpoolLogger(name)


def level_from_env(default: int = logging.WARNING) -> int:
    """The level ``PINPOOL_LOG_LEVEL`` names, or ``default`` when it is unset.

    Raises ``ValueError`` naming the variable and the accepted values for anything else.
    """
    raw = os.environ.get(LOG_LEVEL_ENV, "").strip().lower()
    if not raw:
        return default
    if raw not in _LEVELS:
        raise ValueError(f"'{LOG_LEVEL_ENV}' must be one of {', '.join(_LEVELS)} (got {raw!r})")
    return _LEVELS[raw]


class _Stderr:
    """Whatever ``sys.stderr`` is at write time (pytest and applications swap it)."""

    def write(self, text: str) -> int:
        return sys.stderr.write(text)

    def flush(self) -> None:
        sys.stderr.flush()


_stderr_handler = logging.StreamHandler(_Stderr())
_stderr_handler.setFormatter(logging.Formatter("%(asctime)s %(levelname)s %(name)s: %(message)s", "%H:%M:%S"))
#: Each package logger's own level from before log_to_stderr set it, to put back on removal.
_levels_before: dict[str, int] = {}


def stderr_level() -> int | None:
    """The level :func:`log_to_stderr` set, or None while it is off."""
    return _stderr_handler.level if _levels_before else None


def log_to_stderr(level: int | None) -> int | None:
    """For applications (the ``pinpool`` command line): print the packages' events at ``level`` and up on stderr.

    ``None`` takes the handler off again and puts the loggers' levels back. Returns the
    level it replaces (None when it was off), so that a caller can restore it.
    """
    previous = stderr_level()
    for name in PACKAGE_LOGGERS:
        logger = logging.getLogger(name)
        if level is None:
            logger.removeHandler(_stderr_handler)
            if name in _levels_before:
                logger.setLevel(_levels_before.pop(name))
            continue
        _levels_before.setdefault(name, logger.level)
        logger.setLevel(level)
        if _stderr_handler not in logger.handlers:
            logger.addHandler(_stderr_handler)
    if level is not None:
        _stderr_handler.setLevel(level)
    return previous
