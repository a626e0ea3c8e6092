"""For applications (the ``pinpool`` command line): print the packages' log events on stderr.

The library itself adds no handler (``pinpool.log``); the command line reads its level from
``PINPOOL_LOG_LEVEL`` (debug, info, warning, error).
"""

from __future__ import annotations

import logging
import os
import sys

from pinpool.log import PACKAGE_LOGGERS

#: The environment variable the ``pinpool`` command line reads its log level from.
LOG_LEVEL_ENV = "PINPOOL_LOG_LEVEL"
_LEVELS = {"debug": logging.DEBUG, "info": logging.INFO, "warning": logging.WARNING, "error": logging.ERROR}


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
