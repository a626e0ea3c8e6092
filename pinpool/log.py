"""The loggers pinpool's packages log through: stdlib ``logging``, by way of structlog.

Each package logs under its own stdlib logger (``pinpool``, ``sampling``, ``memcache``), so
its level and handlers are the application's to set, as for any library::

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

Printing the events on stderr is an application's choice: the ``pinpool`` command line makes
it in ``pinpool.bench.stderr_log`` (``PINPOOL_LOG_LEVEL``).
"""

from __future__ import annotations

import logging
from collections.abc import Mapping, MutableMapping
from typing import Any

import structlog

#: The stdlib loggers pinpool's packages log under (one per top-level package).
PACKAGE_LOGGERS = ("pinpool", "sampling", "memcache")


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
