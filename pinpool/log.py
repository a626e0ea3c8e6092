"""pinpool's loggers: stdlib ``logging`` by way of structlog (or the application's structlog setup, if any).
Messages read ``event key=value ...``; ``record.event`` carries the bare name. Events: docs/rules.md, "Logging"."""

import logging
from collections.abc import Mapping, MutableMapping
from typing import Any

import structlog

PACKAGE_LOGGERS = ("pinpool", "sampling", "memcache")


def _to_record(_: Any, __: str, event_dict: MutableMapping[str, Any]) -> Mapping[str, Any]:
    """An event as ``logger.<level>()`` kwargs: every field in the message, the name in ``extra``."""
    event = str(event_dict.pop("event"))
    fields = " ".join(f"{key}={value!r}" for key, value in event_dict.items())
    return {"msg": f"{event} {fields}" if fields else event, "extra": {"event": event}}


class PinpoolLogger:
    """One package's logger: the application's structlog configuration if it has one, else stdlib."""

    __slots__ = ("_stdlib", "_structured")

    def __init__(self, name: str) -> None:
        self._stdlib = logging.getLogger(name)
        # What ``structlog.wrap_logger`` would bind on first use, bound now.
        self._structured = structlog.stdlib.BoundLogger(self._stdlib, [_to_record], {})

    def _emit(self, level: int, method: str, event: str, kw: dict[str, Any]) -> None:
        if structlog.is_configured():
            getattr(structlog.get_logger(self._stdlib.name), method)(event, **kw)
        elif self._stdlib.isEnabledFor(level):  # cached per logger: a filtered event costs one check
            getattr(self._structured, method)(event, **kw)

    def debug(self, event: str, **kw: Any) -> None:
        self._emit(logging.DEBUG, "debug", event, kw)

    def info(self, event: str, **kw: Any) -> None:
        self._emit(logging.INFO, "info", event, kw)

    def warning(self, event: str, **kw: Any) -> None:
        self._emit(logging.WARNING, "warning", event, kw)


def get_logger(name: str) -> PinpoolLogger:
    """The logger for one of pinpool's packages (``"pinpool"``, ``"memcache"``, ...)."""
    return PinpoolLogger(name)
