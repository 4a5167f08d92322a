"""The ensure-secrets hook (operator/hermit_operator/ensure_secrets.py) on a real API
server: it creates the missing Secrets once and never changes a key that exists, so a
GitOps sync or an upgrade cannot make sealed checkpoints unreadable."""

from __future__ import annotations

import base64
import subprocess
import sys
import threading
from pathlib import Path

from kubernetes import client, config

from hermit_common.seal import Keyring
from hermit_operator import ensure_secrets
from tests.support.controlplane import ControlPlane, control_plane

__all__ = ["control_plane"]

NAMES = {"sealing": "hermit-sealing", "serving": "hermit-keys-serving",
         "trust": "hermit-keys-trust", "service": "hermit-keys"}


def _core(plane: ControlPlane) -> client.CoreV1Api:
    return client.CoreV1Api(config.new_client_from_config(str(plane.kubeconfig)))


def _namespace(core: client.CoreV1Api, name: str) -> str:
    core.create_namespace(client.V1Namespace(metadata=client.V1ObjectMeta(name=name)))
    return name


def _data(core: client.CoreV1Api, ns: str) -> dict[str, dict[str, str]]:
    return {n: dict(core.read_namespaced_secret(n, ns).data)
            for n in (NAMES["sealing"], NAMES["serving"], NAMES["trust"])}


def _run_cli(plane: ControlPlane, ns: str) -> subprocess.CompletedProcess[str]:
    return subprocess.run(
        [sys.executable, "-m", "hermit_operator.ensure_secrets", f"--namespace={ns}",
         *(f"--{k}={v}" for k, v in NAMES.items()), "--label=app.kubernetes.io/part-of=hermit"],
        env={"KUBECONFIG": str(plane.kubeconfig), "PATH": "/usr/bin:/bin"},
        capture_output=True, text=True, timeout=120, check=False)


def test_the_hook_creates_the_secrets_once_and_then_never_changes_them(
        control_plane: ControlPlane, tmp_path: Path) -> None:
    core = _core(control_plane)
    ns = _namespace(core, "ensure-once")
    first = _run_cli(control_plane, ns)
    assert first.returncode == 0, first.stderr
    made = _data(core, ns)
    # The sealing Secret opens as the operator reads it (one file per entry).
    for key, value in made[NAMES["sealing"]].items():
        (tmp_path / key).write_bytes(base64.b64decode(value))
    assert Keyring.from_dir(tmp_path).current == "1"
    assert made[NAMES["trust"]] == {"ca.crt": made[NAMES["serving"]]["ca.crt"]}
    assert core.read_namespaced_secret(NAMES["serving"], ns).type == "kubernetes.io/tls"

    # An upgrade or a GitOps sync runs the hook again: nothing changes.
    again = _run_cli(control_plane, ns)
    assert again.returncode == 0, again.stderr
    assert "exists: kept as it is" in again.stderr
    assert _data(core, ns) == made

    # A rotated keyring (a second KEK, made current by a person) is kept as it is too.
    rotated = {**made[NAMES["sealing"]], "2": base64.b64encode(
        base64.b64encode(bytes(range(32)))).decode(), "current": base64.b64encode(b"2").decode()}
    core.patch_namespaced_secret(NAMES["sealing"], ns, {"data": rotated})
    assert _run_cli(control_plane, ns).returncode == 0
    assert _data(core, ns)[NAMES["sealing"]] == rotated


def test_a_lost_ca_secret_is_made_again_from_the_serving_one(
        control_plane: ControlPlane) -> None:
    core = _core(control_plane)
    ns = _namespace(core, "ensure-trust")
    assert _run_cli(control_plane, ns).returncode == 0
    made = _data(core, ns)
    core.delete_namespaced_secret(NAMES["trust"], ns)
    assert _run_cli(control_plane, ns).returncode == 0
    assert _data(core, ns) == made
    # A CA Secret that disagrees with the serving certificate is corrected (it is public).
    core.patch_namespaced_secret(NAMES["trust"], ns, {"data": {
        "ca.crt": base64.b64encode(b"not the CA").decode()}})
    assert _run_cli(control_plane, ns).returncode == 0
    assert _data(core, ns) == made


def test_two_hooks_at_once_agree_on_one_key(control_plane: ControlPlane) -> None:
    core = _core(control_plane)
    ns = _namespace(core, "ensure-race")
    errors: list[BaseException] = []

    def run() -> None:
        try:
            ensure_secrets.ensure_all(ensure_secrets.Secrets(_core(control_plane), ns),
                                      labels={}, **NAMES)
        except BaseException as exc:
            errors.append(exc)

    threads = [threading.Thread(target=run) for _ in range(4)]
    for t in threads:
        t.start()
    for t in threads:
        t.join(60)
    assert not errors, errors
    made = _data(core, ns)
    assert made[NAMES["trust"]]["ca.crt"] == made[NAMES["serving"]]["ca.crt"]


def test_the_sig_webhook_certificate_is_made_once_for_its_service(
        control_plane: ControlPlane) -> None:
    from cryptography import x509

    core = _core(control_plane)
    ns = _namespace(core, "ensure-webhook")
    args = [sys.executable, "-m", "hermit_operator.ensure_secrets", f"--namespace={ns}",
            "--webhook-serving=hermit-sig-webhook-serving",
            "--webhook-service=hermit-sig-webhook"]
    env = {"KUBECONFIG": str(control_plane.kubeconfig), "PATH": "/usr/bin:/bin"}

    def run() -> client.V1Secret:
        proc = subprocess.run(args, env=env, capture_output=True, text=True, timeout=120,
                              check=False)
        assert proc.returncode == 0, proc.stderr
        return core.read_namespaced_secret("hermit-sig-webhook-serving", ns)

    secret = run()
    data = dict(secret.data)
    assert dict(run().data) == data  # the second run keeps what the first made
    assert secret.type == "kubernetes.io/tls" and set(data) == {"tls.crt", "tls.key", "ca.crt"}
    cert = x509.load_pem_x509_certificate(base64.b64decode(data["tls.crt"]))
    names = cert.extensions.get_extension_for_class(
        x509.SubjectAlternativeName).value.get_values_for_type(x509.DNSName)
    assert f"hermit-sig-webhook.{ns}.svc" in names
    assert [s.metadata.name for s in core.list_namespaced_secret(ns).items] == [
        "hermit-sig-webhook-serving"]
