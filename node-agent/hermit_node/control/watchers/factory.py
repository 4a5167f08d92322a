"""Picks the watcher for the configured cloud."""

from __future__ import annotations

import requests

from hermit_common.errors import SettingsError
from hermit_common.settings import WatcherSettings
from hermit_node.control.watchers.aws import AwsImdsWatcher
from hermit_node.control.watchers.azure import AzureScheduledEventsWatcher
from hermit_node.control.watchers.base import NullWatcher, Watcher
from hermit_node.control.watchers.gcp import GcpMetadataWatcher

_WATCHERS: dict[str, type[Watcher]] = {
    "aws": AwsImdsWatcher,
    "gcp": GcpMetadataWatcher,
    "azure": AzureScheduledEventsWatcher,
    "none": NullWatcher,
}


def build_watcher(settings: WatcherSettings, session: requests.Session | None = None) -> Watcher:
    """The watcher for ``settings.provider`` (aws, gcp, azure, or none: never notifies)."""
    cls = _WATCHERS.get(settings.provider)
    if cls is None:
        raise SettingsError(f"HERMIT_CLOUD_PROVIDER={settings.provider!r} has no watcher")
    return cls(settings, session)
