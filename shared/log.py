"""Logging: structlog configured once in each entry point's main(), and quiet library loggers.

Entry points (`teacherq`, `python -m consumer`) call `configure_logging`. Library code (the
client a trainer imports, shared/) gets its loggers from `get_logger`, which never configures
anything globally: while the process has not configured structlog, its events go to **stderr**
(never stdout), filtered at `TEACHERQ_LOG__LEVEL` — `warning` when that is unset, so a trainer
submitting thousands of jobs a step sees nothing unless something is wrong. Once the process
configures structlog (ours or the trainer's own setup), the loggers follow that configuration.
"""

from __future__ import annotations

import logging
import os
import sys
from typing import Any

import structlog

LEVEL_ENV = "TEACHERQ_LOG__LEVEL"
LIBRARY_DEFAULT_LEVEL = "warning"


def _level_number(level: str) -> int:
    mapping = logging.getLevelNamesMapping()
    if level.upper() not in mapping:
        raise ValueError(f"{LEVEL_ENV}={level!r}: expected debug, info, warning or error")
    return mapping[level.upper()]


def configure_logging(*, level: str = "info", fmt: str = "auto", **bound: object) -> None:
    """JSON lines off a TTY (or fmt='json'), pretty console on a TTY; bind `bound` fields
    (e.g. rank, tp_rank, dp_rank) into every event of this process. Logs go to stderr."""
    use_json = fmt == "json" or (fmt == "auto" and not sys.stderr.isatty())
    renderer: structlog.typing.Processor = (
        structlog.processors.JSONRenderer() if use_json else structlog.dev.ConsoleRenderer()
    )
    structlog.configure(
        processors=[
            structlog.contextvars.merge_contextvars,
            structlog.processors.add_log_level,
            structlog.processors.TimeStamper(fmt="iso", utc=True),
            structlog.processors.format_exc_info,
            renderer,
        ],
        wrapper_class=structlog.make_filtering_bound_logger(_level_number(level)),
        logger_factory=structlog.PrintLoggerFactory(file=sys.stderr),
        cache_logger_on_first_use=True,
    )
    structlog.contextvars.clear_contextvars()
    if bound:
        structlog.contextvars.bind_contextvars(**bound)


class _ToStructlog(logging.Handler):
    """Forwards stdlib logging records (and, through `logging.captureWarnings`, warnings.warn
    notices) to structlog: below ERROR at debug level, ERROR and above at their own."""

    def __init__(self) -> None:
        super().__init__(level=logging.DEBUG)
        self._log = structlog.get_logger("teacherq.libraries")

    def emit(self, record: logging.LogRecord) -> None:
        try:
            message = record.getMessage()
            if record.name == "py.warnings":  # "path:line: Category: text\n  source line"
                message = message.strip().splitlines()[0]
            fields = {"logger": record.name, "library_level": record.levelname.lower()}
            if record.levelno >= logging.ERROR:
                self._log.error("library.log", message=message, **fields)
            else:
                self._log.debug("library.log", message=message, **fields)
        except Exception:  # noqa: BLE001 - logging must never raise into the caller
            self.handleError(record)


def route_library_logs(*, level: str) -> None:
    """Send what libraries write through stdlib logging and `warnings.warn` (megatron-core's
    start-up notices, Apex / Transformer Engine fallbacks) into this process's structlog
    output at debug level, so that at the default level a consumer's output holds teacherq's
    own lines only. Their errors keep their level. Call once, from `main()`, after
    `configure_logging`."""
    root = logging.getLogger()
    for handler in list(root.handlers):
        if isinstance(handler, _ToStructlog):
            root.removeHandler(handler)
    root.addHandler(_ToStructlog())
    # Below debug nothing of theirs is shown, so records under ERROR are not even formatted.
    root.setLevel(logging.DEBUG if _level_number(level) <= logging.DEBUG else logging.ERROR)
    logging.captureWarnings(True)


def _library_logger(name: str) -> Any:
    """A logger of its own (no global state touched): stderr, JSON lines, the env's level."""
    raw = os.environ.get(LEVEL_ENV) or LIBRARY_DEFAULT_LEVEL
    try:
        level = _level_number(raw)
    except ValueError:
        level = logging.WARNING
    return structlog.wrap_logger(
        structlog.PrintLogger(sys.stderr),
        processors=[
            structlog.contextvars.merge_contextvars,
            structlog.processors.add_log_level,
            structlog.processors.TimeStamper(fmt="iso", utc=True),
            structlog.processors.format_exc_info,
            structlog.processors.JSONRenderer(),
        ],
        wrapper_class=structlog.make_filtering_bound_logger(level),
        logger_name=name,
    )


class LibraryLogger:
    """A structlog logger for library code: follows the process's structlog configuration
    once there is one, else writes to stderr at `TEACHERQ_LOG__LEVEL` (see the module doc).
    Resolved on first use, so importing a module does no logging work."""

    def __init__(self, name: str) -> None:
        self._name = name
        self._configured: Any = None
        self._fallback: Any = None

    def _target(self) -> Any:
        if structlog.is_configured():
            if self._configured is None:
                self._configured = structlog.get_logger(self._name)
            return self._configured
        if self._fallback is None:
            self._fallback = _library_logger(self._name)
        return self._fallback

    def __getattr__(self, method: str) -> Any:
        return getattr(self._target(), method)


def get_logger(name: str) -> Any:
    """The logger library modules use instead of `structlog.get_logger` (module doc)."""
    return LibraryLogger(name)
