"""A harness says "turn N of this sandbox ended": decide, and checkpoint when needed.

``TurnService.handle`` serves ``POST /v1/namespaces/{ns}/agentsandboxes/{name}/turns``
with ``{"turn": N}`` (and optionally ``"waitSeconds"``) and a bearer token:

0. the caller's source address is rate-limited before anything is parsed (429);
1. the caller is authenticated with a TokenReview (the token must carry
   ``HERMIT_TURN_AUDIENCE``, Hermit's own ``hermit.dev/turns`` by default; the answer is
   cached briefly by a hash of the token, a refusal too), rate-limited per user (429)
   and authorized with a SubjectAccessReview: the verb ``create`` on
   ``agentsandboxes/turns`` of that sandbox (401, 403);
2. the sandbox must exist (404), have ``spec.checkpoint.onTurn: true`` (409) and run on
   this node (421 with the node that runs it, 409 while it is not running);
3. the turn's end state is snapshotted (``snapshot.take``) and compared with the one of
   the sandbox's last turn checkpoint (``inspector.decide``): ``skip`` makes nothing,
   ``files-only`` and ``full`` create a ``Turn`` Checkpoint ``<sandbox>-<incarnation>-turn<N>``
   that the reconcile loop serves like any request, and record the decision in its
   ``status.turn``. A skipped turn is recorded in the response, the metric and the
   ``status.turn.coveredThrough`` of the checkpoint that still holds the sandbox's state.

The baseline a turn checkpoint leaves is its turn's end state with the processes'
counters as the checkpoint holds them (``inspector.settled``): the freeze and the dump
move them, so they are read after the dump while the tree is still frozen (``captured``,
told by the checkpoint's job), and again once the thaw's wake-ups are over; the second
read counts only when the thaw is all that moved them (``inspector.thaw_only``), so what
a process does after the dump shows at the next turn however late that read is. It
becomes the baseline once the checkpoint is Completed; until then a turn is compared with
the last Completed one (and is usually full).

A turn number is decided once per pod: a repeated one returns the first answer, an older
one is refused (409). The baseline lives in memory: after a node-agent restart, or on a
new pod, the first turn is ``full``. Request parsing is pure (``parse_*``).
"""

from __future__ import annotations

import functools
import json
import logging
import re
import threading
import time
from collections.abc import Callable, Mapping
from dataclasses import dataclass, field
from typing import Any, Final, Protocol

from hermit_common import api, protocol, turnlimits
from hermit_common import metrics as hermit_metrics
from hermit_common.errors import HermitError
from hermit_common.hardhttp import Reply
from hermit_common.protocol import KubeObject
from hermit_common.settings import TURN_AUDIENCE
from hermit_node.control import metrics, planner, requests
from hermit_node.control.kube import KubeError
from hermit_node.control.planner import SandboxPod
from hermit_node.engine import inspector
from hermit_node.engine.inspector import Decision, Snapshot

log = logging.getLogger("hermit_node.turns.turns")

MAX_BODY: Final = 4096
MAX_WAIT_SECONDS: Final = 600
DECIDED_KEPT: Final = 64  # turn answers remembered per pod (repeats get the same one)
_PATH: Final = re.compile(
    r"^/v1/namespaces/([a-z0-9]([-a-z0-9]*[a-z0-9])?)/agentsandboxes/"
    r"([a-z0-9]([-a-z0-9.]*[a-z0-9])?)/turns/?$")




@dataclass
class Guards:
    """The endpoint's rate limits and TokenReview cache (turnlimits; one per service)."""

    sources: turnlimits.RateLimiter = field(default_factory=lambda: turnlimits.RateLimiter(
        turnlimits.SOURCE_RATE, turnlimits.SOURCE_BURST))
    users: turnlimits.RateLimiter = field(default_factory=lambda: turnlimits.RateLimiter(
        turnlimits.USER_RATE, turnlimits.USER_BURST))
    reviews: turnlimits.ReviewCache[KubeObject] = field(
        default_factory=lambda: turnlimits.ReviewCache(lambda r: bool(r.get("authenticated"))))


def _too_many(limiter: turnlimits.RateLimiter, key: str, who: str) -> Refused:
    wait = max(1, int(limiter.retry_after(key) + 0.999))
    return Refused(429, f"too many requests from {who}: at most {limiter.rate:g} per "
                        f"second (burst {limiter.burst}); retry after {wait} s",
                   retryAfterSeconds=wait)


class Refused(HermitError):
    """A request answered with an HTTP error: ``status`` and a one-line message. Neither
    Retryable nor Permanent: whether to ask again is the client's, by ``status`` (429)."""

    def __init__(self, status: int, message: str, **extra: Any) -> None:
        super().__init__(message)
        self.status, self.extra = status, extra

    def reply(self) -> Reply:
        return Reply(self.status, {"error": str(self), **self.extra})


# -- request parsing (pure) ---------------------------------------------------------------

def parse_path(path: str) -> tuple[str, str]:
    """(namespace, sandbox) of a turns path; Refused 404 for any other path."""
    m = _PATH.match(path.split("?", 1)[0])
    if m is None:
        raise Refused(404, "not found: POST /v1/namespaces/NS/agentsandboxes/NAME/turns")
    return m.group(1), m.group(3)


def parse_bearer(header: str | None) -> str:
    """The token of an ``Authorization: Bearer <token>`` header; Refused 401 otherwise."""
    scheme, _, token = (header or "").strip().partition(" ")
    if scheme.lower() != "bearer" or not token.strip():
        raise Refused(401, "an Authorization: Bearer <service-account token> header is needed")
    return token.strip()


def parse_body(raw: bytes) -> tuple[int, float]:
    """(turn, waitSeconds) of a JSON body; Refused 400 when it is not one."""
    try:
        body = json.loads(raw.decode() or "null")
    except (UnicodeDecodeError, ValueError):
        raise Refused(400, "the body must be JSON: {\"turn\": N}") from None
    if not isinstance(body, dict):
        raise Refused(400, "the body must be a JSON object: {\"turn\": N}")
    turn, wait = body.get("turn"), body.get("waitSeconds", 0)
    if isinstance(turn, bool) or not isinstance(turn, int) or turn < 0:
        raise Refused(400, "\"turn\" must be an integer >= 0")
    if isinstance(wait, bool) or not isinstance(wait, (int, float)) \
            or not 0 <= wait <= MAX_WAIT_SECONDS:
        raise Refused(400, f"\"waitSeconds\" must be a number from 0 to {MAX_WAIT_SECONDS}")
    return turn, float(wait)


def on_turn(sandbox: Mapping[str, Any]) -> bool:
    """spec.checkpoint.onTurn (default false)."""
    return bool(((sandbox.get("spec") or {}).get("checkpoint") or {}).get("onTurn", False))


def turn_status(number: int, decision: Decision) -> KubeObject:
    """``status.turn`` of a Checkpoint a turn made. Files-only is taken as a full checkpoint
    (the engine has no files-only checkpoint yet): ``taken`` says so."""
    return {"turn": {"number": number, "decision": decision.decision,
                     "reasons": [protocol.one_line(r, 256) for r in decision.reasons[:8]],
                     "taken": protocol.TURN_FULL, "coveredThrough": number}}


# -- the service ----------------------------------------------------------------------------

class TurnKube(Protocol):
    """The API calls a turn makes (``hermit_node.control.kube.Kube``)."""

    def review_token(self, token: str, audiences: list[str]) -> KubeObject: ...
    def review_access(self, user: KubeObject, attributes: KubeObject) -> KubeObject: ...
    def get_sandbox(self, namespace: str, name: str) -> KubeObject | None: ...
    def list_node_pods(self) -> list[KubeObject]: ...
    def get_checkpoint(self, namespace: str, name: str) -> KubeObject | None: ...
    def create_checkpoint(self, manifest: KubeObject,
                          namespace: str | None = None) -> KubeObject: ...
    def patch_checkpoint_status(self, namespace: str, name: str,
                                status: KubeObject) -> None: ...


SnapshotTaker = Callable[[SandboxPod], Snapshot]
# Reads the pod's processes (no files) while its turn checkpoint's tree is frozen after
# the dump; None when it cannot.
AtDump = Callable[[SandboxPod], Snapshot | None]
# Reads the pod's container just after its turn checkpoint thawed it (counters once they
# hold still, then the files); None when it cannot.
AfterThaw = Callable[[SandboxPod], Snapshot | None]
SETTLE_TIMEOUT_SECONDS: Final = 180.0  # the request waits for the loop, then other jobs
SETTLE_POLL_SECONDS: Final = 0.1
# A turn that ends while the previous turn checkpoint's counters are still being read
# waits this long for them (the read lands within ms of the thaw, unless the node is busy).
SETTLE_WAIT_SECONDS: Final = 3.0


@dataclass
class _PodTurns:
    """What one pod's turns left behind (in memory, per pod uid)."""

    baseline: tuple[str, Snapshot] | None = None  # the last Completed turn checkpoint
    # A turn checkpoint not Completed yet, and its baseline once it thawed the tree.
    pending: tuple[str, Snapshot | None] | None = None
    decided: dict[int, dict[str, Any]] = field(default_factory=dict)
    last: int = -1
    lock: threading.RLock = field(default_factory=threading.RLock)
    settling: threading.Event | None = None  # set once the pending one's _settle ended


def _nothing_read(sp: SandboxPod) -> Snapshot | None:
    return None


def _in_thread(fn: Callable[[], None]) -> None:
    threading.Thread(target=fn, daemon=True, name="hermit-turn-settle").start()


class TurnService:
    def __init__(self, node: str, kube: TurnKube, snapshots: SnapshotTaker,
                 after_thaw: AfterThaw, *, at_dump: AtDump = _nothing_read,
                 audience: str = TURN_AUDIENCE,
                 sleep: Callable[[float], None] = time.sleep,
                 spawn: Callable[[Callable[[], None]], None] = _in_thread,
                 guards: Guards | None = None) -> None:
        self.node, self._kube, self._snapshots = node, kube, snapshots
        self._after_thaw, self._spawn = after_thaw, spawn
        self._at_dump = at_dump  # _nothing_read: every turn after a checkpoint is full
        # "" only by the explicit opt-out (settings.TURN_AUDIENCE_API_SERVER).
        self._audiences = [audience] if audience else []
        self.guards = guards if guards is not None else Guards()
        self._sleep = sleep
        self._pods: dict[str, _PodTurns] = {}
        # Per (pod uid, turn checkpoint): its processes read at the dump, until settled.
        self._dumped: dict[tuple[str, str], Snapshot] = {}
        self._lock = threading.Lock()

    def handle(self, path: str, authorization: str | None, body: bytes, *,
               source: str | None = None) -> Reply:
        """Answer one request from address ``source``; never raises."""
        try:
            if source is not None and not self.guards.sources.allow(source):
                raise _too_many(self.guards.sources, source, source)
            namespace, name = parse_path(path)
            token = parse_bearer(authorization)
            turn, wait = parse_body(body)
            self._authorize(token, namespace, name)
            return self._turn(namespace, name, turn, wait)
        except Refused as refused:
            return refused.reply()
        except KubeError as exc:
            log.warning("turn request %s: %s", path, exc)
            return Reply(503, {"error": f"the Kubernetes API did not answer: {exc}"})
        except (HermitError, OSError) as exc:  # the container could not be read
            log.warning("turn request %s: %s", path, exc)
            return Reply(500, {"error": protocol.one_line(str(exc))})

    def _review(self, token: str) -> KubeObject:
        """The TokenReview's status for ``token``, from the cache when it is fresh."""
        key = turnlimits.token_key(token, tuple(self._audiences))
        return self.guards.reviews.get_or_compute(key, lambda: self._send_review(token))

    def _send_review(self, token: str) -> KubeObject:
        """One TokenReview, counted by result (what a flood costs the API server)."""
        try:
            review = dict(self._kube.review_token(token, self._audiences))
        except BaseException:
            metrics.record_token_review(hermit_metrics.TOKEN_REVIEW_ERROR)
            raise
        metrics.record_token_review(hermit_metrics.TOKEN_REVIEW_AUTHENTICATED
                                    if review.get("authenticated")
                                    else hermit_metrics.TOKEN_REVIEW_UNAUTHENTICATED)
        return review

    def _authorize(self, token: str, namespace: str, name: str) -> None:
        review = self._review(token)
        # An audience-unaware authenticator (a webhook) may authenticate the token while
        # ignoring spec.audiences: the status must name ours (the TokenReview API's advice).
        audience_ok = not self._audiences or bool(
            set(self._audiences) & set(review.get("audiences") or ()))
        if not review.get("authenticated") or not audience_ok:
            raise Refused(401, "the token is not valid"
                          + (f" for audience {self._audiences[0]}" if self._audiences else ""))
        user = dict(review.get("user") or {})
        username = str(user.get("username") or "")
        if not self.guards.users.allow(username):
            raise _too_many(self.guards.users, username, username)
        access = self._kube.review_access(user, {
            "namespace": namespace, "verb": protocol.TURNS_VERB, "group": api.GROUP,
            "resource": api.SANDBOX_PLURAL, "subresource": protocol.TURNS_SUBRESOURCE,
            "name": name})
        if not access.get("allowed"):
            raise Refused(403, f"{user.get('username')} may not {protocol.TURNS_VERB} "
                               f"{api.SANDBOX_PLURAL}/{protocol.TURNS_SUBRESOURCE} of "
                               f"{namespace}/{name}")

    def _pod_of(self, namespace: str, name: str) -> SandboxPod:
        sandbox = self._kube.get_sandbox(namespace, name)
        if sandbox is None:
            raise Refused(404, f"AgentSandbox {namespace}/{name} does not exist")
        if not on_turn(sandbox):
            raise Refused(409, f"AgentSandbox {namespace}/{name} has spec.checkpoint.onTurn "
                               "false: turn checkpoints are off for it")
        pods = planner.sandbox_pods(self._kube.list_node_pods(), self.node)
        self._forget({p.uid for p in pods})
        sp = planner.current_pods(pods).get((namespace, name))
        if sp is not None:
            return sp
        node = str((sandbox.get("status") or {}).get("nodeName") or "")
        if node and node != self.node:
            raise Refused(421, f"AgentSandbox {namespace}/{name} runs on node {node}, not "
                               f"{self.node}", node=node)
        raise Refused(409, f"AgentSandbox {namespace}/{name} is not running on {self.node} "
                           "now (starting, restoring or moving): try again", node=node)

    def _forget(self, live: set[str]) -> None:
        """Drop what pods no longer on this node left (their snapshots can be large)."""
        with self._lock:
            for uid in [u for u in self._pods if u not in live]:
                del self._pods[uid]
            for key in [k for k in self._dumped if k[0] not in live]:
                del self._dumped[key]

    def captured(self, sp: SandboxPod, name: str, reason: str) -> None:
        """Checkpoint ``name`` of pod ``sp`` captured its tree, still frozen
        (``ports.CaptureWatch``): a turn checkpoint's processes are read now, as it holds
        them. Never raises: without the read, the next turn is full."""
        if reason != protocol.TURN:
            return
        try:
            reading = self._at_dump(sp)
        except (HermitError, OSError) as exc:
            log.warning("turn checkpoint %s/%s: processes at the dump not read: %s",
                        sp.namespace, name, exc)
            return
        if reading is not None:
            with self._lock:
                self._dumped[(sp.uid, name)] = reading

    def _state(self, uid: str) -> _PodTurns:
        with self._lock:
            return self._pods.setdefault(uid, _PodTurns())

    def _turn(self, namespace: str, name: str, turn: int, wait: float) -> Reply:
        sp = self._pod_of(namespace, name)
        state = self._state(sp.uid)
        settling = state.settling
        if settling is not None:  # outside the lock: _settle takes it to record
            settling.wait(SETTLE_WAIT_SECONDS)
        with state.lock:
            if turn in state.decided:
                return Reply(200, {**state.decided[turn], "repeated": True})
            if turn < state.last:
                raise Refused(409, f"turn {turn} is older than turn {state.last}, which "
                                   "already ended")
            answer = self._decide(sp, state, turn)
            state.decided[turn], state.last = answer, turn
            for old in sorted(state.decided)[:-DECIDED_KEPT]:
                del state.decided[old]
        if wait > 0 and answer.get("checkpoint") and answer["decision"] != protocol.TURN_SKIP:
            answer = {**answer, "phase": self._wait(namespace, str(answer["checkpoint"]), wait)}
        return Reply(201 if answer["decision"] != protocol.TURN_SKIP else 200, answer)

    def _baseline(self, sp: SandboxPod, state: _PodTurns) -> tuple[tuple[str, Snapshot] | None,
                                                                   str | None]:
        """The last Completed turn checkpoint and its snapshot (promoting a pending one
        that completed since), or None and why."""
        if state.pending is not None:
            ckpt = self._kube.get_checkpoint(sp.namespace, state.pending[0])
            phase = protocol.phase_of(ckpt) if ckpt is not None else protocol.FAILED
            name, settled = state.pending
            if phase == protocol.COMPLETED:
                state.pending = None
                state.baseline = (name, settled) if settled is not None else None
                if settled is None:
                    return None, f"the counters after turn checkpoint {name} were not read"
            elif phase == protocol.FAILED:
                state.pending = None
        if state.baseline is None:
            return None, "no earlier turn checkpoint of this pod"
        ckpt = self._kube.get_checkpoint(sp.namespace, state.baseline[0])
        if ckpt is None or protocol.phase_of(ckpt) != protocol.COMPLETED:
            name, state.baseline = state.baseline[0], None
            return None, f"the last turn checkpoint {name} is gone"
        return state.baseline, None

    def _decide(self, sp: SandboxPod, state: _PodTurns, turn: int) -> dict[str, Any]:
        baseline, note = self._baseline(sp, state)
        after = self._snapshots(sp)
        decision = inspector.decide(baseline[1] if baseline else None, after,
                                    baseline_note=note)
        metrics.record_turn(decision.decision)
        answer: dict[str, Any] = {"turn": turn, "node": self.node, **decision.to_dict()}
        if decision.decision == protocol.TURN_SKIP and baseline is not None:
            self._covered(sp.namespace, baseline[0], turn)
            log.info("turn %d of %s/%s: skip (%s holds it)", turn, sp.namespace, sp.sandbox,
                     baseline[0])
            return {**answer, "checkpoint": baseline[0], "taken": None}
        name = self._request(sp, turn, decision)
        state.pending, state.settling = (name, None), threading.Event()
        self._spawn(functools.partial(self._settle, sp, state, name, after, state.settling))
        log.info("turn %d of %s/%s: %s, checkpoint %s (%s)", turn, sp.namespace, sp.sandbox,
                 decision.decision, name, "; ".join(decision.reasons))
        return {**answer, "checkpoint": name, "taken": protocol.TURN_FULL}

    def _settle(self, sp: SandboxPod, state: _PodTurns, name: str, after: Snapshot,
                done: threading.Event) -> None:
        try:
            self._settle_one(sp, state, name, after)
        finally:
            with self._lock:
                self._dumped.pop((sp.uid, name), None)
            done.set()

    def _settle_one(self, sp: SandboxPod, state: _PodTurns, name: str, after: Snapshot) -> None:
        """The baseline turn checkpoint ``name`` leaves: ``after`` with the counters read
        at its dump and after its thaw (``inspector.settled``). The node-agent writes
        Uploading once the tree is thawed (CRIU itself thaws and refreezes the cgroup
        during the dump, so the freezer alone cannot tell)."""
        if not self._thawed(sp.namespace, name):
            log.warning("turn checkpoint %s/%s: not seen thawed; the next turn will be full",
                        sp.namespace, name)
            return
        with self._lock:
            dumped = self._dumped.get((sp.uid, name))
        if dumped is None:
            log.warning("turn checkpoint %s/%s: its processes were not read at the dump; "
                        "the next turn will be full", sp.namespace, name)
            return
        try:
            post = self._after_thaw(sp)
        except (HermitError, OSError) as exc:
            log.warning("turn checkpoint %s/%s: counters after the thaw not read: %s",
                        sp.namespace, name, exc)
            return
        if post is None:
            return
        with state.lock:
            if state.pending is not None and state.pending[0] == name:
                state.pending = (name, inspector.settled(after, dumped, post))

    def _thawed(self, namespace: str, name: str) -> bool:
        """Wait until the checkpoint is Uploading or Completed (its tree thawed); False
        when it Failed or vanished, or after SETTLE_TIMEOUT_SECONDS."""
        deadline = time.monotonic() + SETTLE_TIMEOUT_SECONDS
        while time.monotonic() < deadline:
            try:
                ckpt = self._kube.get_checkpoint(namespace, name)
            except KubeError:
                ckpt = {}  # try again
            phase = protocol.phase_of(ckpt) if ckpt is not None else protocol.FAILED
            if phase in (protocol.UPLOADING, protocol.COMPLETED):
                return True
            if phase == protocol.FAILED:
                return False
            self._sleep(SETTLE_POLL_SECONDS)
        return False

    def _request(self, sp: SandboxPod, turn: int, decision: Decision) -> str:
        """Create the Turn Checkpoint (labelled with this node and the pod's incarnation,
        so only this pod's node-agent serves it) and record the decision in its status."""
        # Under a secret longer name when another node took the protocol's (requests.py).
        name = protocol.name_of(requests.create(self._kube, sp, protocol.TURN, self.node,
                                                str(turn)))
        self._kube.patch_checkpoint_status(sp.namespace, name, turn_status(turn, decision))
        return name

    def _covered(self, namespace: str, name: str, turn: int) -> None:
        try:
            self._kube.patch_checkpoint_status(namespace, name,
                                               {"turn": {"coveredThrough": turn}})
        except KubeError as exc:  # a record for people: the decision stands
            log.warning("turn %d: could not record it on %s/%s: %s", turn, namespace, name, exc)

    def _wait(self, namespace: str, name: str, seconds: float) -> str:
        """The checkpoint's phase once Completed or Failed, or after ``seconds``."""
        deadline = time.monotonic() + seconds
        while True:
            ckpt = self._kube.get_checkpoint(namespace, name)
            phase = protocol.phase_of(ckpt) if ckpt is not None else protocol.FAILED
            if phase in (protocol.COMPLETED, protocol.FAILED) or time.monotonic() >= deadline:
                return phase
            self._sleep(0.5)
