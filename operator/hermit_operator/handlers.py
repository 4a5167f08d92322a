"""kopf handlers: thin wrappers that hand each event to driver.reconcile_sandbox.

Checkpoints are watched with an event handler: kopf's change handlers (and on.field)
diff the object without its status, so they never see the node-agent's progress.
A plan that wants another look later (driver.Requeue: a restore retry) becomes a
kopf.TemporaryError with that delay; event handlers are not retried, so the tick timer
(on while such a retry is scheduled) brings the sandbox back instead.

Importing this module registers the handlers with kopf's default registry.
"""

from __future__ import annotations

import os
from typing import Any, cast

import kopf

from hermit_common import api, protocol
from hermit_common.settings import OperatorSettings
from hermit_operator import driver, kopfconfig
from hermit_operator.kube import Kube, KubeError, KubeTransient
from hermit_operator.podspec import InvalidSpec
from hermit_operator.reconcile import Event, wants_ticks


def _post(sandbox: dict[str, Any], event: Event) -> None:
    kopf.event(cast(kopf.Body, sandbox), type=event.type, reason=event.reason,
               message=event.message)


def _reconcile(memo: Any, namespace: str, name: str) -> None:
    # Returns nothing: kopf would store a return value under .status, which the CRD prunes.
    try:
        driver.reconcile_sandbox(memo.kube, memo.settings, namespace, name, _post)
    except InvalidSpec as exc:
        raise kopf.PermanentError(str(exc)) from None
    except KubeTransient as exc:
        raise kopf.TemporaryError(str(exc), delay=kopfconfig.RETRY_DELAY_SECONDS) from None
    except driver.Requeue as exc:
        raise kopf.TemporaryError(str(exc), delay=exc.delay) from None
    except KubeError as exc:  # refused (forbidden, invalid, conflict): retrying is slower
        raise kopf.TemporaryError(str(exc), delay=kopfconfig.REFUSED_RETRY_DELAY_SECONDS
                                  ) from None


@kopf.on.startup()
def startup(settings: kopf.OperatorSettings, memo: kopf.Memo, **_: Any) -> None:
    if "settings" not in memo:  # started by `kopf run`, not hermit-operator
        memo.settings = OperatorSettings.from_env(os.environ)
    if "kube" not in memo:
        memo.kube = Kube.connect()
    kopfconfig.configure(settings, memo.settings)


@kopf.on.cleanup()
def cleanup(memo: kopf.Memo, **_: Any) -> None:
    """A clean stop gives up the leadership Lease: a standby takes over at once."""
    elector = memo.get("elector")
    if elector is not None:
        elector.release()


@kopf.on.resume(api.GROUP, api.VERSION, api.SANDBOX_PLURAL)
@kopf.on.create(api.GROUP, api.VERSION, api.SANDBOX_PLURAL)
@kopf.on.update(api.GROUP, api.VERSION, api.SANDBOX_PLURAL, field="spec")
def sandbox_changed(namespace: str | None, name: str, memo: kopf.Memo, **_: Any) -> None:
    _reconcile(memo, namespace or "default", name)


@kopf.timer(api.GROUP, api.VERSION, api.SANDBOX_PLURAL,
            interval=kopfconfig.RESYNC_SECONDS, initial_delay=kopfconfig.RESYNC_SECONDS)
def sandbox_resync(namespace: str | None, name: str, memo: kopf.Memo, **_: Any) -> None:
    """A safety net for missed pod events (they are not retried)."""
    _reconcile(memo, namespace or "default", name)


def _ticking(spec: kopf.Spec, status: kopf.Status, **_: Any) -> bool:
    return wants_ticks(spec, status)


@kopf.timer(api.GROUP, api.VERSION, api.SANDBOX_PLURAL, interval=kopfconfig.TICK_SECONDS,
            when=_ticking)
def sandbox_tick(namespace: str | None, name: str, memo: kopf.Memo, **_: Any) -> None:
    """Interval checkpoints, restore retries and waiting forks: the plan says what is due."""
    _reconcile(memo, namespace or "default", name)


@kopf.on.delete(api.GROUP, api.VERSION, api.SANDBOX_PLURAL, optional=True)
def sandbox_deleted(namespace: str | None, name: str, **_: Any) -> None:
    driver.forget(namespace or "default", name)  # its pods go with it (owner references)


@kopf.on.event("", "v1", "pods", labels={protocol.LABEL_SANDBOX: kopf.PRESENT})
def pod_event(body: kopf.Body, namespace: str | None, memo: kopf.Memo,
              logger: kopf.Logger, **_: Any) -> None:
    _reconcile_after_event(driver.owner_sandbox(dict(body)), namespace, memo, logger, "pod")


@kopf.on.event(api.GROUP, api.VERSION, api.CHECKPOINT_PLURAL)
def checkpoint_event(body: kopf.Body, type: str | None, memo: kopf.Memo,
                     logger: kopf.Logger, **_: Any) -> None:
    """A Checkpoint appeared, progressed, finished or went away: reconcile its sandbox
    (a Pending one of a sandbox that does not exist is failed)."""
    try:
        driver.reconcile_checkpoint(memo.kube, memo.settings, dict(body), _post,
                                    deleted=type == "DELETED")
    except driver.Requeue:
        pass  # the tick timer runs while a restore retry is scheduled
    except (InvalidSpec, KubeError) as exc:
        logger.warning("reconciling after a Checkpoint event: %s", exc)


def _reconcile_after_event(sandbox: str | None, namespace: str | None, memo: kopf.Memo,
                           logger: kopf.Logger, what: str) -> None:
    if sandbox is None or namespace is None:
        return
    try:
        driver.reconcile_sandbox(memo.kube, memo.settings, namespace, sandbox, _post)
    except driver.Requeue:
        pass  # the tick timer runs while a restore retry is scheduled
    except (InvalidSpec, KubeError) as exc:
        # Event handlers are not retried; the sandbox's resync timer is the safety net.
        logger.warning("reconciling AgentSandbox %s after a %s event: %s", sandbox, what, exc)
