"""Errors raised by the interruption watchers (both are ``HermitError``s)."""

from __future__ import annotations

from hermit_common.errors import HermitError, Retryable


class NoticeParseError(HermitError):
    """A metadata document announcing an interruption could not be understood."""


class MetadataUnavailable(Retryable):
    """The cloud's metadata service could not be reached or refused the request."""
