"""What the cluster benchmarks (preempt_load.py, fork_fanout.py) share: the e2e fixtures
called as context managers (the chart installed as the e2e tests install it, the session's
tick ledger), a namespace, cordons, and the small print helpers."""

from __future__ import annotations

import contextlib
import os
import time
from collections.abc import Callable, Generator, Iterable, Iterator
from dataclasses import dataclass
from typing import Any

from kubernetes.client.exceptions import ApiException

from hermit_common import api
from tests.e2e import cluster as e2e
from tests.e2e import sandboxes as sb
from tests.support import ledger
from tests.support.wait import wait_until

Obj = dict[str, Any]


def log(message: str) -> None:
    print(f"[{time.strftime('%H:%M:%S')}] {message}", flush=True)


def unwrapped(fixture_function: Any) -> Callable[..., Any]:
    """The function under pytest's fixture decorator (a fixture is not called directly)."""
    function: Callable[..., Any] = fixture_function.__wrapped__
    return function


@contextlib.contextmanager
def fixture(gen: Generator[Any, None, None]) -> Iterator[Any]:
    """An e2e fixture's generator as a context manager (set-up, value, tear-down)."""
    value = next(gen)
    try:
        yield value
    finally:
        gen.close()


@dataclass
class Release:
    """The cluster in $KUBECONFIG with the chart installed (tests/e2e/cluster.py's
    fixtures), and the tick ledger the self-checking sandboxes report to (None: it could
    not listen)."""

    cfg: e2e.E2EConfig
    kube: e2e.Kube
    namespace: str
    ledger: ledger.Collector | None


@contextlib.contextmanager
def release() -> Iterator[Release]:
    """The e2e session's set-up as one block: the tick ledger, the cluster, MinIO on the
    host bridge and the chart (this worktree's CRDs and chart, the operator on an on-demand
    node); uninstalled and stopped on the way out."""
    cfg = e2e._e2e_config()
    with fixture(unwrapped(e2e.tick_ledger)()) as collector:
        kube: e2e.Kube = unwrapped(e2e.kube)(cfg, collector)
        with fixture(unwrapped(e2e.s3_for_pods)()) as s3, \
                fixture(unwrapped(e2e.hermit_release)(kube, s3, cfg)) as release_ns:
            yield Release(cfg, kube, release_ns, collector)


@contextlib.contextmanager
def namespace(kube: e2e.Kube, prefix: str) -> Iterator[str]:
    """A fresh namespace ``<prefix>-<random>``, deleted afterwards and waited for while the
    operator still runs (kopf's finalizers on the sandboxes need it)."""
    name = f"{prefix}-{os.urandom(3).hex()}"
    body: Any = {"metadata": {"name": name}}
    kube.api.create_namespace(body)
    wait_until(f"default service account in {name}", 60,
                   lambda: kube.api.read_namespaced_service_account("default", name))
    try:
        yield name
    finally:
        kube.api.delete_namespace(name, grace_period_seconds=0)
        gone = _namespace_gone(kube, name)
        deadline = time.monotonic() + 180
        while not gone() and time.monotonic() < deadline:
            time.sleep(2)
        log(f"namespace {name} {'deleted' if gone() else 'still terminating after 180 s'}")


def _namespace_gone(kube: e2e.Kube, name: str) -> Callable[[], bool]:
    def gone() -> bool:
        try:
            kube.api.read_namespace(name)
        except ApiException as exc:
            return bool(exc.status == 404)
        return False

    return gone


@contextlib.contextmanager
def only_node(kube: e2e.Kube, target: str) -> Iterator[None]:
    """Every other schedulable node cordoned, on-demand ones too (so new pods can only go
    to ``target``), uncordoned on the way out."""
    others = [e2e.name_of(n) for n in kube.nodes() if e2e.name_of(n) != target
              and not n.get("spec", {}).get("unschedulable")]
    try:
        for node in others:
            sb.set_unschedulable(kube, node, True)
        yield
    finally:
        for node in others:
            with contextlib.suppress(ApiException):
                sb.set_unschedulable(kube, node, False)


def sandboxes(ns: str) -> dict[str, Obj]:
    """Every AgentSandbox of ``ns`` by name."""
    listed: Any = sb.custom().list_namespaced_custom_object(
        api.GROUP, api.VERSION, ns, api.SANDBOX_PLURAL)
    items: list[Obj] = listed["items"]
    return {e2e.name_of(s): s for s in items}


def seconds(value: float | None) -> str:
    """A time for a table: one decimal, "-" when there is none."""
    return f"{value:.1f}" if value is not None else "-"


def counts(values: Iterable[str]) -> str:
    """``a 2, b 1``: how often each value occurs, by value."""
    tally: dict[str, int] = {}
    for v in values:
        tally[v] = tally.get(v, 0) + 1
    return ", ".join(f"{k} {v}" for k, v in sorted(tally.items()))
