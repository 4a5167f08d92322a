"""HERMIT_LOG_FORMAT: text or JSON lines (common/hermit_common/logformat.py)."""

from __future__ import annotations

import io
import json
import logging

import pytest

from hermit_common import logformat
from hermit_common.errors import SettingsError
from hermit_common.settings import NodeSettings, OperatorSettings


def _line(log_format: str, exc: bool = False) -> str:
    out = io.StringIO()
    handler = logging.StreamHandler(out)
    handler.setFormatter(logformat.formatter(log_format))
    logger = logging.getLogger("hermit.test-logformat")
    logger.propagate = False
    logger.handlers[:] = [handler]
    try:
        if exc:
            try:
                raise ValueError("boom")
            except ValueError:
                logger.exception("checkpoint %s failed", "agent-1-preempt")
        else:
            logger.warning("checkpoint %s failed", "agent-1-preempt")
    finally:
        logger.handlers[:] = []
    return out.getvalue()


def test_json_lines_have_the_fields_log_pipelines_parse() -> None:
    record = json.loads(_line("json"))
    assert record["level"] == "WARNING" and record["logger"] == "hermit.test-logformat"
    assert record["message"] == "checkpoint agent-1-preempt failed" and record["time"]
    with_exc = json.loads(_line("json", exc=True))
    assert "ValueError: boom" in with_exc["exc_info"]
    text = _line("text")
    assert text.endswith("WARNING hermit.test-logformat checkpoint agent-1-preempt failed\n")


def test_configure_adds_one_handler_only_to_a_root_logger_without_one() -> None:
    root = logging.getLogger()
    saved = root.handlers[:], root.level
    try:
        root.handlers[:] = []
        handler = logformat.configure("INFO", "json")
        assert handler is not None and root.handlers == [handler]
        assert logformat.configure("DEBUG", "json") is None and root.handlers == [handler]
        assert root.level == logging.DEBUG
    finally:
        root.handlers[:], level = saved
        root.setLevel(level)


@pytest.mark.parametrize("settings", [NodeSettings, OperatorSettings])
def test_the_setting_is_checked_and_named(settings: type[NodeSettings] | type[OperatorSettings],
                                          ) -> None:
    env = {"HERMIT_NODE_NAME": "n1", "HERMIT_S3_BUCKET": "bkt"}
    assert settings.from_env(env).log_format == "text"
    assert settings.from_env({**env, "HERMIT_LOG_FORMAT": "json"}).log_format == "json"
    with pytest.raises(SettingsError, match="HERMIT_LOG_FORMAT='xml' is not one of text, json"):
        settings.from_env({**env, "HERMIT_LOG_FORMAT": "xml"})
