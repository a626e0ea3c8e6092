"""The structlog logger pinpool's packages log through.

Event names are stable API (dashboards match on them): ``pool.created``, ``pool.closed``,
``slot.stall``, ``stage.overflow``, ``stage.aborted``, ``consumer.registered``.
"""

from __future__ import annotations

from typing import Any

import structlog


def get_logger(name: str) -> Any:
    return structlog.get_logger(name)
