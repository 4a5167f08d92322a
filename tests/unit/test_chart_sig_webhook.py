"""The chart's SIG Sandbox pod webhook (agentSandbox.webhook; docs/agent-sandbox.md):
off by default; on, only opted-in pods reach it, the operator serves it with a certificate
the hook Job or cert-manager makes, and no key or caBundle is rendered."""

from __future__ import annotations

from typing import Any

from hermit_operator import sigpod, sigwebhook
from tests.support.chart import render

ON = "agentSandbox.webhook.enabled=true"
NAME = "hermit-sig-webhook"
Doc = dict[str, Any]


def _kind(docs: list[Doc], kind: str) -> list[Doc]:
    return [d for d in docs if d["kind"] == kind]


def _operator(docs: list[Doc]) -> Doc:
    [deploy] = [d for d in _kind(docs, "Deployment") if "operator" in d["metadata"]["name"]]
    return deploy


def _env(docs: list[Doc]) -> dict[str, str]:
    return {e["name"]: e.get("value", "") for e in
            _operator(docs)["spec"]["template"]["spec"]["containers"][0]["env"]}


def _job_args(docs: list[Doc]) -> list[str]:
    [job] = _kind(docs, "Job")
    args: list[str] = job["spec"]["template"]["spec"]["containers"][0]["args"]
    return args


def _webhook_rules(docs: list[Doc]) -> list[Doc]:
    [role] = [d for d in _kind(docs, "ClusterRole") if d["metadata"]["name"] == "hermit-operator"]
    return [r for r in role["rules"] if "admissionregistration.k8s.io" in r["apiGroups"]]


def test_the_webhook_is_off_by_default() -> None:
    docs = render()
    assert not _kind(docs, "MutatingWebhookConfiguration")
    assert not [k for k in _env(docs) if k.startswith("HERMIT_SIG_WEBHOOK")]
    assert not [a for a in _job_args(docs) if a.startswith("--webhook")]
    assert not _webhook_rules(docs)


def test_on_only_opted_in_pods_are_sent_to_the_operators_service() -> None:
    docs = render(ON)
    [config] = _kind(docs, "MutatingWebhookConfiguration")
    [hook] = config["webhooks"]
    assert hook["objectSelector"] == {"matchLabels": {sigpod.LABEL_OPT_IN: sigpod.OPT_IN_VALUE}}
    assert hook["failurePolicy"] == "Fail" and hook["sideEffects"] == "None"
    assert hook["rules"] == [{"apiGroups": [""], "apiVersions": ["v1"],
                              "operations": ["CREATE"], "resources": ["pods"],
                              "scope": "Namespaced"}]
    assert "namespaceSelector" not in hook
    assert "caBundle" not in hook["clientConfig"], "the operator sets it"
    service_ref = hook["clientConfig"]["service"]
    assert service_ref == {"name": NAME, "namespace": "hermit-system",
                           "path": sigwebhook.PATH, "port": 443}
    [service] = [s for s in _kind(docs, "Service") if s["metadata"]["name"] == NAME]
    assert service["spec"]["ports"][0]["targetPort"] == "sig-webhook"
    container = _operator(docs)["spec"]["template"]["spec"]["containers"][0]
    assert {"name": "sig-webhook", "containerPort": 9444, "protocol": "TCP"} in container[
        "ports"]
    env = _env(docs)
    assert env["HERMIT_SIG_WEBHOOK_PORT"] == "9444"
    assert env["HERMIT_SIG_WEBHOOK_CONFIGURATION"] == NAME
    assert env["HERMIT_SIG_WEBHOOK_CA_FILE"] == "/etc/hermit/sig-webhook-tls/ca.crt"
    volumes = {v["name"]: v for v in _operator(docs)["spec"]["template"]["spec"]["volumes"]}
    assert volumes["sig-webhook-tls"]["secret"]["secretName"] == "hermit-sig-webhook-serving"
    # The hook Job makes the certificate; the operator may patch only its configuration.
    assert "--webhook-serving=hermit-sig-webhook-serving" in _job_args(docs)
    assert f"--webhook-service={NAME}" in _job_args(docs)
    assert _webhook_rules(docs) == [{"apiGroups": ["admissionregistration.k8s.io"],
                                     "resources": ["mutatingwebhookconfigurations"],
                                     "resourceNames": [NAME], "verbs": ["get", "patch"]}]
    assert not _kind(docs, "Secret") and docs == render(ON)


def test_the_values_set_the_failure_policy_timeout_and_namespaces() -> None:
    docs = render(ON, "agentSandbox.webhook.failurePolicy=Ignore",
                  "agentSandbox.webhook.timeoutSeconds=5",
                  "agentSandbox.webhook.namespaceSelector.matchLabels.agents=yes")
    [hook] = _kind(docs, "MutatingWebhookConfiguration")[0]["webhooks"]
    assert (hook["failurePolicy"], hook["timeoutSeconds"]) == ("Ignore", 5)
    assert hook["namespaceSelector"] == {"matchLabels": {"agents": "yes"}}


def test_with_cert_manager_it_issues_and_injects_and_the_operator_does_not() -> None:
    docs = render(ON, "agentSandbox.webhook.certManager.enabled=true")
    [config] = _kind(docs, "MutatingWebhookConfiguration")
    assert config["metadata"]["annotations"] == {
        "cert-manager.io/inject-ca-from": f"hermit-system/{NAME}"}
    [cert] = _kind(docs, "Certificate")
    assert cert["spec"]["secretName"] == "hermit-sig-webhook-serving"
    assert cert["spec"]["dnsNames"][0] == f"{NAME}.hermit-system.svc"
    assert cert["spec"]["issuerRef"] == {"name": NAME, "kind": "Issuer"}
    assert _kind(docs, "Issuer")[0]["spec"] == {"selfSigned": {}}
    assert "HERMIT_SIG_WEBHOOK_CONFIGURATION" not in _env(docs)
    assert not _webhook_rules(docs)
    assert not [a for a in _job_args(docs) if a.startswith("--webhook")]
    own = render(ON, "agentSandbox.webhook.certManager.enabled=true",
                 "agentSandbox.webhook.certManager.issuerRef.name=corp-ca",
                 "agentSandbox.webhook.certManager.issuerRef.kind=ClusterIssuer")
    assert not _kind(own, "Issuer")
    assert _kind(own, "Certificate")[0]["spec"]["issuerRef"] == {
        "name": "corp-ca", "kind": "ClusterIssuer"}
