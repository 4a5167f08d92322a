"""The attack suite on the cluster: a tenant tries to make the node-agent copy what is not
the sandbox's into its checkpoint.

The node-agent (root, privileged, hostPID) copies the sandbox's workspace volume and
writable layer from host paths. A tenant that swaps a directory of its workspace for a
symlink while that copy runs would have the agent read through the link: the sealing key
at /etc/hermit/sealing/..data, the agent's service-account token, any host path through
/proc/1/root. Here the sandbox's own container (and a process started in it with
``kubectl exec``, as harnesses do) swaps directories for symlinks to those three targets
in a tight loop while Manual checkpoints are taken, many times. The judge is outside the
sandbox: the test downloads every checkpoint from the bucket with the cluster's sealing
keys and checks that every file under the racing directories is one the tenant wrote, with
the content it wrote, and that nothing of the three targets is anywhere in it.

(A second container mounting the workspace, the way the attack was first found, is refused
by the pod policy: tests/e2e/test_policy.py.)
"""

from __future__ import annotations

import base64
import tempfile
import uuid
from pathlib import Path
from typing import Any

import pytest
from kubernetes import client
from kubernetes.stream import stream

from hermit_common.seal import Keyring, KeyringWrapper, Sealing
from hermit_common.settings import StoreSettings
from hermit_common.store import CheckpointStore
from tests.e2e import sandboxes as sb
from tests.e2e.conftest import BUCKET, RELEASE_NS, S3, E2EConfig, Kube, wait_until
from tests.support.attacks import CONTAINED, Attack

pytestmark = [pytest.mark.e2e, pytest.mark.attack, pytest.mark.timeout(900)]

CHECKPOINTS = 20
DIRS_PER_TARGET = 8
SEALING_DIR = "/etc/hermit/sealing/..data"
TOKEN_DIR = "/var/run/secrets/kubernetes.io/serviceaccount"
HOST_MARKER_ROOT = Path("/var/tmp")  # on this machine, which is every node's host

# kind: (the file the tenant puts in each directory, named like a file of the target)
KINDS = {"key": "1", "token": "token", "host": "marker"}

RACER = r"""
set -u
base=$1
mkdir -p "$base" && cd "$base" || exit 1
for kind in key token host; do
  case $kind in key) f=1; t=$SEALING;; token) f=token; t=$TOKEN;; host) f=marker; t=$HOST;; esac
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


def _exec(ns: str, pod: str, script: str) -> str:
    return str(stream(client.CoreV1Api().connect_get_namespaced_pod_exec, pod, ns,
                      command=["sh", "-c", script], stderr=True, stdin=False, stdout=True,
                      tty=False))


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
              dest: Path) -> None:
    status = ckpt["status"]
    lineage = status.get("lineage")
    store.download(ns, ckpt["spec"]["sandboxRef"]["name"], ckpt["metadata"]["name"], dest,
                   expect_uid=uid, expect_digest=status["manifestDigest"],
                   expect_parent=str(status.get("parent") or ""),
                   expect_lineage=tuple(lineage) if lineage else None)


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
        _exec(namespace, pod, 'setsid sh -c "$RACER" racer /workspace/race-exec '
                              '</dev/null >/dev/null 2>&1 &')
        seen: dict[str, str] = {}

        def swapping() -> bool:
            for racer in ("race", "race-exec"):
                seen[racer] = _exec(namespace, pod,
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
    out = _exec(ns, pod, "cat /workspace/race.swaps /workspace/race-exec.swaps")
    return sum(int(x) for x in out.split() if x.isdigit())
