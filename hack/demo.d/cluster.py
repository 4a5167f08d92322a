#!/usr/bin/env python3
"""The cluster demo, run by ``hack/demo cluster`` once the local cluster is up and the images
are loaded: a stateful sandbox on a spot node lives through a spot preemption.

It installs the Hermit chart as release ``hermit-demo`` in namespace ``hermit-demo`` (names
the e2e tests do not use) with a MinIO of its own on the cluster's host bridge, runs the
self-checking workload ``/bin/hermit-stateful`` of ``hermit.local/sandbox:v1`` as the
AgentSandbox ``agent`` in namespace ``hermit-demo-sandbox``, gives its node a spot
interruption notice (``hack/cluster preempt-node NODE --notice N``) and prints the timeline:
notice, taint, checkpoint durable, old pod gone, new pod restored and running, the counter
continuing with the workload's self-checks holding. It then removes what it created (the
namespaces, the release, MinIO) and, as a spot pool would, replaces the node it lost. The
cluster stays up. Every wait has a deadline.

Environment: KUBECONFIG (the cluster), HERMIT_DEMO_S3_HOST (an address of this machine
that pods reach; hack/demo passes the cluster's host bridge).
"""

from __future__ import annotations

import argparse
import json
import os
import queue
import subprocess
import sys
import tempfile
import threading
import time
from collections.abc import Callable
from dataclasses import dataclass
from pathlib import Path
from typing import Any, TypeVar

from kubernetes import client, config
from kubernetes.client.exceptions import ApiException
from kubernetes.stream import stream

from hermit_common import api, protocol
from hermit_common.errors import HermitError
from hermit_common.store import CheckpointStore
from hermit_testbed.minio import MinioServer, start_minio, stop_minio

REPO = Path(__file__).resolve().parents[2]
HACK_CLUSTER = str(REPO / "hack" / "cluster")
HELM = str(Path(os.environ.get("HERMIT_CACHE", Path.home() / ".cache/hermit")) / "bin/helm")
RELEASE = "hermit-demo"  # the e2e tests use hermit-e2e
RELEASE_NS = "hermit-demo"
SANDBOX_NS = "hermit-demo-sandbox"
SANDBOX = "agent"
BUCKET = "hermit-demo"
SECRET = "hermit-demo-s3"
IMAGE = "hermit.local/sandbox:v1"
WORKLOAD = "/bin/hermit-stateful"
SPOT_LABEL = "karpenter.sh/capacity-type"
PART_OF = "app.kubernetes.io/part-of=hermit"
PORT = 7000
TICK_MS = 200
RUNNING, FAILED = "Running", "Failed"
assert RUNNING in api.SANDBOX_PHASES and FAILED in api.SANDBOX_PHASES

Obj = dict[str, Any]
T = TypeVar("T")


class DemoError(Exception):
    """The demo cannot go on; the message says why."""


def wait_until(what: str, timeout: float, probe: Callable[[], T | None], every: float = 0.5) -> T:
    """Polls ``probe`` until it returns something other than None or False."""
    deadline = time.monotonic() + timeout
    while True:
        result = probe()
        if result is not None and result is not False:
            return result
        if time.monotonic() > deadline:
            raise DemoError(f"timed out after {timeout:.0f} s waiting for {what}")
        time.sleep(every)


def mb(n: Any) -> str:
    return f"{int(n or 0) / 1e6:.1f} MB"


class Kube:
    """The few API calls the demo makes, returning plain JSON dicts (None when not found)."""

    def __init__(self) -> None:
        load: Any = config.load_kube_config  # untyped
        load()
        self.core = client.CoreV1Api()
        self.apps = client.AppsV1Api()
        self.custom = client.CustomObjectsApi()

    @staticmethod
    def _read(call: Callable[..., Any], *args: Any) -> Obj | None:
        try:
            data: Obj = json.loads(call(*args, _preload_content=False).data)
            return data
        except ApiException as exc:
            if exc.status == 404:
                return None
            raise

    def node(self, name: str) -> Obj | None:
        return self._read(self.core.read_node, name)

    def pod(self, ns: str, name: str) -> Obj | None:
        return self._read(self.core.read_namespaced_pod, name, ns)

    def sandbox(self) -> Obj:
        obj = self._read(self.custom.get_namespaced_custom_object, api.GROUP, api.VERSION,
                         SANDBOX_NS, api.SANDBOX_PLURAL, SANDBOX)
        if obj is None:
            raise DemoError(f"AgentSandbox {SANDBOX_NS}/{SANDBOX} disappeared")
        return obj

    def checkpoints(self) -> list[Obj]:
        return self.items(self.custom.list_namespaced_custom_object,
                          api.GROUP, api.VERSION, SANDBOX_NS, api.CHECKPOINT_PLURAL)

    def ticks(self, pod: str) -> list[int]:
        """The ``tick N`` lines of a pod's output (empty when it has none, or no log yet)."""
        try:
            log = str(self.core.read_namespaced_pod_log(pod, SANDBOX_NS, _request_timeout=5))
        except (ApiException, OSError, ValueError):  # no such pod yet, its node gone
            return []
        return [int(line.split()[1]) for line in log.splitlines()
                if line.startswith("tick ") and line.split()[1].isdigit()]

    def items(self, call: Callable[..., Any], *args: Any, **kwargs: Any) -> list[Obj]:
        items: list[Obj] = json.loads(call(*args, _preload_content=False, **kwargs).data)["items"]
        return items

    def ready_spot_nodes(self) -> list[str]:
        out = []
        for n in self.items(self.core.list_node):
            ready = any(c["type"] == "Ready" and c["status"] == "True"
                        for c in n.get("status", {}).get("conditions") or [])
            if ready and not n.get("spec", {}).get("unschedulable") and \
                    (n["metadata"].get("labels") or {}).get(SPOT_LABEL) == "spot":
                out.append(str(n["metadata"]["name"]))
        return sorted(out)

    def agent_ready(self, node: str) -> bool:
        """Whether the demo release's node-agent on ``node`` is Ready."""
        pods = self.items(self.core.list_namespaced_pod, RELEASE_NS,
                          field_selector=f"spec.nodeName={node}",
                          label_selector="app.kubernetes.io/component=node-agent")
        statuses = [s for p in pods for s in p.get("status", {}).get("containerStatuses") or []]
        return bool(statuses) and all(s.get("ready") for s in statuses)

    def other_releases(self) -> list[str]:
        """Namespaces of Hermit node-agents that are not the demo's (they would act too)."""
        found = self.items(self.apps.list_daemon_set_for_all_namespaces, label_selector=PART_OF)
        return sorted({str(d["metadata"]["namespace"]) for d in found
                       if d["metadata"]["namespace"] != RELEASE_NS})

    def ask(self, pod: str) -> dict[str, str]:
        """The workload's answer on its TCP port, asked from inside the pod (same netns)."""
        out = stream(client.CoreV1Api().connect_get_namespaced_pod_exec, pod, SANDBOX_NS,
                     command=["sh", "-c", f"nc 127.0.0.1 {PORT} </dev/null"],
                     stderr=True, stdin=False, stdout=True, tty=False)
        return {k: v for k, _, v in (kv.partition("=") for kv in str(out).split()) if v}

    def create_namespace(self, name: str) -> None:
        body: Any = {"metadata": {"name": name}}
        self.core.create_namespace(body)
        wait_until(f"the default service account of {name}", 60,
                   lambda: self._read(self.core.read_namespaced_service_account,
                                      "default", name))

    def delete_namespace(self, name: str) -> bool:
        """Deletes a namespace and waits until it is gone; False when there was none."""
        try:
            self.core.delete_namespace(name)
        except ApiException as exc:
            if exc.status == 404:
                return False
            raise
        wait_until(f"namespace {name} gone", 180,
                   lambda: self._read(self.core.read_namespace, name) is None)
        return True


def stateful_sandbox(mem_mb: int) -> Obj:
    """The AgentSandbox: the self-checking workload, as tests/e2e/sandboxes.py runs it."""
    env = {"HERMIT_TICK_MS": str(TICK_MS), "PORT": str(PORT), "HERMIT_STATE_DIR": "/tmp/state",
           "HERMIT_TICK_LOG": "/workspace/ticks.log", "HERMIT_DB_PATH": "/workspace/agent.db",
           "HERMIT_DELETE_PATH": "", "HERMIT_WORKLOAD_MEM_MB": str(mem_mb)}
    container = {"name": "agent", "image": IMAGE, "imagePullPolicy": "IfNotPresent",
                 "command": [WORKLOAD],
                 "env": [{"name": k, "value": v} for k, v in env.items()]}
    return {"apiVersion": api.API_VERSION, "kind": api.SANDBOX_KIND,
            "metadata": {"name": SANDBOX},
            "spec": {"podTemplate": {"spec": {"containers": [container]}}}}


class Timeline:
    """Prints setup lines, then events in seconds since the notice, each event once."""

    def __init__(self) -> None:
        self.t0 = time.monotonic()
        self.seen: dict[str, float] = {}

    @staticmethod
    def note(text: str) -> None:
        print(f"          {text}", flush=True)

    def at(self, key: str, text: str, when: float | None = None) -> None:
        if key in self.seen:
            return
        self.seen[key] = (when or time.monotonic()) - self.t0
        print(f"[{self.seen[key]:6.1f}s] {text}", flush=True)

    def when(self, key: str) -> float:
        return self.seen.get(key, float("nan"))


class Preemption:
    """``hack/cluster preempt-node NODE --notice N`` in the background, its lines timed."""

    def __init__(self, node: str, notice: int) -> None:
        self.argv = [HACK_CLUSTER, "preempt-node", node, "--notice", str(notice)]
        self.proc = subprocess.Popen(self.argv, stdout=subprocess.PIPE,
                                     stderr=subprocess.STDOUT, text=True)
        self.lines: queue.Queue[tuple[float, str]] = queue.Queue()
        self.output: list[str] = []
        self.times: list[float] = []
        threading.Thread(target=self._read, daemon=True).start()

    def _read(self) -> None:
        assert self.proc.stdout is not None
        for line in self.proc.stdout:
            self.lines.put((time.monotonic(), line.rstrip("\n")))

    def notice(self) -> tuple[float, str] | None:
        """When the notice (hack/cluster prints it, as JSON over lines) appeared, and it."""
        self.new_lines()
        start = next((i for i, line in enumerate(self.output) if line.startswith("{")), None)
        end = next((i for i, line in enumerate(self.output) if line.startswith("}")), None)
        if start is None or end is None or end < start:
            return None
        doc = json.loads("".join(self.output[start:end + 1]))
        return self.times[start], json.dumps(doc)

    def new_lines(self) -> list[tuple[float, str]]:
        out = []
        while True:
            try:
                out.append(self.lines.get_nowait())
            except queue.Empty:
                break
        self.output.extend(line for _, line in out)
        self.times.extend(when for when, _ in out)
        if not out and self.proc.poll() not in (None, 0):
            raise DemoError(f"{' '.join(self.argv)} failed:\n" + "\n".join(self.output))
        return out


@dataclass
class Before:
    """Where the sandbox ran when the notice came, and its state then."""

    node: str
    pod: str
    child: str
    spare: list[str]


class Move:
    """Follows one preemption from the notice to the first tick of the restored pod."""

    def __init__(self, kube: Kube, line: Timeline, before: Before) -> None:
        self.kube, self.line, self.before = kube, line, before
        self.last_tick = 0  # the old pod's last tick
        self.old_gone = False
        self.completed: Obj | None = None
        self.new_pod = ""
        self.new_node = ""
        self.first_tick = 0
        self.running = False
        self.node_gone = False

    def restored(self) -> bool:
        return bool(self.completed and self.old_gone and self.running and self.first_tick)

    def follow(self, preempt: Preemption, timeout: float,
               done: Callable[[Move], bool] = restored) -> None:
        """Prints what happens until ``done`` (by default: the sandbox runs again)."""
        deadline = time.monotonic() + timeout
        while not done(self):
            if time.monotonic() > deadline:
                raise DemoError(f"the move did not finish in {timeout:.0f} s; seen: "
                                f"{list(self.line.seen)}")
            self._preempt_lines(preempt)
            self._node()
            self._checkpoint()
            self._old_pod()
            self._new_pod()
            time.sleep(0.2)

    def _preempt_lines(self, preempt: Preemption) -> None:
        for when, text in preempt.new_lines():
            if "terminating the instance" in text:
                self.line.at("terminated", f"{self.before.node}: the notice's deadline, "
                             "instance terminated (all its processes killed)", when)
            elif "node gone" in text:
                self.node_gone = True
                self.line.at("gone", f"Node {self.before.node} deleted (as the cloud's node "
                             "lifecycle controller does)", when)

    def _node(self) -> None:
        node = self.kube.node(self.before.node)
        taints = ((node or {}).get("spec") or {}).get("taints") or []
        if any(t.get("key") == protocol.TAINT_INTERRUPTION for t in taints):
            self.line.at("taint", f"{self.before.node}: node-agent tainted "
                         f"{protocol.TAINT_INTERRUPTION} and cordoned the node")

    def _old_pod(self) -> None:
        if self.old_gone:
            return
        pod = self.kube.pod(SANDBOX_NS, self.before.pod)
        if pod is None:
            self.old_gone = True
            self.line.at("old-gone", f"old pod {self.before.pod} gone")
            return
        seen = self.kube.ticks(self.before.pod)
        self.last_tick = max([self.last_tick, *seen])
        if pod["metadata"].get("deletionTimestamp"):
            self.line.at("old-deleted", f"old pod {self.before.pod} deleted by the operator; "
                         f"its last tick: {self.last_tick}")

    def _checkpoint(self) -> None:
        if self.completed:
            return
        for c in self.kube.checkpoints():
            if protocol.reason_of(c) != protocol.PREEMPTION or \
                    protocol.sandbox_of(c) != SANDBOX:
                continue
            name, phase = protocol.name_of(c), protocol.phase_of(c)
            self.line.at("ckpt", f"checkpoint {name} (Preemption) created by the node-agent")
            if phase in protocol.ACTIVE:
                self.line.at(f"ckpt-{phase}", f"checkpoint {name}: {phase}")
            elif phase == protocol.FAILED:
                raise DemoError(f"checkpoint {name} Failed: {c['status'].get('message')}")
            elif phase == protocol.COMPLETED:
                self.completed = c
                s = c["status"]
                self.line.at("durable", f"checkpoint durable: {mb(s.get('imageBytes'))} of "
                             f"images, {mb(s.get('uploadedBytes'))} uploaded; frozen "
                             f"{s.get('frozenMs')} ms (dump {s.get('dumpMs')}, upload "
                             f"{s.get('uploadMs')})")

    def _new_pod(self) -> None:
        status = self.kube.sandbox().get("status") or {}
        if status.get("phase") == FAILED:
            raise DemoError(f"sandbox Failed: {status.get('conditions')}")
        name = status.get("podName") or ""
        if not name or name == self.before.pod:
            return
        self.new_pod = name
        pod = self.kube.pod(SANDBOX_NS, name) or {"metadata": {}, "spec": {}}
        notes = pod["metadata"].get("annotations") or {}
        source = notes.get(protocol.ANNOTATION_RESTORE_FROM)
        self.line.at("new-pod", f"new pod {name} created, "
                     f"{protocol.ANNOTATION_RESTORE_FROM}={source}")
        self.new_node = pod["spec"].get("nodeName") or ""
        if self.new_node:
            self.line.at("scheduled", f"{name} scheduled on {self.new_node}")
        self._restore_phase(notes)
        if status.get("phase") == RUNNING and int(status.get("restores") or 0) >= 1:
            self.running = True
            self.line.at("running", f"sandbox Running on {status.get('nodeName')}, "
                         f"restores={status.get('restores')}")
        seen = self.kube.ticks(name) if self.new_node else []
        if seen:
            self.first_tick = seen[0]
            self.line.at("tick", f"{name} printed tick {seen[0]}")

    def _restore_phase(self, notes: dict[str, str]) -> None:
        phase = notes.get(protocol.ANNOTATION_RESTORE_PHASE)
        message = notes.get(protocol.ANNOTATION_RESTORE_MESSAGE) or ""
        if phase == protocol.RESTORING:
            self.line.at("restoring", f"{self.new_node}: node-agent restoring {self.new_pod}")
        elif phase == protocol.RESTORED:
            self.line.at("restored", f"{self.new_node}: {message}")
        elif phase == protocol.RESTORE_FAILED:
            raise DemoError(f"the restore failed: {message}")


def check_continued(kube: Kube, line: Timeline, move: Move, before: Before) -> None:
    """The restored pod's counter continues the old one's without a gap or repeat, and the
    workload answers with the same child and its database in step."""
    def ten() -> list[int] | None:
        t = kube.ticks(move.new_pod)
        return t if len(t) >= 10 else None

    seen = wait_until(f"ten ticks in {move.new_pod}", 60, ten)
    if seen != list(range(seen[0], seen[0] + len(seen))):
        raise DemoError(f"gap or repeat in the restored pod's ticks: {seen[:20]}")
    if seen[0] != move.last_tick + 1:
        raise DemoError(f"the old pod's last tick was {move.last_tick}, the new pod's first "
                        f"is {seen[0]}")
    answer = kube.ask(move.new_pod)
    if answer.get("child") != before.child or int(answer.get("counter", 0)) < seen[-1]:
        raise DemoError(f"unexpected answer {answer} (child before: {before.child})")
    counter = int(answer.get("counter", 0))
    if answer.get("db") not in (str(counter), str(counter - 1)):
        raise DemoError(f"the database is not in step with the counter: {answer}")
    pod = kube.pod(SANDBOX_NS, move.new_pod) or {}
    statuses = (pod.get("status") or {}).get("containerStatuses") or []
    if not statuses or any("running" not in (s.get("state") or {}) for s in statuses):
        raise DemoError(f"the restored container is not running: {statuses}")
    line.at("continued", f"state continued: ticks {seen[0]}..{seen[-1]} follow "
            f"{move.last_tick}; counter={answer.get('counter')} child={answer.get('child')} "
            f"(same) db={answer.get('db')} gen={answer.get('gen')}; self-checks hold")


def summary(line: Timeline, move: Move) -> None:
    """Seconds from the notice to each milestone, and the work lost (none after a move)."""
    s = (move.completed or {}).get("status") or {}
    line.note(f"notice -> durable {line.when('durable'):.1f} s (frozen {s.get('frozenMs')} ms)"
              f", -> running on {move.new_node} {line.when('running'):.1f} s; node gone at "
              f"{line.when('terminated'):.1f} s; no tick lost or repeated")


class Demo:
    def __init__(self, notice: int, mem_mb: int) -> None:
        self.notice, self.mem_mb = notice, mem_mb
        self.kube = Kube()
        self.line = Timeline()
        self.minio: MinioServer | None = None
        self.spot_before = 0
        self.preempted = False

    def run(self, workdir: Path) -> None:
        others = self.kube.other_releases()
        if others:
            raise DemoError(f"Hermit is installed in namespace(s) {', '.join(others)}: its "
                            "operator and node-agents would act on the demo's sandbox too; "
                            "uninstall it first")
        self.remove(quiet=True)  # what an interrupted earlier run left
        self.install(workdir)
        before = self.start_sandbox()
        self.line.note(f"hack/cluster preempt-node {before.node} --notice {self.notice}")
        preempt = Preemption(before.node, self.notice)
        self.preempted = True
        when, notice = wait_until("the spot notice", 60, preempt.notice, 0.1)
        self.line.t0 = when
        self.line.at("notice", f"{before.node}: spot notice in its instance metadata: "
                     f"{notice}", when)
        move = Move(self.kube, self.line, before)
        move.follow(preempt, 240)
        check_continued(self.kube, self.line, move, before)
        move.follow(preempt, self.notice + 120, lambda m: m.node_gone)
        summary(self.line, move)

    def install(self, workdir: Path) -> None:
        host = os.environ.get("HERMIT_DEMO_S3_HOST", "10.213.0.1")
        self.minio = start_minio(workdir / "minio", host=host)
        CheckpointStore(self.minio.settings(BUCKET)).ensure_bucket()
        self.line.note(f"MinIO for the pods at {self.minio.endpoint}, bucket {BUCKET}")
        self.kube.create_namespace(RELEASE_NS)
        secret: Any = {"metadata": {"name": SECRET}, "stringData": {
            "AWS_ACCESS_KEY_ID": self.minio.access_key,
            "AWS_SECRET_ACCESS_KEY": self.minio.secret_key}}
        self.kube.core.create_namespaced_secret(RELEASE_NS, secret)
        # The chart installs the CRDs; ones another release (the e2e tier's) or an older
        # chart left would be refused without this release's ownership.
        adopted = subprocess.run([str(REPO / "hack" / "adopt-crds"), RELEASE, RELEASE_NS],
                                 capture_output=True, text=True, check=False)
        if adopted.returncode != 0:
            raise DemoError(f"hack/adopt-crds failed: {adopted.stdout}{adopted.stderr}")
        argv = [HELM, "install", RELEASE, str(REPO / "charts/hermit"), "-n", RELEASE_NS,
                "--set", f"s3.bucket={BUCKET}", "--set", f"s3.endpoint={self.minio.endpoint}",
                "--set", f"s3.existingSecret={SECRET}",
                # root sandboxes: this machine's nodes lack CAP_SYS_RESOURCE, which CRIU
                # needs to checkpoint a non-root one (tests/e2e/cluster.py)
                "--set", "operator.podPolicy.profile=baseline",
                "--wait", "--timeout", "180s"]
        started = time.monotonic()
        done = subprocess.run(argv, capture_output=True, text=True, check=False)
        if done.returncode != 0:
            raise DemoError(f"helm install failed: {done.stdout}{done.stderr}")
        self.line.note(f"helm install {RELEASE} charts/hermit -n {RELEASE_NS} (s3.endpoint: "
                       f"that MinIO): ready in {time.monotonic() - started:.1f} s")

    def start_sandbox(self) -> Before:
        self.spot_before = len(self.kube.ready_spot_nodes())
        self.ensure_spot_nodes(2)
        self.kube.create_namespace(SANDBOX_NS)
        self.kube.custom.create_namespaced_custom_object(
            api.GROUP, api.VERSION, SANDBOX_NS, api.SANDBOX_PLURAL, stateful_sandbox(self.mem_mb))

        def running() -> Obj | None:
            s = self.kube.sandbox().get("status") or {}
            if s.get("phase") == FAILED:
                raise DemoError(f"sandbox Failed: {s.get('conditions')}")
            pod = str(s.get("podName") or "")
            ok = s.get("phase") == RUNNING and bool(pod) and len(self.kube.ticks(pod)) >= 10
            return s if ok else None

        status = wait_until("the sandbox Running with ten ticks", 240, running)
        node, pod = status["nodeName"], status["podName"]
        spare = [n for n in self.kube.ready_spot_nodes() if n != node]
        for n in [node, *spare]:
            wait_until(f"the node-agent of {n} Ready", 120, self.agent_probe(n))
        answer = self.kube.ask(pod)
        self.line.note(f"sandbox {SANDBOX} ({WORKLOAD}, {self.mem_mb} MiB of patterned memory)"
                       f" on {node}, pod {pod}: counter={answer.get('counter')} "
                       f"child={answer.get('child')} db={answer.get('db')}; spare: "
                       f"{', '.join(spare)}")
        return Before(node, pod, answer.get("child", ""), spare)

    def agent_probe(self, node: str) -> Callable[[], bool]:
        return lambda: self.kube.agent_ready(node)

    def ensure_spot_nodes(self, count: int) -> None:
        """Adds spot nodes (hack/cluster add-node --spot) until ``count`` are Ready."""
        while len(self.kube.ready_spot_nodes()) < count:
            added = subprocess.run([HACK_CLUSTER, "add-node", "--spot"], capture_output=True,
                                   text=True, timeout=300, check=False)
            if added.returncode != 0:
                raise DemoError(f"add-node failed: {added.stdout}{added.stderr}")
            self.line.note(f"added spot node {added.stdout.strip()} (hack/cluster add-node "
                           "--spot), as a spot pool would")

    def remove(self, quiet: bool = False) -> None:
        """Removes the sandbox namespace (while the operator runs), the release, its
        namespace and MinIO."""
        say = (lambda _text: None) if quiet else self.line.note
        if self.kube.delete_namespace(SANDBOX_NS):
            say(f"deleted namespace {SANDBOX_NS}")
        gone = subprocess.run([HELM, "uninstall", RELEASE, "-n", RELEASE_NS, "--wait"],
                              capture_output=True, text=True, check=False)
        if gone.returncode == 0:
            say(f"helm uninstall {RELEASE} -n {RELEASE_NS}")
        if self.kube.delete_namespace(RELEASE_NS):
            say(f"deleted namespace {RELEASE_NS}")
        if self.minio is not None:
            stop_minio(self.minio)
            self.minio = None
            say("stopped MinIO")
        if self.preempted:
            self.ensure_spot_nodes(self.spot_before)


def main(argv: list[str]) -> int:
    p = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    p.add_argument("--notice", type=int, default=30, help="seconds of notice (default 30)")
    p.add_argument("--mem-mb", type=int, default=64,
                   help="MiB of patterned memory the workload holds (default 64)")
    args = p.parse_args(argv)
    demo = Demo(args.notice, args.mem_mb)
    failed: str | None = None
    with tempfile.TemporaryDirectory(prefix="hermit-demo-") as work:
        try:
            demo.run(Path(work))
        except (DemoError, HermitError, ApiException, OSError,
                subprocess.SubprocessError) as exc:
            failed = str(exc)
        finally:
            print("cleanup:", flush=True)
            demo.remove()
    if failed:
        print(f"hermit demo: failed: {failed}", file=sys.stderr)
        return 1
    print("the cluster stays up (hack/cluster status)")
    return 0


if __name__ == "__main__":
    sys.exit(main(sys.argv[1:]))
