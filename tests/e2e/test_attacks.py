"""The attack suite on the cluster: a tenant tries to make the node-agent copy what is not
the sandbox's into its checkpoint.

The node-agent (root, privileged, hostPID) copies the sandbox's workspace volume and
writable layer from host paths. A tenant that swaps a directory of its workspace for a
symlink while that copy runs would have the agent read through the link: its token for
the key service at /var/run/secrets/hermit.dev/keys/..data (what gets its node's sandbox
keys; no sealing key is mounted in a node-agent), its service-account token, any host path
through /proc/1/root. Here the sandbox's own container (and a process started in it with
``kubectl exec``, as harnesses do) swaps directories for symlinks to those three targets
in a tight loop while Manual checkpoints are taken, many times. The judge is outside the
sandbox: the test downloads every checkpoint from the bucket with the cluster's sealing
keys and checks that every file under the racing directories is one the tenant wrote, with
the content it wrote, and that nothing of the three targets is anywhere in it.

(A second container mounting the workspace, the way the attack was first found, is refused
by the pod policy: tests/e2e/test_policy.py.)

A compromised node, the second attack here, forges a checkpoint of a sandbox it runs: it
holds the sealing keys (every node does), so it takes a genuine checkpoint from the
bucket, rewrites its CRIU core images so every thread holds every capability, uploads it
as a new checkpoint with the store's own API and reports it as its node-agent reports a
Turn checkpoint, with the node-agent's own token. The admission layer and the operator
trust it (it is labelled with the node the sandbox runs on); the node is then lost
without notice, and the next node must refuse the forged images before CRIU runs.
"""

from __future__ import annotations

import base64
import dataclasses
import os
import signal
import tempfile
import time
import uuid
from collections.abc import Iterator
from contextlib import contextmanager
from datetime import UTC, datetime
from pathlib import Path
from typing import Any

import pytest

from hermit_common import api, protocol
from hermit_common.kubeapi import KubeConflict
from hermit_common.manifest import Manifest
from hermit_common.pin import Pin
from hermit_common.seal import Keyring, KeyringWrapper, Sealing
from hermit_common.settings import StoreSettings
from hermit_common.store import CheckpointStore, UploadResult
from hermit_node.control import planner, requests
from hermit_node.control.kube import Kube as NodeAgentKube
from hermit_node.engine.checkpoint import CheckpointResult
from tests.e2e import sandboxes as sb
from tests.e2e.cluster import (
    BUCKET,
    RELEASE_NS,
    S3,
    E2EConfig,
    Kube,
    wait_until,
)
from tests.support import forge
from tests.support.attacks import CONTAINED, REFUSED, Attack

pytestmark = [pytest.mark.e2e, pytest.mark.attack, pytest.mark.timeout(900)]

CHECKPOINTS = 20
DIRS_PER_TARGET = 8
# The node-agent's key material: with the key service (the chart's default) no sealing
# key is mounted, and what opens its node's sandboxes' keys is its token for the key
# service (docs/security.md#the-key-service).
SEALING_DIR = "/var/run/secrets/hermit.dev/keys/..data"
TOKEN_DIR = "/var/run/secrets/kubernetes.io/serviceaccount"
HOST_MARKER_ROOT = Path("/var/tmp")  # on this machine, which is every node's host

# kind: (the file the tenant puts in each directory, named like a file of the target)
KINDS = {"key": "token", "token": "token", "host": "marker"}

RACER = r"""
set -u
base=$1
mkdir -p "$base" && cd "$base" || exit 1
for kind in key token host; do
  case $kind in key) f=token; t=$SEALING;; token) f=token; t=$TOKEN;; host) f=marker; t=$HOST;; esac
  i=0
  while [ $i -lt $DIRS ]; do
    mkdir -p "$kind$i" && echo "tenant-$kind$i" > "$kind$i/$f"
    ln -sfn "$t" "$kind$i.lnk"
    i=$((i+1))
  done
done
n=0
while true; do
  for d in key* token* host*; do
    case $d in *.lnk|*.real) continue;; esac
    mv "$d" "$d.real" && mv "$d.lnk" "$d" && mv "$d" "$d.lnk" && mv "$d.real" "$d"
    n=$((n+1))
  done
  echo $n > "$base.swaps"
done
"""


def _spec(cfg: E2EConfig, host_dir: str) -> dict[str, Any]:
    env = {"SEALING": SEALING_DIR, "TOKEN": TOKEN_DIR, "HOST": f"/proc/1/root{host_dir}",
           "DIRS": str(DIRS_PER_TARGET), "RACER": RACER}
    container = {
        "name": "agent", "image": cfg.sandbox_image, "imagePullPolicy": "IfNotPresent",
        "command": ["sh", "-c", 'sh -c "$RACER" racer /workspace/race'],
        "env": [{"name": k, "value": v} for k, v in env.items()]}
    return {"podTemplate": {"spec": {"containers": [container]}}}


def _judge_store(kube: Kube, s3: S3) -> tuple[CheckpointStore, list[bytes]]:
    """A store that opens the release's sealed checkpoints, and the raw sealing keys (what
    must never be found in a checkpoint)."""
    secret = kube.api.read_namespaced_secret(f"{RELEASE_NS}-sealing", RELEASE_NS)
    data = {k: base64.b64decode(v).decode() for k, v in (secret.data or {}).items()}
    keyring = Keyring.from_mapping(data, "the e2e release's sealing Secret")
    store = CheckpointStore(
        StoreSettings(bucket=BUCKET, endpoint_url=s3.endpoint, access_key_id=s3.access_key,
                      secret_access_key=s3.secret_key),
        sealing=Sealing(KeyringWrapper(lambda: keyring)))
    return store, [k for k in keyring.keys.values()] + [
        base64.b64encode(k) for k in keyring.keys.values()]


def _download(store: CheckpointStore, ns: str, uid: str, ckpt: dict[str, Any],
              dest: Path) -> Manifest:
    status = ckpt["status"]
    lineage = status.get("lineage")
    return store.download(Pin(ns, ckpt["spec"]["sandboxRef"]["name"], ckpt["metadata"]["name"],
                              uid=uid, digest=status["manifestDigest"],
                              parent=str(status.get("parent") or ""),
                              lineage=tuple(lineage) if lineage else None), dest)


def _leaks(root: Path, secrets: list[bytes]) -> list[str]:
    """Everything in a downloaded checkpoint that the tenant did not write: a file under a
    racing directory that is not the tenant's own (name or content), or any file holding
    one of ``secrets``."""
    found = []
    for path in sorted(root.rglob("*")):
        rel = path.relative_to(root)
        if path.is_symlink() or not path.is_file():
            continue
        data = path.read_bytes()
        found += [f"{rel}: holds {s[:4]!r}..." for s in secrets if s and s in data]
        race = [p for p in rel.parts if p.startswith("race")]
        if not race or rel.suffix == ".swaps":
            continue
        parent = rel.parent.name.removesuffix(".real")
        kind = parent.rstrip("0123456789")
        if kind not in KINDS or rel.name != KINDS[kind]:
            found.append(f"{rel}: a file the tenant never created")
        elif data.strip() != f"tenant-{parent}".encode():
            found.append(f"{rel}: content {data[:40]!r} is not the tenant's")
    return found


def test_symlink_race_from_inside_the_sandbox_copies_nothing_else(
        kube: Kube, e2e_config: E2EConfig, hermit_release: str, namespace: str,
        s3_for_pods: S3, attack: Attack) -> None:
    host_dir = HOST_MARKER_ROOT / f"hermit-attack-{uuid.uuid4().hex[:8]}"
    host_dir.mkdir()
    host_secret = f"HOST-SECRET-{uuid.uuid4().hex}".encode()
    (host_dir / "marker").write_bytes(host_secret)
    try:
        name = f"racer-{uuid.uuid4().hex[:6]}"
        sb.ensure_spot_nodes(kube, e2e_config, 1)
        sb.create_sandbox(namespace, name, _spec(e2e_config, str(host_dir)))
        pod = wait_until(f"sandbox {name} Running", 240, lambda: (
            sb.status(namespace, name).get("podName")
            if sb.status(namespace, name).get("phase") == "Running" else None))
        uid = sb.sandbox(namespace, name)["metadata"]["uid"]
        # A second racer started the way harnesses run tool calls (exec), detached.
        # setsid: a process left behind by an exec is otherwise ended with the exec session.
        sb.exec_sh(namespace, pod, 'setsid sh -c "$RACER" racer /workspace/race-exec '
                              '</dev/null >/dev/null 2>&1 &')
        seen: dict[str, str] = {}

        def swapping() -> bool:
            for racer in ("race", "race-exec"):
                seen[racer] = sb.exec_sh(namespace, pod,
                                    f"cat /workspace/{racer}.swaps 2>&1 || ps").strip()
            return all(out.isdigit() and int(out) > 50 for out in seen.values())

        try:
            wait_until("both racers swapping", 60, swapping)
        except BaseException:
            print(f"what the racers show: {seen}")
            raise
        store, keys = _judge_store(kube, s3_for_pods)
        secrets = [*keys, host_secret]
        leaks: list[str] = []
        swaps_before = _swaps(namespace, pod)
        with tempfile.TemporaryDirectory(prefix="hermit-attack-") as work:
            for i in range(CHECKPOINTS):
                ckpt = sb.checkpoint_now(namespace, name, f"{name}-race-{i}")
                dest = Path(work) / str(i)
                _download(store, namespace, uid, ckpt, dest)
                assert (dest / "workspace" / "race").is_dir(), \
                    f"checkpoint {i} holds no racing directory: the judge would see nothing"
                leaks += [f"checkpoint {i}: {leak}" for leak in _leaks(dest, secrets)]
        swaps = _swaps(namespace, pod) - swaps_before
        assert swaps > CHECKPOINTS, f"the racers made only {swaps} swaps during the checkpoints"
        assert not leaks, "the checkpoint holds what the tenant did not write:\n" + \
            "\n".join(leaks[:20])
        for kind, target in (("key", SEALING_DIR), ("token", TOKEN_DIR),
                             ("host", f"/proc/1/root{host_dir}")):
            attack.record(
                f"workspace symlink race → {kind}",
                tried=f"{CHECKPOINTS} Manual checkpoints while two racers (the container's "
                      f"command and a kubectl exec) swapped {DIRS_PER_TARGET * 2} dirs for "
                      f"symlinks to {target}",
                outcome=CONTAINED,
                evidence=f"{swaps} swaps during the checkpoints; all {CHECKPOINTS} "
                         "checkpoints, downloaded and unsealed outside the sandbox, hold only "
                         "the tenant's own files (symlinks kept as links)")
    finally:
        for path in sorted(host_dir.glob("*")):
            path.unlink()
        host_dir.rmdir()


def _swaps(ns: str, pod: str) -> int:
    out = sb.exec_sh(ns, pod, "cat /workspace/race.swaps /workspace/race-exec.swaps")
    return sum(int(x) for x in out.split() if x.isdigit())


# -- a compromised node forges a checkpoint with every capability ---------------------------

FORGED_TURN = "7"  # the forged checkpoint poses as the node-agent's request of turn 7


@contextmanager
def _node_agent_stopped(node: str) -> Iterator[None]:
    """The node's real node-agent stopped (SIGSTOP) for a moment: the compromised node
    runs its own code in its place, so the honest agent must not take the forged Pending
    request first (it would dump the sandbox under the forged name). On this machine every
    node's processes are the host's (sb.node_agent_pids)."""
    pids = sb.node_agent_pids(node)
    assert pids, f"no node-agent process for {node} on this host"
    for pid in pids:
        os.kill(pid, signal.SIGSTOP)
    try:
        yield
    finally:
        for pid in pids:
            os.kill(pid, signal.SIGCONT)


def _forge(store: CheckpointStore, ns: str, uid: str, genuine: dict[str, Any], forged: str,
           parent: str, caps: int, work: Path) -> tuple[UploadResult, dict[str, set[int]]]:
    """Download ``genuine``, give every thread ``caps`` in every set, upload it as
    ``forged`` (the same binding but the name; ``parent`` as a node-agent records the
    checkpoint its pod was restored from): a checkpoint the store opens like any other."""
    dest = work / "forged"
    manifest = _download(store, ns, uid, genuine, dest)
    images = dest / "criu"
    forge.all_caps(caps)(images)
    held = forge.caps_of(images)
    binding = dataclasses.replace(manifest.binding, checkpoint=forged)
    result = store.upload(binding, {name: dest / name for name in manifest.sections},
                          manifest.restore, parent=parent)
    return result, held


def _report(agent: NodeAgentKube, sp: planner.SandboxPod, genuine: dict[str, Any],
            result: UploadResult) -> dict[str, Any]:
    """As the node's node-agent: create its Turn request for the sandbox's pod
    (requests.create: labelled with the node and the incarnation), claim it (Dumping, the
    parent and storage recorded as planner.status_dumping does) and report it Completed
    with the forged manifest's digest and lineage (planner.status_completed)."""
    made = requests.create(agent, sp, protocol.TURN, sp.node, FORGED_TURN)
    name = protocol.name_of(made)
    now = datetime.now(UTC)
    storage = (genuine.get("status") or {}).get("storage")
    current: dict[str, Any] | None = made
    for _ in range(5):
        assert current is not None and planner.claimable(current), \
            f"someone else took {name} first: {current}"
        try:
            agent.claim_checkpoint(sp.namespace, name, planner.status_dumping(
                sp.node, now, sp.restore_from, storage),
                protocol.meta(current).get("resourceVersion") or None)
            break
        except KubeConflict:  # the operator adopted it meanwhile: claim that version
            current = agent.get_checkpoint(sp.namespace, name)
    else:
        pytest.fail(f"could not claim {name}: it kept changing")
    g = genuine["status"]
    agent.patch_checkpoint_status(sp.namespace, name, planner.status_completed(
        CheckpointResult(
            frozen_ms=int(g.get("frozenMs") or 0), dump_ms=int(g.get("dumpMs") or 0),
            capture_ms=0, upload_ms=int(result.duration * 1000),
            image_bytes=result.image_bytes, uploaded_bytes=result.uploaded_bytes,
            stored_bytes=result.stored_bytes, manifest_uri=result.manifest_uri,
            manifest_digest=result.manifest_digest, criu_version=str(g.get("criuVersion")),
            kernel=str(g.get("kernel")), cpu_flags=tuple(g.get("cpuFeatures") or ()),
            chunks_total=result.chunks_total, chunks_uploaded=result.chunks_uploaded,
            lineage=result.lineage),
        datetime.now(UTC), stopped=False, seconds=result.duration))
    return made


def _verified(ns: str, name: str) -> dict[str, Any] | None:
    c: Any = sb.custom().get_namespaced_custom_object(
        api.GROUP, api.VERSION, ns, api.CHECKPOINT_PLURAL, name)
    phase = (c.get("status") or {}).get("phase")
    assert phase != "Failed", f"checkpoint {name} failed: {c['status'].get('message')}"
    marks = c["metadata"].get("annotations") or {}
    return dict(c) if phase == "Completed" and \
        marks.get(protocol.ANNOTATION_NODE_VERIFIED) == "true" else None


# First what the pod grants (a process kubectl exec starts in it: awk reading its own
# status), then every process of the pod: pid, CapEff, CapBnd (hex), command line.
CAPS_SCRIPT = r"""
caps() { awk '/^CapEff:/{e=$2} /^CapBnd:/{b=$2} END{print e" "b}' "$1" 2>/dev/null; }
echo "granted $(caps /proc/self/status)"
for d in /proc/[0-9]*; do
  echo "${d#/proc/} $(caps $d/status) $(tr '\0' ' ' <$d/cmdline 2>/dev/null)"
done
"""


def _caps_in_pod(ns: str, pod: str) -> tuple[tuple[int, int], list[tuple[int, int, int, str]]]:
    """(CapEff, CapBnd) a process exec'd into the pod holds, and (pid, CapEff, CapBnd,
    command line) of every process in the pod, read from inside it (kubectl exec)."""
    granted: tuple[int, int] | None = None
    out = []
    for line in sb.exec_sh(ns, pod, CAPS_SCRIPT).splitlines():
        fields = line.split(maxsplit=3)
        if len(fields) < 3:
            continue  # a process that went away while it was read
        try:
            eff, bnd = int(fields[1], 16), int(fields[2], 16)
        except ValueError:
            continue
        if fields[0] == "granted":
            granted = (eff, bnd)
        elif fields[0].isdigit():
            out.append((int(fields[0]), eff, bnd, fields[3] if len(fields) > 3 else ""))
    assert granted is not None, f"could not read what pod {pod} grants"
    return granted, out


def test_a_forged_checkpoint_with_full_capabilities_is_refused_on_the_next_node(
        kube: Kube, e2e_config: E2EConfig, hermit_release: str, namespace: str,
        s3_for_pods: S3, attack: Attack) -> None:
    started = time.monotonic()
    name, where = sb.start_on_spot(kube, e2e_config, hermit_release, namespace)
    uid = sb.sandbox(namespace, name)["metadata"]["uid"]
    genuine = sb.checkpoint_now(namespace, name, f"{name}-manual")
    assert protocol.node_of(genuine) == where.node, genuine["metadata"]
    print(f"\n{name} on {where.node}: genuine checkpoint {genuine['metadata']['name']}")

    # The compromised node: the sealing keys (as every node holds them), its node-agent's
    # token, and the sandbox's pod as its node-agent sees it.
    store, _ = _judge_store(kube, s3_for_pods)
    pods = [kube.pod(namespace, where.pod) or {}]
    [sp] = [p for p in planner.sandbox_pods(pods, where.node) if p.pod == where.pod]
    agent = NodeAgentKube(sb.node_agent_api_client(
        e2e_config, kube, RELEASE_NS, sb.node_agent_pod_name(kube, RELEASE_NS, where.node)),
        where.node)
    forged = protocol.checkpoint_name(name, sp.incarnation, protocol.TURN, FORGED_TURN)
    # Every capability the node's own node-agent holds: the most its CRIU could restore.
    everything = forge.capabilities_of(sb.node_agent_pids(where.node)[0])
    # The node's own node-agent stays stopped from the upload to the report: its garbage
    # collection (after the genuine checkpoint) would otherwise take the forged chunks for
    # an unfinished upload's and delete them (the e2e release collects at once).
    with _node_agent_stopped(where.node), \
            tempfile.TemporaryDirectory(prefix="hermit-forge-") as work:
        result, held = _forge(store, namespace, uid, genuine, forged, sp.restore_from or "",
                              everything, Path(work))
        assert all(masks == {everything} for masks in held.values()), held
        _report(agent, sp, genuine, result)
    ckpt = wait_until(f"forged checkpoint {forged} Completed and verified by the operator",
                      60, lambda: _verified(namespace, forged), 0.5)
    # It is a checkpoint like any other: the store opens it (digest, parent, lineage as
    # reported) and its threads ask for every capability.
    with tempfile.TemporaryDirectory(prefix="hermit-forge-") as work:
        _download(store, namespace, uid, ckpt, Path(work) / "check")
        again = forge.caps_of(Path(work) / "check" / "criu")
    assert again == held, again
    print(f"forged {forged}: Completed, verified, {len(again['cap_eff'])} mask(s) "
          f"{everything:#x} in every set; lineage {ckpt['status'].get('lineage')}")

    # The node is lost without notice: nothing newer is taken, the sandbox moves.
    last = sb.ticks(kube, namespace, where.pod)
    sb.lose_node(e2e_config, where.node)
    try:
        after = sb.wait_running(kube, namespace, name, restores=1, avoid=where.node, timeout=300,
                                min_ticks=1)
        seen = sb.assert_continues(kube, namespace, after.pod, last[-1] if last else 0,
                                   exact=False)
        status = sb.status(namespace, name)
        restored = status.get("restoredFrom") or {}
        assert restored.get("name") == genuine["metadata"]["name"], status
        assert restored.get("fallback") is True, status

        fallbacks = sb.wait_events(
            kube, namespace, name, f"a RestoreFallback Warning naming {forged}",
            lambda e: e["type"] == "Warning" and e["reason"] == api.REASON_RESTORE_FALLBACK
            and forged in e["message"])
        refusal = fallbacks[0]["message"]
        assert "its processes would hold more than the new pod grants" in refusal, refusal
        assert genuine["metadata"]["name"] in refusal, refusal
        print(f"refused: {refusal}")

        # What the restored processes hold: the pod's capabilities, not the forged ones.
        (pod_eff, pod_bnd), procs = _caps_in_pod(namespace, after.pod)
        workload = [p for p in procs if sb.WORKLOAD in p[3]]
        assert workload, f"no restored workload process in {after.pod}: {procs}"
        assert pod_bnd != everything and pod_eff & ~pod_bnd == 0, (pod_eff, pod_bnd)
        for pid, eff, bnd, cmd in procs:
            assert eff & ~pod_bnd == 0 and bnd == pod_bnd, \
                f"pid {pid} ({cmd}) holds CapEff {eff:#x} CapBnd {bnd:#x}; " \
                f"the pod grants {pod_bnd:#x}"
        caps = sorted({(eff, bnd) for _, eff, bnd, _ in workload})
        print(f"restored on {after.node} from {restored['name']} (fallback), ticks from {seen[0]}; "
              f"workload CapEff/CapBnd {[f'{e:#x}/{b:#x}' for e, b in caps]}, the pod's bounding "
              f"set {pod_bnd:#x}; {sb.since(started)} s")
        attack.record(
            "forged checkpoint with full capabilities, restored on another node",
            tried=f"{where.node}, compromised (sealing keys, its node-agent's token), rewrote "
                  f"genuine checkpoint {genuine['metadata']['name']} with pycriu (every thread "
                  f"{everything:#x} in cap_eff/prm/inh/bnd/amb), uploaded it as {forged}, "
                  "reported it Completed as its node-agent's Turn checkpoint (operator verified "
                  f"it), then {where.node} was lost without notice",
            outcome=REFUSED,
            evidence=f"restore on the next node refused before CRIU: {refusal[:300]}; "
                     f"status.restoredFrom {restored['name']} (fallback), running on "
                     f"{after.node}; restored workload CapEff/CapBnd "
                     f"{', '.join(f'{e:#x}/{b:#x}' for e, b in caps)} (the pod's bounding set "
                     f"{pod_bnd:#x}, not {everything:#x})")
    finally:
        # As a spot pool would: the lost node is replaced, so the tests after this one
        # find the cluster as it was.
        sb.ensure_spot_nodes(kube, e2e_config, 2)
