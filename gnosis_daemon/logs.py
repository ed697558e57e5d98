"""structlog, configured once per process.

JSON lines when stderr is not a terminal, readable lines when it is. Every line carries
``component`` (supervisor, station, host); inside a request, ``request_id`` is bound through
contextvars (``bind_request``) and travels from host to station in each frame.
"""

from __future__ import annotations

import contextlib
import logging
import sys
from typing import Iterator

import structlog

def configure_logging(component: str, level: str = "info", fmt: str = "auto") -> None:
    """Configure structlog and stdlib logging for this process (idempotent per component)."""
    use_json = fmt == "json" or (fmt == "auto" and not sys.stderr.isatty())

    def add_component(_logger, _method, event_dict):
        # A processor, not a bound contextvar: threads start with an empty context, and
        # lines from the station's engine thread must carry the component too.
        return {"component": component, **event_dict}

    processors: list = [
        add_component,
        structlog.contextvars.merge_contextvars,
        structlog.processors.add_log_level,
        structlog.processors.TimeStamper(fmt="iso", utc=True),
        structlog.processors.StackInfoRenderer(),
        structlog.processors.format_exc_info,
    ]
    renderer = (structlog.processors.JSONRenderer() if use_json
                else structlog.dev.ConsoleRenderer(colors=sys.stderr.isatty()))
    structlog.configure(
        processors=processors + [renderer],
        wrapper_class=structlog.make_filtering_bound_logger(logging.getLevelName(level.upper())),
        logger_factory=structlog.PrintLoggerFactory(file=sys.stderr),
        cache_logger_on_first_use=True,
    )
    structlog.contextvars.clear_contextvars()
    # Libraries that use stdlib logging (hypercorn, transformers) go to stderr at WARNING+.
    logging.basicConfig(level=logging.WARNING, stream=sys.stderr, force=True,
                        format=f"%(asctime)s {component} %(name)s %(levelname)s %(message)s")


def get_logger(name: str | None = None) -> structlog.stdlib.BoundLogger:
    return structlog.get_logger(name) if name else structlog.get_logger()


@contextlib.contextmanager
def bind_request(request_id: str | None) -> Iterator[None]:
    """Bind ``request_id`` to every log line emitted inside the block (contextvars: per task)."""
    if not request_id:
        yield
        return
    with structlog.contextvars.bound_contextvars(request_id=request_id):
        yield
