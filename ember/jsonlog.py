"""Logs of the API and engine processes on stderr: one JSON object per line (``ts``, ``level``,
``logger``, ``msg`` and the record's ``extra`` fields) for machines, or one readable line per record
for people (``text``: time, level, logger, message, then ``key=value`` of the extra fields).
``auto`` picks text when stderr is a terminal and JSON otherwise."""

from __future__ import annotations

import json
import logging
import sys

_STANDARD = set(logging.LogRecord("", 0, "", 0, "", None, None).__dict__) | {"message", "asctime", "taskName"}


class JsonFormatter(logging.Formatter):
    def format(self, record: logging.LogRecord) -> str:
        out = {"ts": round(record.created, 6), "level": record.levelname, "logger": record.name, "msg": record.getMessage()}
        out.update({k: v for k, v in record.__dict__.items() if k not in _STANDARD})
        if record.exc_info:
            out["exc"] = self.formatException(record.exc_info)
        return json.dumps(out, default=str)


class TextFormatter(logging.Formatter):
    """``12:03:04.512 INFO  ember.engine  packed pass  requests=2 tokens=512 seconds=0.04``."""

    def format(self, record: logging.LogRecord) -> str:
        extra = " ".join(f"{k}={v}" for k, v in record.__dict__.items() if k not in _STANDARD)
        line = (f"{self.formatTime(record, '%H:%M:%S')}.{int(record.msecs):03d} {record.levelname:<5} "
                f"{record.name:<16} {record.getMessage()}" + (f"  {extra}" if extra else ""))
        if record.exc_info:
            line += "\n" + self.formatException(record.exc_info)
        return line


def resolve_format(fmt: str = "auto") -> str:
    """``text`` or ``json`` for ``fmt`` (``auto``: text on a terminal)."""
    if fmt not in ("auto", "text", "json"):
        raise ValueError(f"log format {fmt!r}: use auto, text or json")
    return ("text" if sys.stderr.isatty() else "json") if fmt == "auto" else fmt


def setup_logging(level: str = "INFO", fmt: str = "auto") -> None:
    """Send every logger's records to stderr, as JSON lines or readable text (see module doc)."""
    handler = logging.StreamHandler(sys.stderr)
    handler.setFormatter(TextFormatter() if resolve_format(fmt) == "text" else JsonFormatter())
    root = logging.getLogger()
    root.handlers[:] = [handler]
    root.setLevel(level.upper())
    logging.getLogger("alembic").setLevel(logging.WARNING)
    for name in ("uvicorn", "uvicorn.error"):
        logging.getLogger(name).handlers[:] = []
        logging.getLogger(name).propagate = True
