"""Log lines as text or JSON (``HERMIT_LOG_FORMAT``), the same for both components.

JSON is python-json-logger's formatter (kopf depends on it already): one object per
line with ``time``, ``level``, ``logger`` and ``message``, plus ``exc_info`` when there
is one, for log pipelines that parse fields instead of text.
"""

from __future__ import annotations

import logging
import sys
from typing import Final

TEXT: Final = "text"
JSON: Final = "json"
FORMATS: Final = (TEXT, JSON)
TEXT_FORMAT: Final = "%(asctime)s %(levelname)s %(name)s %(message)s"


def formatter(log_format: str) -> logging.Formatter:
    if log_format == JSON:
        from pythonjsonlogger.json import JsonFormatter

        return JsonFormatter(TEXT_FORMAT, rename_fields={
            "asctime": "time", "levelname": "level", "name": "logger"})
    return logging.Formatter(TEXT_FORMAT)


def configure(level: str, log_format: str) -> logging.Handler | None:
    """A handler on the root logger, to stderr, in ``log_format``, returned; as
    ``logging.basicConfig``, none when the root logger has handlers already (a program
    that embeds us, a test runner)."""
    root = logging.getLogger()
    root.setLevel(level)
    if root.handlers:
        return None
    handler = logging.StreamHandler(sys.stderr)
    handler.setFormatter(formatter(log_format))
    root.addHandler(handler)
    return handler


def use_format(log_format: str) -> None:
    """``log_format`` on every handler the root logger has (set up before the settings
    were read)."""
    for handler in logging.getLogger().handlers:
        handler.setFormatter(formatter(log_format))
