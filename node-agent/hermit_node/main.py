"""The node-agent's start-up: settings, logging, everything built once and wired together
(``build_agent``), then the threads and the main loop (``run_agent``, what
``hermit-node run`` runs). The loop itself is ``control.agent.NodeAgent``.
"""

from __future__ import annotations

import dataclasses
import logging
import signal
import threading
from collections.abc import Mapping
from pathlib import Path
from typing import TYPE_CHECKING, Any

from hermit_common import health as http_health
from hermit_common import logformat
from hermit_common import metrics as hermit_metrics
from hermit_common.bandwidth import UploadLimiter
from hermit_common.chunkcache import ChunkCache
from hermit_common.errors import SettingsError
from hermit_common.settings import NodeSettings, redacted
from hermit_node.control import health as agent_health
from hermit_node.control import metrics
from hermit_node.control.agent import NodeAgent
from hermit_node.control.collect import Collector
from hermit_node.control.fence import Fence
from hermit_node.control.informer import WatchedNode
from hermit_node.control.kube import Kube
from hermit_node.control.ports import (
    NO_CAPTURE_WATCH,
    NO_COLLECTOR,
    NO_HEALTH,
    AfterCheckpoint,
    CaptureWatch,
    Health,
)
from hermit_node.control.watchers.base import NullWatcher
from hermit_node.engine import staging
from hermit_node.host import freezer
from hermit_node.turns import turnserver

if TYPE_CHECKING:
    from hermit_common.seal import Sealing
    from hermit_common.store import ScopedClients
    from hermit_common.storecreds import Credentials

log = logging.getLogger("hermit_node")

CHUNK_CACHE_DIR = "chunk-cache"  # under HERMIT_WORK_DIR


def _watch(agent: NodeAgent, settings: NodeSettings, stop: threading.Event,
           health: agent_health.AgentHealth) -> None:
    from hermit_node.control.watchers import build_watcher

    watcher = build_watcher(settings.watcher, health.metadata_session())
    health.watcher_started()
    while not stop.is_set():
        try:
            for notice in watcher.watch(stop):
                agent.on_notice(notice)
        except Exception:
            log.exception("the %s watcher failed; restarting it", settings.watcher.provider)
            stop.wait(5.0)


def build_agent(settings: NodeSettings, stop: threading.Event,
                health: Health = NO_HEALTH,
                capture_watch: CaptureWatch = NO_CAPTURE_WATCH,
                ) -> tuple[NodeAgent, WatchedNode]:
    """Everything built once at start-up; HermitError when a piece cannot be built. The
    watches are not started yet."""
    from hermit_common.keyclient import RemoteKeyWrapper
    from hermit_common.seal import sealing_from
    from hermit_common.store import CheckpointStore
    from hermit_node.control.storage import Stores
    from hermit_node.engine.checkpoint import CheckpointEngine
    from hermit_node.engine.restore import RestoreEngine
    from hermit_node.host.criu import Criu

    kube = Kube.connect(settings.node_name)
    criu = Criu(settings.criu_path)
    sealing = sealing_from(settings.seal)
    work_dir = Path(settings.work_dir)
    cache = ChunkCache(work_dir / CHUNK_CACHE_DIR, settings.chunk_cache_bytes) \
        if settings.chunk_cache_bytes > 0 else None
    store = CheckpointStore(settings.store, sealing=sealing, cache=cache,
                            scoped=scoped_clients(settings, sealing))
    # A per-sandbox store's Secret is read by the operator's key service, never here.
    wrapper = sealing.wrapper if sealing is not None else None
    stores = Stores(settings.store,
                    wrapper if isinstance(wrapper, RemoteKeyWrapper) else None,
                    allowed=settings.per_sandbox_storage,
                    default_store=store, sealing=sealing, cache=cache,
                    scoped=settings.scoped_store_credentials)
    collector: AfterCheckpoint = Collector(
        kube, min_age_seconds=settings.gc_min_age_seconds,
        stopping=stop) if settings.gc_enabled else NO_COLLECTOR
    view = WatchedNode(kube, stop)
    # One for every upload of the node (docs/storage.md#upload-bandwidth).
    limiter = UploadLimiter(settings.upload_bandwidth_bytes_per_second,
                            on_wait=metrics.record_upload_wait)
    metrics.watch_uploads(limiter.active)
    cgroup_root = Path(settings.cgroup_root)
    restorer = RestoreEngine(criu, store, work_dir, lazy=settings.lazy_restore,
                             on_lazy_fill=lambda filled: metrics.record_lazy_fill(
                                 filled.seconds, ok=filled.ok), cgroup_root=cgroup_root)
    metrics.record_lazy_restore(restorer.lazy)
    return NodeAgent(settings.node_name, kube,
                     CheckpointEngine(criu, store, work_dir,
                                      max_frozen_seconds=settings.max_frozen_seconds,
                                      limiter=limiter, cgroup_root=cgroup_root),
                     restorer,
                     view=view, stores=stores,
                     trees=freezer.Trees(cgroup_root), stopping=stop, health=health,
                     collector=collector, fence=Fence(kube),
                     routine_upload_seconds=settings.routine_upload_seconds,
                     limiter=limiter, prefetch=cache is not None,
                     capture_watch=capture_watch), view


def scoped_clients(settings: NodeSettings, sealing: Sealing | None) -> ScopedClients | None:
    """With HERMIT_S3_SCOPED_CREDENTIALS, the S3 clients of sandbox prefixes, from
    credentials the key service vends (docs/storage.md#scoped-store-credentials)."""
    if not settings.scoped_store_credentials:
        return None
    from hermit_common.keyclient import RemoteKeyWrapper
    from hermit_common.store import make_s3_client
    from hermit_common.storecreds import CredentialCache

    wrapper = sealing.wrapper if sealing is not None else None
    if not isinstance(wrapper, RemoteKeyWrapper):  # NodeSettings.from_env checks it
        raise SettingsError("HERMIT_S3_SCOPED_CREDENTIALS=true needs the key service "
                            "(HERMIT_SEAL_KEY_SERVICE_URL)")

    def make(creds: Credentials) -> Any:
        return make_s3_client(dataclasses.replace(
            settings.store, access_key_id=creds.access_key_id,
            secret_access_key=creds.secret_access_key, session_token=creds.session_token))

    return CredentialCache(wrapper.store_credentials, make).client


# Libraries whose DEBUG log is about their own machinery: botocore writes some 60 lines
# (event hooks, request signing) per S3 request, thousands a second while a node uploads,
# all of it formatted and written under the logging lock by the upload threads.
QUIET_LIBRARIES = ("botocore", "boto3", "s3transfer", "urllib3", "kubernetes")


def set_log_levels(level: str) -> None:
    """``HERMIT_LOG_LEVEL`` for Hermit's loggers; the libraries' at INFO at most verbose."""
    logging.getLogger().setLevel(level)
    quiet = max(logging.getLevelName(level), logging.INFO)
    for name in QUIET_LIBRARIES:
        logging.getLogger(name).setLevel(quiet)


def run_agent(environ: Mapping[str, str], *, stop: threading.Event | None = None,
              install_signals: bool = True) -> int:
    settings = NodeSettings.from_env(environ)
    logformat.use_format(settings.log_format)
    set_log_levels(settings.log_level)
    log.info("starting with settings %s", redacted(settings))
    metrics.record_build(hermit_metrics.build_version())
    stop = stop or threading.Event()
    health = agent_health.AgentHealth(
        settings.reconcile_interval_seconds, stopping=stop,
        watcher_polls=settings.watcher.provider != NullWatcher.provider)
    staging.clean(Path(settings.work_dir))  # no job runs yet: all of it is an earlier run's
    # Built first: the checkpoint jobs tell it when a turn checkpoint's tree is captured.
    turn_service = turnserver.service(settings)
    agent, view = build_agent(settings, stop, health,
                              turn_service if turn_service is not None else NO_CAPTURE_WATCH)
    if install_signals:
        signal.signal(signal.SIGTERM, lambda *_: _on_sigterm(stop))
    # Metrics, /healthz and /readyz (hermit_node.control.health) on one port.
    http_health.serve(settings.metrics_port, health.liveness, health.readiness)
    if turn_service is not None:  # POST .../turns (docs/turns.md), when HERMIT_TURN_PORT > 0
        turnserver.start(settings, turn_service)
    watcher = threading.Thread(target=_watch, args=(agent, settings, stop, health),
                               name="watcher", daemon=True)
    health.watching(watcher)
    watcher.start()
    view.start()
    while not stop.is_set():
        try:
            agent.reconcile_once()
        except Exception:  # a bug must not end the DaemonSet's loop
            log.exception("reconcile failed")
        health.beats.beat(agent_health.LOOP)
        view.wait_for_change(agent.next_wait(settings.reconcile_interval_seconds))
    log.info("stopping (no taint, no checkpoint); waiting for running jobs to finish")
    agent.shutdown()
    return 0


def _on_sigterm(stop: threading.Event) -> None:
    stop.set()  # only this: logging is not safe in a signal handler

