"""Interruption watchers: cloud metadata services -> ``Notice`` objects."""

from __future__ import annotations

from hermit_node.watchers.aws import AwsImdsWatcher
from hermit_node.watchers.azure import AzureScheduledEventsWatcher
from hermit_node.watchers.base import NullWatcher, Watcher
from hermit_node.watchers.errors import MetadataUnavailable, NoticeParseError
from hermit_node.watchers.factory import build_watcher
from hermit_node.watchers.gcp import GcpMetadataWatcher
from hermit_node.watchers.notice import Notice

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
