"""kvscope's log records through vLLM's handlers: vLLM configures only its own `vllm` logger."""

from __future__ import annotations

import logging


def log_through_vllm() -> None:
    """Send kvscope's log records through vLLM's handlers too: vLLM configures only its own `vllm`
    logger, so kvscope's INFO lines (the start-up summary that sizes the host tier) were dropped
    and its warnings printed bare. Once per process. Records still propagate (tests capture them),
    and where the root logger prints them (the user configured logging) vLLM's handlers do not."""
    ours, theirs = logging.getLogger("connector"), logging.getLogger("vllm")
    if any(isinstance(h, _ThroughVllm) for h in ours.handlers) or not theirs.handlers:
        return
    ours.addHandler(_ThroughVllm(theirs.handlers))  # vLLM's own list: a later dictConfig's handlers too
    if ours.level == logging.NOTSET and not logging.getLogger().handlers:
        ours.setLevel(theirs.getEffectiveLevel())


class _ThroughVllm(logging.Handler):
    """vLLM's handlers for kvscope's records, unless the root logger has handlers of its own."""

    def __init__(self, handlers):
        super().__init__()
        self._handlers = handlers

    def emit(self, record: logging.LogRecord) -> None:
        if logging.getLogger().handlers:
            return  # printed there already
        for handler in self._handlers:
            if record.levelno >= handler.level:
                handler.handle(record)
