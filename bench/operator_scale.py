"""How the operator scales with the number of sandboxes, on fake nodes (kwok).

    .venv/bin/python bench/operator_scale.py [--sandboxes 2000] [--nodes 20] [--idle 60]

Starts a throwaway control plane of its own (etcd, kube-apiserver and kube-scheduler
from ~/.cache/hermit/bin, hack/install-k8s; free ports, a temporary directory; never the
shared cluster), installs the CRDs, runs kwok (hack/install-kwok) with ``--nodes`` fake
spot nodes (kwok marks the pods bound to them Running and Ready), starts the operator of
this checkout (``--operator-path``: another checkout's, to compare) against it, creates
``--sandboxes`` AgentSandboxes and prints:

- convergence: sandboxes ``Running`` per second, from the first create to the last one
  Running;
- over an idle window of ``--idle`` seconds after convergence: the operator's CPU (% of
  one core, from /proc/<pid>/stat) and RSS (MiB), and the API server's requests per
  second (``apiserver_request_total`` deltas), all of them and those on the resources the
  operator uses (AgentSandboxes, Checkpoints, pods, PodDisruptionBudgets, Events: kwok's
  node heartbeats are on nodes and leases).

Everything it started is stopped at the end (``--keep`` leaves the control plane up and
prints its kubeconfig).
"""

from __future__ import annotations

import argparse
import concurrent.futures
import copy
import os
import shutil
import signal
import subprocess
import sys
import tempfile
import time
from dataclasses import dataclass
from pathlib import Path
from typing import Any

import yaml

from hermit_testbed.controlplane import ControlPlane, Processes, binary, free_port, wait_for
from hermit_testbed.controlplane import start_control_plane as start_plane

ROOT = Path(__file__).resolve().parents[1]
NAMESPACE = "bench"
OPERATOR_RESOURCES = ("agentsandboxes", "checkpoints", "pods", "poddisruptionbudgets", "events")
CLK_TCK = os.sysconf("SC_CLK_TCK")


def log(message: str) -> None:
    print(f"[{time.strftime('%H:%M:%S')}] {message}", flush=True)


def install_crds() -> None:
    from kubernetes import client, config

    config.load_kube_config()
    ext = client.ApiextensionsV1Api()
    for path in sorted((ROOT / "crds").glob("*.yaml")):
        ext.create_custom_resource_definition(yaml.safe_load(path.read_text()))

    def established() -> bool:
        crds = ext.list_custom_resource_definition().items
        return sum(any(c.type == "Established" and c.status == "True"
                       for c in crd.status.conditions or []) for crd in crds) >= 2

    wait_for("the CRDs to be established", established, 60)
    core = client.CoreV1Api()
    core.create_namespace({"metadata": {"name": NAMESPACE}})
    wait_for("the default ServiceAccount", lambda: _default_sa(core), 5)


def _default_sa(core: Any) -> bool:
    """No controller-manager runs: the pods' ServiceAccount is made here."""
    try:
        core.create_namespaced_service_account(NAMESPACE, {"metadata": {"name": "default"}})
    except Exception as exc:  # 409: made already
        if getattr(exc, "status", None) != 409:
            raise
    return True


def start_kwok(procs: Processes, kubeconfig: Path, nodes: int) -> None:
    """kwok, and the fake spot nodes it manages (labelled as Karpenter labels spot nodes)."""
    from kubernetes import client

    procs.start("kwok", [binary("kwok", "run hack/install-kwok"), "--kubeconfig", str(kubeconfig),
                         "--manage-all-nodes=false",
                         "--manage-nodes-with-annotation-selector=kwok.x-k8s.io/node=fake",
                         "--cidr=10.240.0.1/16", "--node-ip=10.241.0.1",
                         "--server-address", f"127.0.0.1:{free_port()}"])
    core = client.CoreV1Api()
    for n in range(nodes):
        core.create_node({
            "metadata": {"name": f"kwok-spot-{n}", "annotations": {"kwok.x-k8s.io/node": "fake"},
                         "labels": {"karpenter.sh/capacity-type": "spot", "type": "kwok",
                                    "kubernetes.io/hostname": f"kwok-spot-{n}"}},
            "status": {"allocatable": {"cpu": "1000", "memory": "4Ti", "pods": "1000"},
                       "capacity": {"cpu": "1000", "memory": "4Ti", "pods": "1000"}}})

    def ready() -> bool:
        procs.check()
        return sum(any(c.type == "Ready" and c.status == "True" for c in nd.status.conditions
                       or []) for nd in core.list_node().items) >= nodes

    wait_for(f"{nodes} kwok nodes Ready", ready, 120)
    for n in range(nodes):  # no node lifecycle controller runs to lift it
        core.patch_node(f"kwok-spot-{n}", {"spec": {"taints": []}})


def start_operator(procs: Processes, kubeconfig: Path, path: Path, resync: float | None,
                   metrics_port: int, extra: list[str]) -> subprocess.Popen[bytes]:
    import socket

    with socket.socket() as s:  # kopf's liveness endpoint (hermit_operator.health)
        try:
            s.bind(("127.0.0.1", 8080))
        except OSError:
            raise SystemExit("operator_scale: 127.0.0.1:8080 (the operator's kopf liveness "
                             "endpoint) is in use: is another operator running here?") from None
    env = {**os.environ, "KUBECONFIG": str(kubeconfig), "HERMIT_LOG_LEVEL": "WARNING",
           "HERMIT_METRICS_PORT": str(metrics_port), "PYTHONWARNINGS": "ignore",
           "PYTHONPATH": ":".join(str(path / p) for p in ("common", "operator", "testbed"))}
    if resync is not None:
        env["HERMIT_RESYNC_SECONDS"] = str(resync)
    env.update(item.split("=", 1) for item in extra)
    return procs.start("operator", [sys.executable, "-m", "hermit_operator.main"], env=env)


def create_sandboxes(n: int, workers: int = 8) -> float:
    """N AgentSandboxes (the minimal sample); the time.monotonic() the first was created."""
    from kubernetes import client

    custom = client.CustomObjectsApi()
    sample = yaml.safe_load((ROOT / "crds" / "samples" / "agentsandbox-minimal.yaml").read_text())

    def make(i: int) -> None:
        body = copy.deepcopy(sample)
        body["metadata"] = {"name": f"sbx-{i:05d}", "namespace": NAMESPACE}
        custom.create_namespaced_custom_object("hermit.dev", "v1alpha1", NAMESPACE,
                                               "agentsandboxes", body)

    began = time.monotonic()
    with concurrent.futures.ThreadPoolExecutor(workers) as pool:
        list(pool.map(make, range(n)))
    log(f"created {n} AgentSandboxes in {time.monotonic() - began:.1f} s")
    return began


def running_count() -> int:
    from kubernetes import client

    items = client.CustomObjectsApi().list_namespaced_custom_object(
        "hermit.dev", "v1alpha1", NAMESPACE, "agentsandboxes").get("items") or []
    return sum((i.get("status") or {}).get("phase") == "Running" for i in items)


def wait_converged(procs: Processes, n: int, began: float, timeout: float) -> float:
    """Seconds from the first create until every sandbox is Running."""
    deadline, last = began + timeout, -1
    while True:
        procs.check()
        count = running_count()
        if count != last:
            log(f"{count}/{n} Running after {time.monotonic() - began:.0f} s")
            last = count
        if count >= n:
            return time.monotonic() - began
        if time.monotonic() > deadline:
            raise SystemExit(f"operator_scale: only {count}/{n} Running after {timeout:.0f} s")
        time.sleep(2.0)


def reconciles(metrics_port: int) -> float:
    """The operator's hermit_operator_reconciles_total, all results."""
    import urllib.request

    with urllib.request.urlopen(f"http://127.0.0.1:{metrics_port}/metrics", timeout=10) as r:
        text = r.read().decode()
    return sum(float(line.rsplit(" ", 1)[1]) for line in text.splitlines()
               if line.startswith("hermit_operator_reconciles_total{"))


def wait_quiet(procs: Processes, metrics_port: int, quiet: float, limit: float) -> float:
    """Seconds until the operator made no reconcile for ``quiet`` seconds (its backlog of
    events is done): the idle window starts then, or after ``limit`` seconds anyway (an
    operator that polls never goes quiet)."""
    began = time.monotonic()
    last, since = reconciles(metrics_port), time.monotonic()
    while time.monotonic() - since < quiet:
        procs.check()
        if time.monotonic() - began > limit:
            log(f"the operator still reconciles {limit:.0f} s after convergence")
            break
        time.sleep(1.0)
        now = reconciles(metrics_port)
        if now != last:
            last, since = now, time.monotonic()
    return time.monotonic() - began


def cpu_seconds(pid: int) -> float:
    fields = Path(f"/proc/{pid}/stat").read_text().rsplit(")", 1)[1].split()
    return (int(fields[11]) + int(fields[12])) / CLK_TCK  # utime, stime


def rss_mib(pid: int) -> float:
    for line in Path(f"/proc/{pid}/status").read_text().splitlines():
        if line.startswith("VmRSS:"):
            return int(line.split()[1]) / 1024
    return 0.0


@dataclass(frozen=True)
class Idle:
    cpu_percent: float
    rss_mib: float
    max_rss_mib: float
    requests: float  # every request per second
    operator_requests: float  # on OPERATOR_RESOURCES, per second
    by_resource: dict[str, float]


def measure_idle(plane: ControlPlane, pid: int, seconds: float) -> Idle:
    procs = plane.processes
    before, cpu0, t0 = plane.request_counts(), cpu_seconds(pid), time.monotonic()
    peak = rss_mib(pid)
    while time.monotonic() - t0 < seconds:
        procs.check()
        time.sleep(1.0)
        peak = max(peak, rss_mib(pid))
    elapsed = time.monotonic() - t0
    cpu = (cpu_seconds(pid) - cpu0) / elapsed * 100
    after = plane.request_counts()
    delta = {r: (v - before.get(r, 0.0)) / elapsed for r, v in after.items()
             if v - before.get(r, 0.0) > 0}
    ours = sum(v for r, v in delta.items() if r in OPERATOR_RESOURCES)
    return Idle(cpu, rss_mib(pid), peak, sum(delta.values()), ours, delta)


def report(args: argparse.Namespace, converge: float, idle: Idle) -> None:
    print()
    print(f"operator: {args.operator_path} ({args.sandboxes} sandboxes on {args.nodes} "
          f"kwok spot nodes, resync {args.resync or 'default'})")
    print(f"  convergence       {args.sandboxes / converge:8.1f} sandboxes Running/s "
          f"({args.sandboxes} in {converge:.0f} s)")
    print(f"  idle CPU          {idle.cpu_percent:8.1f} % of a core (over {args.idle:.0f} s)")
    print(f"  idle RSS          {idle.rss_mib:8.0f} MiB (peak in the window "
          f"{idle.max_rss_mib:.0f} MiB)")
    print(f"  API requests/s    {idle.requests:8.2f} (all clients; on the operator's "
          f"resources: {idle.operator_requests:.2f})")
    for resource, rate in sorted(idle.by_resource.items(), key=lambda kv: -kv[1]):
        print(f"      {resource:24s} {rate:8.2f}/s")


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--sandboxes", type=int, default=2000)
    parser.add_argument("--nodes", type=int, default=20)
    parser.add_argument("--idle", type=float, default=60.0, help="idle window, seconds")
    parser.add_argument("--settle", type=float, default=10.0,
                        help="seconds without a reconcile before the idle window starts")
    parser.add_argument("--timeout", type=float, default=1800.0, help="convergence limit")
    parser.add_argument("--busy-limit", type=float, default=300.0,
                        help="the idle window starts at the latest this long after convergence")
    parser.add_argument("--resync", type=float, help="HERMIT_RESYNC_SECONDS for the operator")
    parser.add_argument("--operator-path", type=Path, default=ROOT,
                        help="the checkout whose operator runs (default: this one)")
    parser.add_argument("--operator-env", action="append", default=[], metavar="NAME=VALUE",
                        help="an environment variable for the operator (repeatable)")
    parser.add_argument("--keep", action="store_true", help="leave the control plane up")
    args = parser.parse_args(argv)
    signal.signal(signal.SIGTERM, lambda *_: sys.exit(143))  # stop what it started
    workdir = Path(tempfile.mkdtemp(prefix="hermit-bench-"))
    plane = start_plane(workdir, scheduler=True)
    procs = plane.processes
    os.environ["KUBECONFIG"] = str(plane.kubeconfig)
    try:
        log(f"control plane at 127.0.0.1:{plane.port} (logs in {workdir})")
        install_crds()
        start_kwok(procs, plane.kubeconfig, args.nodes)
        metrics_port = free_port()
        operator = start_operator(procs, plane.kubeconfig, args.operator_path.resolve(),
                                  args.resync, metrics_port, args.operator_env)
        time.sleep(3.0)
        procs.check()
        began = create_sandboxes(args.sandboxes)
        converge = wait_converged(procs, args.sandboxes, began, args.timeout)
        busy = wait_quiet(procs, metrics_port, args.settle, args.busy_limit)
        log(f"converged; the operator's last reconcile {busy - args.settle:.0f} s later; "
            f"{args.idle:.0f} s idle now")
        report(args, converge, measure_idle(plane, operator.pid, args.idle))
    finally:
        if args.keep:
            print(f"kept: KUBECONFIG={plane.kubeconfig}")
        else:
            plane.stop()
            shutil.rmtree(workdir, ignore_errors=True)
    return 0


if __name__ == "__main__":
    sys.exit(main())
