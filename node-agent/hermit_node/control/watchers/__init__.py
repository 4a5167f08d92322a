"""Interruption watchers: cloud metadata services -> ``Notice`` objects."""

from __future__ import annotations

from hermit_node.control.watchers.aws import AwsImdsWatcher
from hermit_node.control.watchers.azure import AzureScheduledEventsWatcher
from hermit_node.control.watchers.base import NullWatcher, Watcher
from hermit_node.control.watchers.errors import MetadataUnavailable, NoticeParseError
from hermit_node.control.watchers.factory import build_watcher
from hermit_node.control.watchers.gcp import GcpMetadataWatcher
from hermit_node.control.watchers.notice import Notice

__all__ = [
    "AwsImdsWatcher",
    "AzureScheduledEventsWatcher",
    "GcpMetadataWatcher",
    "MetadataUnavailable",
    "Notice",
    "NoticeParseError",
    "NullWatcher",
    "Watcher",
    "build_watcher",
]
