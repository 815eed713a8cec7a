"""Structured logging for the node agent: one JSON object per line.

Built on the standard ``logging`` module (no extra dependency on the node). Lines go to stdout (the
journal under systemd) and, once the data volume is mounted, also to a file on it
(:func:`add_file_handler`), so that the history of a job survives the instance.

Each line has ``time`` (UTC, ISO 8601 with milliseconds), ``level``, ``logger``, ``message`` and any
fields passed as ``extra={...}``. Fields whose name contains ``token`` (any case) are replaced by
``"<redacted>"``, and the IMDS client never passes its token to a logger, so the IMDS session token
never reaches a log.
"""

from __future__ import annotations

import json
import logging
import os
import sys
import time
from pathlib import Path
from typing import IO, Any

from spot_training.contract import AGENT_LOG_FILE

#: The agent's logger name; modules log through children (``spot_training.agent.ebs``, ...).
LOGGER_NAME = "spot_training.agent"
# AGENT_LOG_FILE: the agent's log on the data volume, inside ``training.log_dir`` (the contract's name).
REDACTED = "<redacted>"

# Attributes every LogRecord has; everything else on a record came from ``extra=``.
_STANDARD_ATTRS = frozenset(vars(logging.LogRecord("", 0, "", 0, "", (), None))) | {"message", "asctime", "taskName"}


def _redact(key: str, value: Any) -> Any:
    return REDACTED if "token" in key.lower() else value


class JsonLineFormatter(logging.Formatter):
    """Formats a record as one JSON line; ``extra`` fields become top-level keys (token-like keys
    redacted); exceptions go into ``exception`` as formatted text."""

    def format(self, record: logging.LogRecord) -> str:
        entry: dict[str, Any] = {
            "time": time.strftime("%Y-%m-%dT%H:%M:%S", time.gmtime(record.created)) + f".{int(record.msecs):03d}Z",
            "level": record.levelname,
            "logger": record.name,
            "message": record.getMessage(),
        }
        for key, value in vars(record).items():
            if key not in _STANDARD_ATTRS and not key.startswith("_"):
                entry[key] = _redact(key, value)
        if record.exc_info:
            entry["exception"] = self.formatException(record.exc_info)
        return json.dumps(entry, default=str, ensure_ascii=False)


def setup_logging(*, level: int | str = logging.INFO, stream: IO[str] | None = None) -> logging.Logger:
    """Configure the ``spot_training.agent`` logger once: JSON lines to ``stream`` (default ``sys.stdout``).

    Idempotent: calling it again replaces the stream handler instead of adding a second one. Returns
    the ``spot_training.agent`` logger; modules use ``logging.getLogger(__name__)``.
    """
    logger = logging.getLogger(LOGGER_NAME)
    logger.setLevel(level)
    logger.propagate = False
    for handler in list(logger.handlers):
        if getattr(handler, "_spot_training_stream", False):
            logger.removeHandler(handler)  # not closed: it does not own the stream
    handler = logging.StreamHandler(stream if stream is not None else sys.stdout)
    handler.setFormatter(JsonLineFormatter())
    handler._spot_training_stream = True  # type: ignore[attr-defined]
    logger.addHandler(handler)
    return logger


class _NoFollowFileHandler(logging.FileHandler):
    """A FileHandler that opens its file with :func:`spot_training.agent.safepath.open_file`: the log lives on
    the data volume, which the training user controls, and the agent runs as root, so neither the
    directory nor ``agent.jsonl`` may be a symlink the user planted."""

    def _open(self):  # type: ignore[override]
        from spot_training.agent.safepath import open_file

        fd = open_file(self.baseFilename, os.O_WRONLY | os.O_APPEND | os.O_CREAT, create_parents=True)
        return os.fdopen(fd, "a", encoding=self.encoding, errors=self.errors)


def add_file_handler(log_dir: str | os.PathLike[str]) -> Path:
    """Also write the agent's log to ``<log_dir>/agent.jsonl`` (appending), creating ``log_dir``.

    Call it only after the data volume is mounted, so the file lands on the volume and not on the
    root disk. Idempotent for the same path. Returns the file's path. Never follows a symlink the
    training user planted: raises :class:`spot_training.agent.safepath.UnsafePathError` (exit 78) instead;
    OSError if the directory cannot be created.
    """
    path = Path(log_dir) / AGENT_LOG_FILE
    logger = logging.getLogger(LOGGER_NAME)
    for handler in logger.handlers:
        if isinstance(handler, logging.FileHandler) and Path(handler.baseFilename) == Path(os.path.abspath(path)):
            return path
    handler = _NoFollowFileHandler(path, encoding="utf-8")
    handler.setFormatter(JsonLineFormatter())
    logger.addHandler(handler)
    return path


def flush_logs() -> None:
    """Flush every handler of the agent's logger and fsync the file handlers' files (before the
    instance may be terminated)."""
    for handler in logging.getLogger(LOGGER_NAME).handlers:
        handler.flush()
        stream = getattr(handler, "stream", None)
        if isinstance(handler, logging.FileHandler) and stream is not None:
            try:
                os.fsync(stream.fileno())
            except (OSError, ValueError):
                pass  # closed or not a real file: nothing more to make durable


def close_file_handlers() -> None:
    """Flush and remove the file handlers (before the volume is unmounted)."""
    logger = logging.getLogger(LOGGER_NAME)
    flush_logs()
    for handler in list(logger.handlers):
        if isinstance(handler, logging.FileHandler):
            logger.removeHandler(handler)
            handler.close()
