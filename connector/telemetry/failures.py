"""Telemetry that fails costs a span or a stat, never an engine step.

vLLM's connector hooks run in the engine core: an exception out of one kills the engine. The export
path catches its own failures (sinks, the helper, a full queue); a fault in recording itself (a
bug, an odd value) is caught where the connector calls it, after the transfer's bookkeeping, and
logged here once per place with its traceback.
"""

from __future__ import annotations

import logging

logger = logging.getLogger(__name__)

_logged: set[str] = set()


def telemetry_failed(where: str) -> None:
    """Log the exception being handled (once per ``where``): what it cost, not the transfer."""
    if where in _logged:
        return
    _logged.add(where)
    logger.exception("kvscope: telemetry failed in %s; its spans or metrics are lost, the KV transfer is not "
                     "(further failures here are not logged)", where)
