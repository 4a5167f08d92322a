"""The agent harness's side of turn boundaries (docs/turns.md).

``TurnClient(...).turn_ended(namespace, sandbox, turn)`` tells the node-agent of the
node the sandbox runs on that turn ``turn`` ended, and returns what it decided::

    from hermit_common.turns import TurnClient

    client = TurnClient()          # in a pod: its projected token for hermit.dev/turns
    result = client.turn_ended("agents", "box-1", 7, wait_seconds=60)
    result.decision, result.checkpoint, result.phase   # "full", "box-1-1-turn7", "Completed"

The node-agent is found through the API: the sandbox's ``status.podName``, that pod's
``status.hostIP``, and the chart's turn port (``nodeAgent.turns.port``, mapped on the
node's IP). The caller needs ``get`` on agentsandboxes and pods and ``create`` on
``agentsandboxes/turns`` in the namespace (the chart's ClusterRole
``<release>-turn-client``). The token is read from ``token_path`` at every call (projected
tokens rotate), unless ``token`` is given: by default ``TURN_TOKEN_PATH``, a projected
service-account token with the audience ``hermit.dev/turns`` (the node-agent refuses any
other by default, so the token it sees is good for nothing else). ``tls=True`` speaks
HTTPS (``nodeAgent.turns.tls``), verifying the node-agent's certificate against
``ca_file`` and, when given, the name ``server_name`` rather than the node's IP.
"""

from __future__ import annotations

import json
from dataclasses import dataclass
from pathlib import Path
from typing import Any, Final

import requests
from requests.adapters import HTTPAdapter

from hermit_common import protocol
from hermit_common.errors import HermitError
from hermit_common.kubeapi import KubeApi
from hermit_common.settings import TURN_AUDIENCE

SERVICE_ACCOUNT_TOKEN: Final = "/var/run/secrets/kubernetes.io/serviceaccount/token"
# Where a harness pod mounts its projected token for the turn endpoint (docs/turns.md).
TURN_TOKEN_PATH: Final = "/var/run/secrets/hermit.dev/turns/token"
MISDIRECTED: Final = 421  # the sandbox runs on another node now


class TurnError(HermitError):
    """The node-agent refused the turn, or could not be reached; ``status`` is the HTTP
    status (None when no answer came)."""

    def __init__(self, message: str, status: int | None = None) -> None:
        super().__init__(message)
        self.status = status


@dataclass(frozen=True)
class TurnResult:
    turn: int
    decision: str  # protocol.TURN_DECISIONS
    reasons: tuple[str, ...]
    checkpoint: str | None  # the Turn checkpoint made, or (skip) the one that still holds it
    taken: str | None  # "full" when a checkpoint was requested, None for skip
    phase: str | None  # with wait_seconds: the checkpoint's phase when the answer came
    node: str
    repeated: bool  # this turn had already been decided: the first answer, again

    @classmethod
    def from_dict(cls, body: dict[str, Any]) -> TurnResult:
        return cls(turn=int(body.get("turn", -1)), decision=str(body.get("decision")),
                   reasons=tuple(str(r) for r in body.get("reasons") or ()),
                   checkpoint=body.get("checkpoint"), taken=body.get("taken"),
                   phase=body.get("phase"), node=str(body.get("node") or ""),
                   repeated=bool(body.get("repeated")))


class _Kube(KubeApi):
    def pod_host_ip(self, namespace: str, pod: str) -> str | None:
        out = self._get_or_none(f"reading pod {namespace}/{pod}",
                                self._core.read_namespaced_pod, pod, namespace)
        return None if out is None else (self._dict(out).get("status") or {}).get("hostIP")


class NamedHost(HTTPAdapter):
    """Verifies the server's certificate for ``name`` (and sends it as SNI), whatever
    address the URL names: one certificate serves every node's IP (the turn endpoint),
    or a Service reached by its ClusterIP (the key service, keyclient.py)."""

    def __init__(self, name: str) -> None:
        self._name = name
        super().__init__()

    def init_poolmanager(self, *args: Any, **kwargs: Any) -> None:
        kwargs.update(server_hostname=self._name, assert_hostname=self._name)
        super().init_poolmanager(*args, **kwargs)


class TurnClient:
    def __init__(self, *, token: str | None = None, token_path: str = TURN_TOKEN_PATH,
                 port: int = protocol.DEFAULT_TURN_PORT, kube: KubeApi | None = None,
                 timeout: float = 30.0, tls: bool = False, ca_file: str | None = None,
                 server_name: str | None = None) -> None:
        self._token, self._token_path = token, token_path
        self._port, self._timeout = port, timeout
        self._kube = _Kube(kube._client) if kube is not None else None
        self._scheme = "https" if tls else "http"
        self._http = requests.Session()
        # Per request: a session's verify loses to REQUESTS_CA_BUNDLE in the environment.
        self._verify: str | bool = ca_file if ca_file is not None else True
        if tls and server_name:
            self._http.mount("https://", NamedHost(server_name))

    def _api(self) -> _Kube:
        if self._kube is None:
            self._kube = _Kube.connect()
        return self._kube

    def endpoint(self, namespace: str, sandbox: str) -> str:
        """The turn URL at the node-agent of the node the sandbox's pod runs on now."""
        obj = self._api().get_sandbox(namespace, sandbox)
        if obj is None:
            raise TurnError(f"AgentSandbox {namespace}/{sandbox} does not exist", 404)
        pod = (obj.get("status") or {}).get("podName")
        host = self._api().pod_host_ip(namespace, str(pod)) if pod else None
        if not host:
            raise TurnError(f"AgentSandbox {namespace}/{sandbox} has no running pod now", 409)
        path = protocol.TURNS_PATH.format(namespace=namespace, name=sandbox)
        return f"{self._scheme}://{host}:{self._port}{path}"

    def turn_ended(self, namespace: str, sandbox: str, turn: int, *,
                   wait_seconds: float = 0) -> TurnResult:
        """Report that turn ``turn`` ended; with ``wait_seconds`` wait (at most that long)
        for the checkpoint it made to be Completed or Failed. TurnError when refused."""
        body = {"turn": turn, "waitSeconds": wait_seconds}
        for attempt in (1, 2):
            url = self.endpoint(namespace, sandbox)
            try:
                resp = self._http.post(
                    url, data=json.dumps(body), timeout=self._timeout + wait_seconds,
                    verify=self._verify,
                    headers={"Authorization": f"Bearer {self._bearer()}",
                             "Content-Type": "application/json"})
            except requests.RequestException as exc:
                raise TurnError(f"cannot reach the node-agent at {url}: {exc}") from None
            if resp.status_code == MISDIRECTED and attempt == 1:
                continue  # it moved between our two reads: look again
            return self._result(url, resp)
        raise AssertionError("unreachable")

    def _bearer(self) -> str:
        if self._token is not None:
            return self._token
        try:
            return Path(self._token_path).read_text().strip()
        except OSError as exc:
            raise TurnError(f"cannot read the turn token {self._token_path}: {exc.strerror} "
                            f"(mount a projected service-account token with audience "
                            f"{TURN_AUDIENCE} there: docs/turns.md)") from None

    @staticmethod
    def _result(url: str, resp: requests.Response) -> TurnResult:
        try:
            body = resp.json()
        except ValueError:
            body = {"error": resp.text[:200]}
        if resp.status_code >= 300 or not isinstance(body, dict):
            message = body.get("error") if isinstance(body, dict) else None
            raise TurnError(f"{url}: {resp.status_code} {message or resp.reason}",
                            resp.status_code)
        return TurnResult.from_dict(body)
