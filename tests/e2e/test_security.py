"""Least privilege on the cluster: each service account holds exactly the rules
docs/security.md lists, and a node-agent's own token is refused on another node's objects
(the chart's ValidatingAdmissionPolicy). Writes are server-side dry runs: admission runs,
nothing changes."""

from __future__ import annotations

import json
import os
import re
import subprocess
import tempfile
import uuid
from collections.abc import Iterator
from pathlib import Path
from typing import Any

import pytest

from hermit_common import protocol
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
    """kubectl as one node-agent pod (its bound token names its node)."""

    def __init__(self, cfg: E2EConfig, kube: Kube, pod: str, workdir: Path) -> None:
        token = subprocess.run(
            [kubectl(cfg), "--kubeconfig", cfg.kubeconfig, "-n", RELEASE_NS, "create", "token",
             service_account(kube, "node-agent"), "--bound-object-kind", "Pod",
             "--bound-object-name", pod, "--duration", "10m"],
            capture_output=True, text=True, check=True).stdout.strip()
        conf = kube.api.api_client.configuration
        ca = workdir / "ca.crt"
        ca.write_text(Path(conf.ssl_ca_cert).read_text())
        self._base = [kubectl(cfg), "--kubeconfig", "/dev/null", "--server", conf.host,
                      "--certificate-authority", str(ca), "--token", token]

    def run(self, *args: str, stdin: str | None = None) -> subprocess.CompletedProcess[str]:
        return subprocess.run([*self._base, *args, "--dry-run=server"], input=stdin,
                              capture_output=True, text=True, check=False)


@pytest.fixture
def node_agent(kube: Kube, hermit_release: str, e2e_config: E2EConfig
               ) -> Iterator[tuple[NodeAgentToken, str, str]]:
    """(a token of the node-agent on node A, node A, another node B)."""
    pods = kube.api.list_namespaced_pod(
        RELEASE_NS, label_selector="app.kubernetes.io/component=node-agent").items
    running = [p for p in pods if p.status.phase == "Running" and p.spec.node_name]
    assert len(running) >= 2, "needs node-agents on two nodes"
    mine, other = running[0], running[1]
    with tempfile.TemporaryDirectory() as work:
        yield (NodeAgentToken(e2e_config, kube, mine.metadata.name, Path(work)),
               mine.spec.node_name, other.spec.node_name)


def _refused(proc: subprocess.CompletedProcess[str], says: str) -> None:
    assert proc.returncode != 0, f"accepted: {proc.stdout}"
    assert says in proc.stderr, proc.stderr
    print(f"  refused: {proc.stderr.strip()[:240]}")


def _accepted(proc: subprocess.CompletedProcess[str]) -> None:
    assert proc.returncode == 0, proc.stderr


def test_a_node_agent_token_is_refused_on_another_nodes_objects(
        kube: Kube, namespace: str, e2e_config: E2EConfig,
        node_agent: tuple[NodeAgentToken, str, str]) -> None:
    agent, mine, other = node_agent
    label = ["-p", json.dumps({"metadata": {"labels": {"hermit.dev/e2e": "x"}}})]
    print(f"\nnode-agent of {mine}:")
    _accepted(agent.run("patch", "node", mine, "--type", "merge", *label))
    _refused(agent.run("patch", "node", other, "--type", "merge", *label),
             f"may change only its own node ({mine})")

    for name, node in (("here", mine), ("there", other)):
        kube.create_pod(namespace, pod_manifest(name, node, e2e_config.sandbox_image,
                                                ["sleep", "3600"]))
        wait_pod_phase(kube, namespace, name, {"Running"})
    note = ["--type", "merge", "-p",
            json.dumps({"metadata": {"annotations": {"hermit.dev/e2e": "x"}}})]
    _accepted(agent.run("-n", namespace, "patch", "pod", "here", *note))
    _refused(agent.run("-n", namespace, "patch", "pod", "there", *note),
             f"only pods on its own node ({mine})")
    container = pod_manifest("here", mine, "", [])["spec"]["containers"][0]["name"]
    image = ["-p", json.dumps({"spec": {"containers": [{"name": container,
                                                         "image": "evil:1"}]}})]
    _refused(agent.run("-n", namespace, "patch", "pod", "here", "--type", "strategic", *image),
             "never its spec")

    def checkpoint(node: str, **annotations: str) -> str:
        obj: Any = protocol.checkpoint_object("box", f"box-{uuid.uuid4().hex[:6]}",
                                              protocol.PREEMPTION, 1, namespace=namespace,
                                              node=node)
        if annotations:
            obj["metadata"]["annotations"] = annotations
        return json.dumps(obj)

    _accepted(agent.run("create", "-f", "-", stdin=checkpoint(mine)))
    _refused(agent.run("create", "-f", "-", stdin=checkpoint(other)),
             f"Checkpoints labelled hermit.dev/node={mine}")
    _refused(agent.run("create", "-f", "-", stdin=checkpoint(
        mine, **{protocol.ANNOTATION_NODE_VERIFIED: "true"})), "only the operator marks")
    _refused(agent.run("-n", RELEASE_NS, "get", "secrets"), "forbidden")

