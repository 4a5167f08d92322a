"""The key service: who may use which sandbox's keys (keyaccess, pure), the service's
answers (keyservice) and the node-agent's wrapper over it (keyclient.RemoteKeyWrapper),
which must behave as the local keyring wrapper does (the KeyWrapper protocol)."""

from __future__ import annotations

import base64
import dataclasses
import json
import socket
import ssl
from collections.abc import Iterator
from pathlib import Path
from typing import Any

import pytest
import requests

from hermit_common import seal
from hermit_common.errors import CheckpointRefused, SettingsError
from hermit_common.keyclient import KeyAccessDenied, RemoteKeyWrapper
from hermit_common.pin import Pin
from hermit_common.seal import (
    Bound,
    Context,
    new_dek,
    open_manifest,
    seal_manifest,
)
from hermit_common.settings import KeyServiceSettings, OperatorSettings, SealSettings
from hermit_operator import keyaccess, keyservice
from hermit_operator.keyaccess import Denied
from tests.support.keyservice_fakes import (
    AGENT,
    AUDIENCE,
    CHECKPOINTS,
    FORK,
    SANDBOXES,
    A,
    B,
    FakeKube,
    Reads,
    keyring_wrapper,
    sandbox_obj,
    sandbox_pod,
    token_review,
)
from tests.support.tls import self_signed

# -- keyaccess.caller_of ----------------------------------------------------------------

def test_a_node_agents_node_bound_token_names_its_node() -> None:
    assert keyaccess.caller_of(token_review(), [AGENT], AUDIENCE) == \
        keyaccess.Caller(AGENT, "node-a")


@pytest.mark.parametrize(("review", "status", "reason"), [
    (token_review(ok=False), 401, keyaccess.UNAUTHENTICATED),
    (token_review(audiences=("https://kubernetes.default.svc",)), 401, keyaccess.UNAUTHENTICATED),
    (token_review(user="system:serviceaccount:team-a:default"), 403, keyaccess.NOT_A_NODE_AGENT),
    (token_review(node=None), 403, keyaccess.NO_NODE),
    ({**token_review(), "user": {"username": AGENT, "extra": {
        keyaccess.NODE_NAME_EXTRA: ["node-a", "node-b"]}}}, 403, keyaccess.NO_NODE),
])
def test_callers_other_than_a_node_bound_node_agent_are_refused(
        review: dict[str, Any], status: int, reason: str) -> None:
    with pytest.raises(Denied) as info:
        keyaccess.caller_of(review, [AGENT], AUDIENCE)
    assert (info.value.status, info.value.reason) == (status, reason)


# -- keyaccess.decide -------------------------------------------------------------------

@pytest.mark.parametrize("incarnation", [1, 2, 3])
def test_a_node_gets_the_keys_of_the_sandbox_it_runs(incarnation: int) -> None:
    """The current pod, the next (a move's replacement) and the previous (the pod a move
    leaves, finishing its checkpoint)."""
    Reads({"box": sandbox_obj(A, 2)}).decide(
        "node-a", A, [sandbox_pod(A, "node-a", incarnation=incarnation)])


@pytest.mark.parametrize("pods", [
    [],
    [sandbox_pod(A, "node-b")],  # the sandbox runs on another node
    [sandbox_pod(dataclasses.replace(A, sandbox_uid="uid-old"), "node-a")],  # an older sandbox
    [sandbox_pod(A, "node-a", controller=False)],  # not controlled by the AgentSandbox
    [sandbox_pod(A, "node-a", label="else")],  # labelled for another sandbox
    [sandbox_pod(A, "node-a", api_version="example.com/v1")],  # another group's AgentSandbox
    [sandbox_pod(B, "node-a")],  # another sandbox of the same namespace on the node
    [sandbox_pod(A, "node-a", name="lookalike")],  # not named as the operator names its pods
    [sandbox_pod(A, "node-a", incarnation=5)],  # not an incarnation the status is near
])
def test_a_node_is_refused_the_keys_of_a_sandbox_it_does_not_run(
        pods: list[dict[str, Any]]) -> None:
    with pytest.raises(Denied, match="neither runs nor restores") as info:
        Reads().decide("node-a", A, pods)
    assert (info.value.status, info.value.reason) == (403, keyaccess.NOT_SERVED)


def test_a_node_restoring_a_fork_gets_the_source_sandboxs_keys() -> None:
    reads = Reads()
    reads.decide("node-a", A, [sandbox_pod(FORK, "node-a", restore="box-3-manual")])
    assert reads.read == ["sandbox team-a/fork", "checkpoint team-a/box-3-manual",
                          "sandbox team-a/box"]
    # Not when the fork restores on another node, nor a checkpoint of another sandbox,
    # nor from a pod that only looks like the fork's.
    for pod in (sandbox_pod(FORK, "node-b", restore="box-3-manual"),
                sandbox_pod(FORK, "node-a", restore="other-2-manual"),
                sandbox_pod(FORK, "node-a", restore="box-3-manual", name="lookalike")):
        with pytest.raises(Denied):
            Reads().decide("node-a", A, [pod])


def test_pods_in_other_namespaces_are_not_looked_at() -> None:
    reads = Reads()
    with pytest.raises(Denied):
        reads.decide("node-a", A, [sandbox_pod(Bound("team-c", "box", "uid-box"), "node-a",
                                        restore="box-3-manual")])
    assert reads.read == []


def test_source_bound_is_the_checkpoints_sandbox_with_its_uid_now() -> None:
    ckpt = CHECKPOINTS["box-3-manual"]
    assert keyaccess.source_bound(ckpt, SANDBOXES["box"]) == A
    assert keyaccess.source_bound(ckpt, None) is None
    assert keyaccess.source_bound(None, SANDBOXES["box"]) is None
    assert keyaccess.source_bound(ckpt, {"metadata": {"name": "other", "uid": "u"}}) is None


# -- seal.bound_of_* --------------------------------------------------------------------

CTX = Context("team-a", "box", "uid-box", "box-2-preempt", "box-1-preempt",
              ("uid-src", "uid-box"))


def test_the_sandbox_of_a_key_context_and_of_signed_manifest_bytes() -> None:
    assert seal.bound_of_context(CTX.sandbox_bytes()) == A
    envelope = {"sealed": 2, "context": CTX.to_dict(), "kek": "k1", "dek": "", "nonce": "",
                "ciphertext": "x" * 1000}
    assert seal.bound_of_signed(seal._signed_bytes(envelope)) == A
    for bad in (b"", b"hermit/manifest/v2\0[]", b"{}", b"hermit/manifest/v2\0" + b"[" * 100,
                b"hermit/manifest/v9\0{}", b"hermit/manifest/v2\0" + json.dumps(
                    {"context": {"namespace": "a", "sandbox": ""}}).encode()):
        with pytest.raises(CheckpointRefused):
            seal.bound_of_signed(bad)
    with pytest.raises(CheckpointRefused):
        seal.bound_of_context(b'{"namespace": "a"}')


# -- the service and the remote wrapper, over HTTPS on 127.0.0.1 -------------------------

@pytest.fixture
def service(tmp_path: Path) -> Iterator[tuple[str, Path, FakeKube]]:
    from hermit_common import hardhttp

    cert, key = self_signed(tmp_path, "keys.hermit.internal")
    kube = FakeKube()
    svc = keyservice.KeyService(keyring_wrapper(), kube, callers=[AGENT], audience=AUDIENCE)
    server = hardhttp.serve(0, svc.handle, admit=svc.admit, max_body=keyservice.MAX_BODY,
                            usage=keyservice.USAGE, name="keys", host="127.0.0.1",
                            tls=hardhttp.TlsFiles(str(cert), str(key)))
    try:
        yield f"https://127.0.0.1:{server.server_address[1]}", cert, kube
    finally:
        server.shutdown()
        server.server_close()


def _remote(service: tuple[str, Path, FakeKube], token: str, tmp_path: Path,
            ) -> RemoteKeyWrapper:
    url, cert, _ = service
    token_file = tmp_path / f"{token}.jwt"
    token_file.write_text(token + "\n")
    return RemoteKeyWrapper(url, ca_file=str(cert), token_file=str(token_file),
                            backoff_seconds=0.01)


def _seal(wrapper: Any, ctx: Context) -> bytes:
    dek = new_dek()
    wrapped = wrapper.wrap(dek, ctx.sandbox_bytes())
    return seal_manifest(dek, wrapped, ctx, b'{"marker":"M"}')


def _expect(ctx: Context) -> Pin:
    return Pin(ctx.namespace, ctx.sandbox, ctx.checkpoint, ctx.sandbox_uid, ctx.parent,
                    ctx.lineage)


def test_the_remote_wrapper_seals_and_opens_as_the_keyring_does(
        service: tuple[str, Path, FakeKube], tmp_path: Path) -> None:
    remote = _remote(service, "token-a", tmp_path)
    assert remote.current_key_id() == "k1"
    # Sealed through the service, opened with the keys; and the other way round.
    opened = open_manifest(keyring_wrapper(), _seal(remote, CTX), _expect(CTX))
    assert opened.plain == b'{"marker":"M"}'
    opened = open_manifest(remote, _seal(keyring_wrapper(), CTX), _expect(CTX))
    assert opened.plain == b'{"marker":"M"}'
    # A tampered wrapped key is refused as the keyring refuses it (CheckpointRefused).
    wrapped = keyring_wrapper().wrap(new_dek(), CTX.sandbox_bytes())
    bad = dataclasses.replace(wrapped, blob=wrapped.blob[:-1] + bytes([wrapped.blob[-1] ^ 1]))
    with pytest.raises(CheckpointRefused, match="does not open"):
        remote.unwrap(bad, CTX.sandbox_bytes())
    with pytest.raises(CheckpointRefused, match="not in the sealing Secret"):
        remote.sign("gone", seal._signed_bytes({"sealed": 2, "context": CTX.to_dict()}))
    assert remote.verify("k1", seal._signed_bytes({"sealed": 2, "context": CTX.to_dict()}),
                         b"\0" * 32) is False


def test_unwrapped_keys_are_cached_per_context(service: tuple[str, Path, FakeKube],
                                               tmp_path: Path) -> None:
    remote = _remote(service, "token-a", tmp_path)
    wrapped = keyring_wrapper().wrap(b"k" * 32, CTX.sandbox_bytes())
    assert remote.unwrap(wrapped, CTX.sandbox_bytes()) == b"k" * 32
    sent = remote.requests
    assert remote.unwrap(wrapped, CTX.sandbox_bytes()) == b"k" * 32
    assert remote.requests == sent


def test_with_the_service_down_a_node_still_seals_its_sandboxs_checkpoints(
        service: tuple[str, Path, FakeKube], tmp_path: Path) -> None:
    """What an operator restart during a notice must not break: once the node holds the
    sandbox's data key (a checkpoint or restore asked for it), it seals and opens that
    sandbox's manifests with no request at all (format 3 signs under the data key), and
    the current key id stays the last one the service gave."""
    remote = _remote(service, "token-a", tmp_path)
    key_id = remote.current_key_id()
    dek = new_dek()
    wrapped = remote.wrap(dek, CTX.sandbox_bytes())
    _, cert, _ = service
    down = RemoteKeyWrapper("https://127.0.0.1:9", ca_file=str(cert),
                            token_file=str(tmp_path / "token-a.jwt"), backoff_seconds=0.01)
    down._deks, down._current = remote._deks, (0.0, key_id)  # what the node learnt before
    raw = seal_manifest(dek, wrapped, CTX, b'{"marker":"M"}')
    assert open_manifest(down, raw, _expect(CTX)).plain == b'{"marker":"M"}'
    assert down.current_key_id() == key_id  # expired, the service unreachable: kept
    assert down.requests > 0  # it did try the service for the key id
    sent = down.requests
    assert open_manifest(down, raw, _expect(CTX)).dek == dek
    assert down.requests == sent, "opening a format-3 manifest asked the service"


def test_a_node_gets_no_key_of_a_sandbox_on_another_node(
        service: tuple[str, Path, FakeKube], tmp_path: Path) -> None:
    """Node B's agent asks for sandbox A's data key and signature: 403, counted."""
    from prometheus_client import REGISTRY

    def denied(op: str) -> float:
        return REGISTRY.get_sample_value("hermit_operator_key_requests_total",
                                         {"op": op, "result": "denied"}) or 0.0

    before = denied("unwrap"), denied("sign")
    remote_b = _remote(service, "token-b", tmp_path)
    wrapped = keyring_wrapper().wrap(new_dek(), CTX.sandbox_bytes())
    with pytest.raises(KeyAccessDenied, match="node node-b neither runs nor restores "
                                              "sandbox team-a/box"):
        remote_b.unwrap(wrapped, CTX.sandbox_bytes())
    with pytest.raises(KeyAccessDenied, match="neither runs nor restores"):
        remote_b.sign("k1", seal._signed_bytes({"sealed": 2, "context": CTX.to_dict()}))
    assert (denied("unwrap"), denied("sign")) == (before[0] + 1, before[1] + 1)
    # Its own sandbox is fine.
    other = Context("team-a", "other", "uid-other")
    assert len(remote_b.unwrap(keyring_wrapper().wrap(b"o" * 32, other.sandbox_bytes()),
                               other.sandbox_bytes())) == 32


def test_callers_that_are_not_node_agents_are_refused_before_the_body_is_read(
        service: tuple[str, Path, FakeKube], tmp_path: Path) -> None:
    url, cert, kube = service
    for token in ("token-user", "junk"):
        with pytest.raises(KeyAccessDenied):
            _remote(service, token, tmp_path).current_key_id()
    # A large body from a caller without a valid token is never read: the answer, 401,
    # comes before a byte of it is sent.
    ctx = ssl.create_default_context(cafile=str(cert))
    host, port = url.removeprefix("https://").split(":")
    with socket.create_connection((host, int(port)), timeout=10) as raw, \
            ctx.wrap_socket(raw, server_hostname=host) as tls:
        tls.sendall(b"POST /v1/keys/sign HTTP/1.1\r\nHost: keys\r\n"
                    b"Authorization: Bearer junk\r\nContent-Length: 33554432\r\n\r\n")
        assert tls.recv(64).startswith(b"HTTP/1.0 401")
    assert requests.post(f"{url}/v1/keys/sign", data=b"{}", verify=str(cert),
                         timeout=10).status_code == 401
    assert requests.post(f"{url}/v1/other", data=b"{}", verify=str(cert),
                         headers={"Authorization": "Bearer token-a"},
                         timeout=10).status_code == 404
    # Reviews are cached: the same junk token is reviewed once.
    reviews = kube.reviews
    for _ in range(3):
        requests.post(f"{url}/v1/keys/current", data=b"{}", verify=str(cert), timeout=10,
                      headers={"Authorization": "Bearer junk"})
    assert kube.reviews == reviews


def test_malformed_requests_are_400(service: tuple[str, Path, FakeKube]) -> None:
    url, cert, _ = service
    headers = {"Authorization": "Bearer token-a"}
    for body in (b"[]", b"not json", json.dumps({"context": "!!"}).encode(),
                 json.dumps({"context": base64.b64encode(b"{}").decode(),
                             "dek": ""}).encode(),
                 json.dumps({"context": base64.b64encode(CTX.sandbox_bytes()).decode(),
                             "dek": base64.b64encode(b"short").decode()}).encode()):
        resp = requests.post(f"{url}/v1/keys/wrap", data=body, headers=headers,
                             verify=str(cert), timeout=10)
        assert resp.status_code == 400, (body, resp.text)


# -- settings ---------------------------------------------------------------------------

def test_seal_settings_name_the_key_service_settings() -> None:
    base = {"HERMIT_SEAL_KEY_SERVICE_URL": "https://keys.hermit-system.svc:9443"}
    with pytest.raises(SettingsError, match="HERMIT_SEAL_KEY_SERVICE_CA_FILE is required"):
        SealSettings.from_env(base)
    with pytest.raises(SettingsError, match="HERMIT_SEAL_KEYS_DIR and "
                                            "HERMIT_SEAL_KEY_SERVICE_URL are both set"):
        SealSettings.from_env({**base, "HERMIT_SEAL_KEYS_DIR": "/keys",
                               "HERMIT_SEAL_KEY_SERVICE_CA_FILE": "/ca.crt"})
    with pytest.raises(SettingsError, match="is not https"):
        SealSettings.from_env({"HERMIT_SEAL_KEY_SERVICE_URL": "http://keys:9443",
                               "HERMIT_SEAL_KEY_SERVICE_CA_FILE": "/ca.crt"})
    s = SealSettings.from_env({**base, "HERMIT_SEAL_KEY_SERVICE_CA_FILE": "/nope/ca.crt"})
    assert s.key_service_token_file == "/var/run/secrets/hermit.dev/keys/token"
    with pytest.raises(SettingsError, match=r"HERMIT_SEAL_KEY_SERVICE_CA_FILE=/nope/ca\.crt"):
        seal.sealing_from(s)


def test_key_service_settings() -> None:
    assert KeyServiceSettings.from_env({}) == KeyServiceSettings()
    env = {"HERMIT_KEY_SERVICE_PORT": "9443", "HERMIT_SEAL_KEYS_DIR": "/keys",
           "HERMIT_KEY_SERVICE_TLS_CERT_FILE": "/tls/tls.crt",
           "HERMIT_KEY_SERVICE_TLS_KEY_FILE": "/tls/tls.key",
           "HERMIT_KEY_SERVICE_CALLERS": AGENT}
    s = KeyServiceSettings.from_env(env)
    assert (s.port, s.callers, s.audience) == (9443, (AGENT,), AUDIENCE)
    assert OperatorSettings.from_env(env).key_service == s
    with pytest.raises(SettingsError, match="HERMIT_KEY_SERVICE_CALLERS='default'"):
        KeyServiceSettings.from_env({**env, "HERMIT_KEY_SERVICE_CALLERS": "default"})
    for name in ("HERMIT_SEAL_KEYS_DIR", "HERMIT_KEY_SERVICE_TLS_CERT_FILE",
                 "HERMIT_KEY_SERVICE_CALLERS"):
        with pytest.raises(SettingsError, match=f"{name} is required"):
            KeyServiceSettings.from_env({k: v for k, v in env.items() if k != name})


def test_a_node_is_rate_limited_and_its_token_reviewed_once() -> None:
    kube = FakeKube()
    svc = keyservice.KeyService(keyring_wrapper(), kube, callers=[AGENT], audience=AUDIENCE,
                                clock=lambda: 1000.0)
    answers = [svc.admit("/v1/keys/current", "Bearer token-a", f"10.0.0.{i % 200}")
               for i in range(keyservice.NODE_BURST + 1)]
    assert answers[:-1] == [None] * keyservice.NODE_BURST
    assert answers[-1] is not None and answers[-1].status == 429
    assert "node node-a" in answers[-1].body["error"]
    assert kube.reviews == 1
    # Another node has its own budget.
    assert svc.admit("/v1/keys/current", "Bearer token-b", "10.0.1.1") is None


def test_the_certificate_is_verified_for_the_server_name_when_given(
        service: tuple[str, Path, FakeKube], tmp_path: Path) -> None:
    """By a Service's ClusterIP (no cluster DNS): the certificate must be the name's."""
    from hermit_common.keyclient import KeyServiceUnavailable

    url, cert, _ = service
    token = tmp_path / "t"
    token.write_text("token-a")
    named = RemoteKeyWrapper(url, ca_file=str(cert), token_file=str(token),
                             server_name="keys.hermit.internal", backoff_seconds=0.01)
    assert named.current_key_id() == "k1"
    wrong = RemoteKeyWrapper(url, ca_file=str(cert), token_file=str(token),
                             server_name="other.hermit.internal", backoff_seconds=0.01)
    with pytest.raises(KeyServiceUnavailable, match="SSLError"):
        wrong.current_key_id()
