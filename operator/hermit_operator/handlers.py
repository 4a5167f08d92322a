"""kopf handlers: thin wrappers that hand each event to driver.reconcile_sandbox.

Reconciliation is event-driven: a sandbox is reconciled when it is created, its spec
changes or the operator starts (kopf's create/update/resume handlers), and on every
event of its pods and Checkpoints. Checkpoints are watched with an event handler:
kopf's change handlers (and on.field) diff the object without its status, so they never
see the node-agent's progress.

Pod events only queue their sandbox on ``wakeups.Wakeups``, which is also the work queue
(a sandbox already queued is not queued twice; its threads reconcile). Time is handled
by the same queue, not by polling: a plan that depends on the time
ends in ``driver.Requeue`` with the seconds until its decision changes, and an event's
reconcile that failed is tried again after a delay (event handlers are not retried by
kopf). The resync (every HERMIT_RESYNC_SECONDS, a thread) is a safety net that costs
nothing for a sandbox whose inputs did not change since its last reconcile
(``resync``: fingerprints from the watches, no API call). No kopf timer or daemon is
used: kopf would keep every sandbox's whole body in memory for it.

Importing this module registers the handlers with kopf's default registry.
"""

from __future__ import annotations

import contextvars
import logging
import os
import threading
import time
from typing import Any, cast

import kopf

from hermit_common import api, protocol
from hermit_common.protocol import KubeObject
from hermit_common.settings import OperatorSettings
from hermit_operator import driver, kopfconfig, metrics, resync
from hermit_operator.kube import Kube, KubeError, KubeTransient
from hermit_operator.podspec import InvalidSpec
from hermit_operator.reconcile import Event
from hermit_operator.wakeups import Wakeups

log = logging.getLogger("hermit.operator")


def _post(sandbox: KubeObject, event: Event) -> None:
    try:
        kopf.event(cast(kopf.Body, sandbox), type=event.type, reason=event.reason,
                   message=event.message)
    except LookupError:  # no kopf context to post from (see _in_kopf_context)
        log.warning("Event %s not posted for AgentSandbox %s: %s", event.reason,
                    (sandbox.get("metadata") or {}).get("name"), event.message)


def _remember_kopf_context(memo: Any) -> None:
    """kopf posts Events from the context of its object processing (its event queue and
    loop are context variables): keep a copy for the wakeups' threads. (In a dict made at
    start-up: a handler's memo is a shallow copy of the operator's.)"""
    memo.kopf_context.setdefault("ctx", contextvars.copy_context())


def _in_kopf_context(memo: Any, namespace: str, name: str) -> None:
    """A queued or timed reconcile, on a wakeups thread, in kopf's context (its Events)."""
    ctx = memo.kopf_context.get("ctx")
    if ctx is None:
        _reconcile_coalesced(memo, namespace, name, "timer")
    else:
        ctx.copy().run(_reconcile_coalesced, memo, namespace, name, "timer")


def _reconcile(memo: Any, namespace: str, name: str) -> None:
    """For kopf's create/update/resume handlers: failures become kopf's retries."""
    # Returns nothing: kopf would store a return value under .status, which the CRD prunes.
    try:
        driver.reconcile_sandbox(memo.kube, memo.settings, namespace, name, _post,
                                 inputs=memo.inputs)
    except InvalidSpec as exc:
        raise kopf.PermanentError(str(exc)) from None
    except driver.Requeue as exc:
        memo.wakeups.after(namespace, name, exc.delay)
    except KubeTransient as exc:
        raise kopf.TemporaryError(str(exc), delay=kopfconfig.RETRY_DELAY_SECONDS) from None
    except KubeError as exc:  # refused (forbidden, invalid, conflict): retrying is slower
        raise kopf.TemporaryError(str(exc), delay=kopfconfig.REFUSED_RETRY_DELAY_SECONDS
                                  ) from None


def _reconcile_coalesced(memo: Any, namespace: str, name: str, what: str) -> None:
    """As ``_reconcile_quietly``; while one runs for the sandbox, it runs once more instead
    (the work queue's: pod events and timers; bursts of them cost one or two reconciles)."""
    driver.coalesced((namespace, name), lambda: _reconcile_quietly(memo, namespace, name, what))


def _reconcile_quietly(memo: Any, namespace: str, name: str, what: str,
                       ckpt: KubeObject | None = None, deleted: bool = False) -> None:
    """For events, timers and wakeups (nobody retries them): a failure schedules a wakeup.
    With ``ckpt``: a Checkpoint's event (a Pending one of a missing sandbox is failed)."""
    try:
        if ckpt is not None:
            driver.reconcile_checkpoint(memo.kube, memo.settings, ckpt, _post,
                                        deleted=deleted, inputs=memo.inputs)
        else:
            driver.reconcile_sandbox(memo.kube, memo.settings, namespace, name, _post,
                                     inputs=memo.inputs)
    except driver.Requeue as exc:
        memo.wakeups.after(namespace, name, exc.delay)
    except InvalidSpec as exc:  # recorded in the status; the next spec change retries
        log.warning("AgentSandbox %s/%s after a %s: %s", namespace, name, what, exc)
    except KubeError as exc:
        delay = (kopfconfig.RETRY_DELAY_SECONDS if isinstance(exc, KubeTransient)
                 else kopfconfig.REFUSED_RETRY_DELAY_SECONDS)
        log.warning("reconciling AgentSandbox %s/%s after a %s: %s; again in %ds",
                    namespace, name, what, exc, delay)
        memo.wakeups.after(namespace, name, delay)


@kopf.on.startup()
def startup(settings: kopf.OperatorSettings, memo: kopf.Memo, **_: Any) -> None:
    if "settings" not in memo:  # started by `kopf run`, not hermit-operator
        memo.settings = OperatorSettings.from_env(os.environ)
    if "kube" not in memo:
        memo.kube = Kube.connect(memo.settings.watch_namespaces)
    memo.inputs = resync.Inputs()
    memo.kopf_context = {}
    memo.wakeups = Wakeups(lambda ns, name: _in_kopf_context(memo, ns, name),
                           workers=kopfconfig.HANDLER_THREADS)
    memo.wakeups.start()
    memo.stopping = threading.Event()
    threading.Thread(target=_resync_forever, args=(memo, memo.stopping), name="hermit-resync",
                     daemon=True).start()
    kopfconfig.configure(settings, memo.settings)


@kopf.on.cleanup()
def cleanup(memo: kopf.Memo, **_: Any) -> None:
    """A clean stop gives up the leadership Lease: a standby takes over at once."""
    wakeups = memo.get("wakeups")
    if wakeups is not None:
        memo.stopping.set()
        wakeups.stop()
    elector = memo.get("elector")
    if elector is not None:
        elector.release()


@kopf.on.resume(api.GROUP, api.VERSION, api.SANDBOX_PLURAL)
@kopf.on.create(api.GROUP, api.VERSION, api.SANDBOX_PLURAL)
@kopf.on.update(api.GROUP, api.VERSION, api.SANDBOX_PLURAL, field="spec")
def sandbox_changed(namespace: str | None, name: str, memo: kopf.Memo, **_: Any) -> None:
    _reconcile(memo, namespace or "default", name)


def _resync_forever(memo: Any, stop: threading.Event) -> None:
    """Every HERMIT_RESYNC_SECONDS, a safety net for missed or failed events: the sandboxes
    whose inputs changed since their last reconcile (no API call to tell) are reconciled,
    spread over half a period."""
    period = memo.settings.resync_seconds
    while not stop.wait(period):
        known = len(memo.inputs.sandboxes())
        due = memo.inputs.due(time.monotonic(), period)
        metrics.RESYNCS.labels(result="skipped").inc(known - len(due))
        metrics.RESYNCS.labels(result="reconciled").inc(len(due))
        for n, (namespace, name) in enumerate(due):
            memo.wakeups.after(namespace, name, n * period / 2 / len(due))


@kopf.on.event(api.GROUP, api.VERSION, api.SANDBOX_PLURAL)
async def sandbox_event(body: kopf.Body, type: str | None, memo: kopf.Memo, **_: Any) -> None:
    """The four fields of a sandbox its fingerprint needs (kopf's change handlers act)."""
    _remember_kopf_context(memo)
    memo.inputs.saw_sandbox(body, deleted=type == "DELETED")


@kopf.on.delete(api.GROUP, api.VERSION, api.SANDBOX_PLURAL, optional=True)
def sandbox_deleted(namespace: str | None, name: str, memo: kopf.Memo, **_: Any) -> None:
    ns = namespace or "default"
    driver.forget(ns, name)  # its pods go with it (owner references)
    memo.inputs.forget(ns, name)
    memo.wakeups.cancel(ns, name)


@kopf.on.event("", "v1", "pods", labels={protocol.LABEL_SANDBOX: kopf.PRESENT})
async def pod_event(body: kopf.Body, type: str | None, namespace: str | None,
                    memo: kopf.Memo, **_: Any) -> None:
    """Queue the pod's sandbox for a reconcile (a work queue: a sandbox queued already is
    not queued twice) and return at once: kopf holds no pod body while reconciles run."""
    _remember_kopf_context(memo)
    memo.inputs.saw_pod(body, deleted=type == "DELETED")
    sandbox = driver.owner_sandbox(dict(body))
    if sandbox is not None and namespace is not None:
        memo.wakeups.after(namespace, sandbox, 0.0)


@kopf.on.event(api.GROUP, api.VERSION, api.CHECKPOINT_PLURAL)
def checkpoint_event(body: kopf.Body, type: str | None, namespace: str | None,
                     memo: kopf.Memo, **_: Any) -> None:
    """A Checkpoint appeared, progressed, finished or went away: reconcile its sandbox
    (a Pending one of a sandbox that does not exist is failed)."""
    ckpt = dict(body)
    memo.inputs.saw_checkpoint(ckpt, deleted=type == "DELETED")
    sandbox = driver.checkpoint_sandbox(ckpt)
    if sandbox is not None and namespace is not None:
        _reconcile_quietly(memo, namespace, sandbox, "Checkpoint event", ckpt=ckpt,
                           deleted=type == "DELETED")
