"""Least privilege on the cluster: each service account holds exactly the rules
docs/security.md lists, and a node-agent's own token is refused on another node's objects
(the chart's ValidatingAdmissionPolicy). Its writes are server-side dry runs: admission
runs, nothing changes."""

from __future__ import annotations

import os
import re
import subprocess
import uuid
from collections.abc import Callable
from pathlib import Path
from typing import Any

import pytest
from kubernetes import client
from kubernetes.client.rest import ApiException

from hermit_common import api, protocol
from tests.e2e.conftest import (
    RELEASE_NS,
    REPO,
    E2EConfig,
    Kube,
    pod_manifest,
    wait_pod_phase,
)

pytestmark = [pytest.mark.e2e, pytest.mark.timeout(300)]

COMPONENTS = ("operator", "node-agent")
# Rules every authenticated user has (system:basic-user, system:discovery, ...).
EVERYONE = re.compile(r"^self\w+reviews\.|^selfsubject")


def kubectl(cfg: E2EConfig) -> str:
    cache = Path(os.environ.get("HERMIT_CACHE", Path.home() / ".cache/hermit"))
    path = cache / "bin" / "kubectl"
    if not path.exists():
        pytest.fail(f"kubectl not found at {path}: run hack/install-k8s")
    return str(path)


def documented_rules() -> dict[str, dict[str, set[str]]]:
    """account -> resource -> verbs, from the table in docs/security.md."""
    text = (REPO / "docs/security.md").read_text()
    table = text.split("<!-- rbac-table: begin -->")[1].split("<!-- rbac-table: end -->")[0]
    out: dict[str, dict[str, set[str]]] = {}
    for line in table.strip().splitlines()[2:]:
        account, resource, verbs = (cell.strip() for cell in line.strip("|").split("|")[:3])
        out.setdefault(account, {})[resource] = {v.strip() for v in verbs.split(",")}
    return out


def granted_rules(cfg: E2EConfig, account: str) -> dict[str, set[str]]:
    """resource -> verbs that `kubectl auth can-i --list` shows for the account (resource
    rules only, without the ones every authenticated user has)."""
    proc = subprocess.run(
        [kubectl(cfg), "--kubeconfig", cfg.kubeconfig, "auth", "can-i", "--list", "-n",
         RELEASE_NS, f"--as=system:serviceaccount:{RELEASE_NS}:{account}"],
        capture_output=True, text=True, check=True)
    out: dict[str, set[str]] = {}
    for line in proc.stdout.splitlines()[1:]:
        m = re.match(r"^(\S+)\s+\[(.*?)\]\s+\[(.*?)\]\s+\[(.*?)\]\s*$", line)
        if m is None or m.group(2) or EVERYONE.search(m.group(1)):
            continue  # non-resource URLs, the everyone rules
        out.setdefault(m.group(1), set()).update(m.group(4).split())
    return out


def service_account(kube: Kube, component: str) -> str:
    """The service account the chart's pods of this component run as."""
    pods = kube.api.list_namespaced_pod(
        RELEASE_NS, label_selector=f"app.kubernetes.io/component={component}").items
    assert pods, f"no {component} pod in {RELEASE_NS}"
    return str(pods[0].spec.service_account_name)


def test_each_account_holds_exactly_the_documented_rules(
        kube: Kube, hermit_release: str, e2e_config: E2EConfig) -> None:
    documented = documented_rules()
    for account in COMPONENTS:
        granted = granted_rules(e2e_config, service_account(kube, account))
        print(f"\n{account}: " + "; ".join(f"{r} {sorted(v)}" for r, v in sorted(granted.items())))
        assert granted == documented[account], (
            f"{account}: can-i --list differs from docs/security.md:\n"
            f"  granted only: {_diff(granted, documented[account])}\n"
            f"  documented only: {_diff(documented[account], granted)}")


def _diff(a: dict[str, set[str]], b: dict[str, set[str]]) -> dict[str, list[str]]:
    return {r: sorted(v - b.get(r, set())) for r, v in a.items() if v - b.get(r, set())}


class NodeAgentToken:
    """API calls as one node-agent pod (its bound token names its node), as dry runs."""

    def __init__(self, cfg: E2EConfig, kube: Kube, pod: str) -> None:
        token = subprocess.run(
            [kubectl(cfg), "--kubeconfig", cfg.kubeconfig, "-n", RELEASE_NS, "create", "token",
             service_account(kube, "node-agent"), "--bound-object-kind", "Pod",
             "--bound-object-name", pod, "--duration", "10m"],
            capture_output=True, text=True, check=True).stdout.strip()
        admin = kube.api.api_client.configuration
        conf = client.Configuration()
        conf.host, conf.ssl_ca_cert = admin.host, admin.ssl_ca_cert
        conf.api_key = {"authorization": f"Bearer {token}"}
        api_client = client.ApiClient(conf)
        self.core = client.CoreV1Api(api_client)
        self.custom = client.CustomObjectsApi(api_client)

    @staticmethod
    def attempt(call: Callable[..., Any], *args: Any) -> str | None:
        """None when the API server admits the call (a server-side dry run), else why not."""
        try:
            call(*args, dry_run="All")
        except ApiException as exc:
            return f"{exc.status} {exc.reason}: {exc.body}"
        return None


@pytest.fixture
def node_agent(kube: Kube, hermit_release: str, e2e_config: E2EConfig
               ) -> tuple[NodeAgentToken, str, str]:
    """(a token of the node-agent on node A, node A, another node B)."""
    pods = kube.api.list_namespaced_pod(
        RELEASE_NS, label_selector="app.kubernetes.io/component=node-agent").items
    running = [p for p in pods if p.status.phase == "Running" and p.spec.node_name]
    assert len(running) >= 2, "needs node-agents on two nodes"
    mine, other = running[0], running[1]
    return (NodeAgentToken(e2e_config, kube, mine.metadata.name), mine.spec.node_name,
            other.spec.node_name)


def _refused(why: str | None, says: str) -> None:
    assert why is not None, f"admitted, but should be refused ({says})"
    assert says in why, why
    print(f"  refused: {why[:200]}")


def test_a_node_agent_token_is_refused_on_another_nodes_objects(
        kube: Kube, namespace: str, e2e_config: E2EConfig,
        node_agent: tuple[NodeAgentToken, str, str]) -> None:
    agent, mine, other = node_agent
    label = {"metadata": {"labels": {"hermit.dev/e2e": "x"}}}
    print(f"\nnode-agent of {mine}:")
    assert agent.attempt(agent.core.patch_node, mine, label) is None
    _refused(agent.attempt(agent.core.patch_node, other, label),
             f"may change only its own node ({mine})")

    for name, node in (("here", mine), ("there", other)):
        kube.create_pod(namespace, pod_manifest(name, node, e2e_config.sandbox_image,
                                                ["sleep", "3600"]))
        wait_pod_phase(kube, namespace, name, {"Running"})
    note = {"metadata": {"annotations": {"hermit.dev/e2e": "x"}}}
    assert agent.attempt(agent.core.patch_namespaced_pod, "here", namespace, note) is None
    _refused(agent.attempt(agent.core.patch_namespaced_pod, "there", namespace, note),
             f"only pods on its own node ({mine})")
    container = pod_manifest("here", mine, "", [])["spec"]["containers"][0]["name"]
    swap = {"spec": {"containers": [{"name": container, "image": "evil:1"}]}}
    _refused(agent.attempt(agent.core.patch_namespaced_pod, "here", namespace, swap),
             "never its spec")

    def checkpoint(node: str, **annotations: str) -> dict[str, Any]:
        obj: Any = protocol.checkpoint_object("box", f"box-{uuid.uuid4().hex[:6]}",
                                              protocol.PREEMPTION, 1, namespace=namespace,
                                              node=node)
        if annotations:
            obj["metadata"]["annotations"] = annotations
        return dict(obj)

    create = agent.custom.create_namespaced_custom_object
    where = (api.GROUP, api.VERSION, namespace, api.CHECKPOINT_PLURAL)
    assert agent.attempt(create, *where, checkpoint(mine)) is None
    _refused(agent.attempt(create, *where, checkpoint(other)),
             f"Checkpoints labelled hermit.dev/node={mine}")
    _refused(agent.attempt(create, *where, checkpoint(
        mine, **{protocol.ANNOTATION_NODE_VERIFIED: "true"})), "only the operator marks")
    try:
        agent.core.list_namespaced_secret(RELEASE_NS)
        raise AssertionError("the node-agent can list Secrets")
    except ApiException as exc:
        assert exc.status == 403
