"""GKE with Ray: the pod job's Ray cluster as a KubeRay RayCluster (ray.io/v1).

`launch/pod.py --emit=raycluster` writes it; the driver then runs on the
head, the very command of the Ray path (`driver_command`):

    kubectl apply -f job.raycluster.json
    kubectl exec -it $(kubectl get pod -l ray.io/cluster=NAME,ray.io/node-type=head \
        -o name) -- python launch/pod.py --config=... --workdir=... --ray_address=auto

The cluster has a head (the driver only supervises: no TPU, no sandbox
privilege, `pod.head_requests`, zero CPUs for Ray so that no host's actor
lands there, its dashboard on loopback: reach it with `kubectl
port-forward`) and two worker groups:

  * `trainer`: one replica of `pod.trainer_hosts` hosts (KubeRay's
    `numOfHosts`: one multi-host TPU slice of `pod.trainer_topology`);
  * `rollout`: `pod.rollout_hosts` replicas of one host each, a slice of
    `pod.rollout_topology` apiece.

Ray finds each worker's TPU chips itself; the Ray path places hosts by
`pod.trainer_resources` / `pod.rollout_resources`, so both must name
`{"TPU": pod.chips_per_host}` (else a host could land on any worker): the
emitter refuses otherwise. Every pod carries what sao_jax/pod/kube.py adds.
Restarts are the driver's (sao_jax/pod/hosts.py `Supervisor`), not
KubeRay's. Multi-host TPU worker groups need GKE's Ray operator add-on
(its TPU webhook sets each host's TPU worker id). Not applied to a cluster
here: the tests load each pod template through the `kubernetes` client's
models and check the manifest against the RayCluster CRD's published
schema (tests/pod/crd_schemas/).
"""

from __future__ import annotations

from typing import Sequence

from sao_jax.config import sections
from sao_jax.pod import hosts as pod_lib
from sao_jax.pod import kube

API_VERSION = "ray.io/v1"


def check(pod: sections.Pod) -> None:
  """Refuses (one line) a RayCluster on which the Ray path would misplace hosts."""
  for field, resources in (
    ("pod.trainer_resources", pod.trainer_resources),
    ("pod.rollout_resources", pod.rollout_resources),
  ):
    if resources.get("TPU") != pod.chips_per_host:
      raise sections.ConfigError(
        f"{field} = {resources!r}: on a RayCluster each host is placed on its TPU slice "
        f"by the TPU resource; set {{'TPU': {pod.chips_per_host}}} (pod.chips_per_host)"
      )
  kube.check_sandbox(pod, {pod_lib.TRAINER: pod.trainer_hosts, pod_lib.ROLLOUT: 1})


def _worker_group(
  role: str, pod: sections.Pod, *, replicas: int, hosts: int, topology: str
) -> dict:
  container = {
    "name": "ray-worker",
    "image": pod.image,
    "workingDir": kube.APP_DIR,
    "env": [{"name": k, "value": v} for k, v in pod.host_env.items()],
  }
  template = kube.pod_template(
    pod,
    container,
    requests=kube.role_requests(pod, role),
    tpu_chips=pod.chips_per_host,
    node_selector=kube.tpu_node_selector(pod, topology),
  )
  return {
    "groupName": role,
    "replicas": replicas,
    "minReplicas": replicas,
    "maxReplicas": replicas,
    "numOfHosts": hosts,
    "rayStartParams": {},
    "template": template,
  }


def raycluster(name: str, pod: sections.Pod, ray_version: str | None = None) -> dict:
  """The RayCluster manifest (a dict, for yaml or json) of the pod job `name`
  (`kube.check_storage` and `check` first)."""
  check(pod)
  head = kube.pod_template(
    pod.replace(sandbox="none"),
    {"name": "ray-head", "image": pod.image, "workingDir": kube.APP_DIR},
    requests=pod.head_requests,
  )
  groups = [
    _worker_group(
      pod_lib.TRAINER, pod, replicas=1, hosts=pod.trainer_hosts, topology=pod.trainer_topology
    )
  ]
  if pod.rollout_hosts:
    groups.append(
      _worker_group(
        pod_lib.ROLLOUT, pod, replicas=pod.rollout_hosts, hosts=1, topology=pod.rollout_topology
      )
    )
  metadata = {"name": name}
  if kube.labels(pod):
    metadata["labels"] = kube.labels(pod)
  spec = {
    "enableInTreeAutoscaling": False,
    "headGroupSpec": {
      "rayStartParams": {"num-cpus": "0", "dashboard-host": "127.0.0.1"},
      "template": head,
    },
    "workerGroupSpecs": groups,
  }
  if ray_version:
    spec = {"rayVersion": ray_version, **spec}
  return {"apiVersion": API_VERSION, "kind": "RayCluster", "metadata": metadata, "spec": spec}


def driver_command(config_file: str, workdir: str, overrides: Sequence[str]) -> list[str]:
  """What to run on the head once the cluster is up: the Ray path's driver."""
  return [
    "python",
    "launch/pod.py",
    f"--config={config_file}",
    f"--workdir={workdir}",
    "--ray_address=auto",
    *overrides,
  ]
