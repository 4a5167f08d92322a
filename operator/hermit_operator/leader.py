"""One active operator among several replicas: a coordination.k8s.io Lease.

Each replica tries to hold the Lease named by HERMIT_LEADER_ELECTION_LEASE in its own
namespace. The holder runs kopf and renews the Lease every few seconds; the others wait
and take it over once the holder has not renewed it for the lease duration (its pod
died or lost the API). A holder that cannot renew before its lease runs out exits at
once, so two replicas never reconcile together: the standby that takes over starts from
the objects in the API, as any operator restart does.

``decide`` is the pure part (what to do with the Lease as read); ``LeaseElector`` applies
it through the official client, writing with the resourceVersion it read, so two
standbys racing for an expired Lease cannot both win.
"""

from __future__ import annotations

import logging
import os
import threading
import time
from collections.abc import Callable
from dataclasses import dataclass
from datetime import UTC, datetime, timedelta
from typing import Any

from kubernetes import client
from kubernetes.client.exceptions import ApiException

from hermit_common.kubeapi import CALL_ERRORS
from hermit_common.protocol import KubeObject, parse_time

log = logging.getLogger("hermit.operator.leader")

LEASE_SECONDS = 15  # a holder that has not renewed for this long is gone
RENEW_SECONDS = 5  # how often the holder renews (and a standby looks)



@dataclass(frozen=True)
class Decision:
    action: str  # "create" | "renew" | "take" | "wait"
    holder: str | None  # who holds it now (for the log)


def decide(lease: KubeObject | None, identity: str, now: datetime,
           lease_seconds: int = LEASE_SECONDS) -> Decision:
    """What a replica called ``identity`` does with the Lease as read (None: none yet)."""
    if lease is None:
        return Decision("create", None)
    spec = lease.get("spec") or {}
    holder = spec.get("holderIdentity") or None
    if holder == identity:
        return Decision("renew", holder)
    renewed = parse_time(spec.get("renewTime")) or parse_time(spec.get("acquireTime"))
    duration = int(spec.get("leaseDurationSeconds") or lease_seconds)
    if holder is None or renewed is None or now - renewed > timedelta(seconds=duration):
        return Decision("take", holder)
    return Decision("wait", holder)


def _micro(moment: datetime) -> str:
    """MicroTime, as Lease.spec wants it."""
    return moment.astimezone(UTC).strftime("%Y-%m-%dT%H:%M:%S.%fZ")


def lease_body(name: str, identity: str, now: datetime, *, transitions: int,
               acquired: str | None, resource_version: str | None,
               lease_seconds: int = LEASE_SECONDS) -> KubeObject:
    """The Lease held by ``identity`` from now on (acquireTime kept on a renewal)."""
    metadata: KubeObject = {"name": name}
    if resource_version is not None:
        metadata["resourceVersion"] = resource_version
    return {"apiVersion": "coordination.k8s.io/v1", "kind": "Lease", "metadata": metadata,
            "spec": {"holderIdentity": identity, "leaseDurationSeconds": lease_seconds,
                     "acquireTime": acquired or _micro(now), "renewTime": _micro(now),
                     "leaseTransitions": transitions}}


class LeaseElector:
    """Holds the Lease for this replica: ``acquire`` blocks until it does, then a thread
    renews it and calls ``on_lost`` (by default: exit at once) when it cannot.

    ``on_turn(answered)`` is called after every look at the Lease, on a standby and on
    the leader (``answered``: the API server answered it): the health checks' heartbeat."""

    def __init__(self, api: client.CoordinationV1Api, namespace: str, name: str,
                 identity: str, *, clock: Callable[[], datetime] = lambda: datetime.now(UTC),
                 lease_seconds: int = LEASE_SECONDS, renew_seconds: float = RENEW_SECONDS,
                 on_turn: Callable[[bool], None] | None = None) -> None:
        self._api = api
        self._namespace = namespace
        self._name = name
        self.identity = identity
        self._clock = clock
        self._lease_seconds = lease_seconds
        self._renew_seconds = renew_seconds
        self._on_turn = on_turn or (lambda answered: None)

    def _read(self) -> KubeObject | None:
        try:
            lease = self._api.read_namespaced_lease(self._name, self._namespace,
                                                    _request_timeout=10)
        except ApiException as exc:
            if exc.status == 404:
                return None
            raise
        out: KubeObject = client.ApiClient().sanitize_for_serialization(lease)  # type: ignore[no-untyped-call]
        return out

    def try_once(self) -> bool:
        """One look at the Lease; True when this replica holds it afterwards."""
        lease = self._read()
        now = self._clock()
        decision = decide(lease, self.identity, now, self._lease_seconds)
        if decision.action == "wait":
            log.debug("standing by: the Lease %s is held by %s", self._name, decision.holder)
            return False
        spec = (lease or {}).get("spec") or {}
        transitions = int(spec.get("leaseTransitions") or 0)
        body = lease_body(
            self._name, self.identity, now,
            transitions=transitions + (decision.action == "take"),
            acquired=spec.get("acquireTime") if decision.action == "renew" else None,
            resource_version=((lease or {}).get("metadata") or {}).get("resourceVersion"),
            lease_seconds=self._lease_seconds)
        payload: Any = body  # the client takes plain dicts in API form
        try:
            if decision.action == "create":
                self._api.create_namespaced_lease(self._namespace, payload,
                                                  _request_timeout=10)
            else:
                self._api.replace_namespaced_lease(self._name, self._namespace, payload,
                                                   _request_timeout=10)
        except ApiException as exc:
            if exc.status in (409, 422):  # another replica wrote it first
                return False
            raise
        if decision.action != "renew":
            log.info("leading: took the Lease %s/%s (was %s)", self._namespace, self._name,
                     decision.holder or "free")
        return True

    def release(self) -> None:
        """Gives the Lease up at a clean shutdown, so a standby need not wait it out."""
        try:
            lease = self._read()
            if lease is None or (lease.get("spec") or {}).get("holderIdentity") != \
                    self.identity:
                return
            lease["spec"]["holderIdentity"] = None
            payload: Any = lease
            self._api.replace_namespaced_lease(self._name, self._namespace, payload,
                                               _request_timeout=10)
            log.info("released the Lease %s/%s", self._namespace, self._name)
        except CALL_ERRORS as exc:  # it expires by itself
            log.warning("cannot release the Lease %s: %s", self._name, exc)

    def acquire(self, stop: threading.Event | None = None) -> None:
        """Blocks until this replica holds the Lease."""
        waiting_logged = False
        while stop is None or not stop.is_set():
            try:
                held = self.try_once()
            except CALL_ERRORS as exc:  # the API is away: look again later
                log.warning("cannot read the Lease %s: %s", self._name, exc)
                self._on_turn(False)
            else:
                self._on_turn(True)
                if held:
                    return
            if not waiting_logged:
                log.info("standing by until the Lease %s/%s is free", self._namespace,
                         self._name)
                waiting_logged = True
            time.sleep(self._renew_seconds)

    def keep(self, on_lost: Callable[[], None] | None = None) -> threading.Thread:
        """Renews the Lease in a daemon thread; ``on_lost`` when it could not be renewed
        within the lease duration (default: exit the process at once)."""
        lost = on_lost or _exit_now

        def renew() -> None:
            last = time.monotonic()
            while True:
                time.sleep(self._renew_seconds)
                try:
                    held = self.try_once()
                except CALL_ERRORS as exc:  # urllib3's MaxRetryError is not an OSError
                    self._on_turn(False)
                    log.warning("cannot renew the Lease %s: %s", self._name, exc)
                    if time.monotonic() - last < self._lease_seconds - self._renew_seconds:
                        continue
                except Exception:  # a renewal that cannot be trusted is a lost Lease
                    log.exception("renewing the Lease %s failed unexpectedly", self._name)
                else:
                    self._on_turn(True)
                    if held:
                        last = time.monotonic()
                        continue
                    log.error("the Lease %s was taken by another replica", self._name)
                lost()
                return

        thread = threading.Thread(target=renew, name="lease-renewal", daemon=True)
        thread.start()
        return thread


def _exit_now() -> None:
    # No graceful shutdown: a standby may already be leading, and two must never act.
    log.critical("lost the leadership Lease: exiting so that one operator acts at a time")
    logging.shutdown()
    os._exit(1)
