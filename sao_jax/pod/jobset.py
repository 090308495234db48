"""GKE without Ray: the pod job as a Kubernetes JobSet (jobset.x-k8s.io/v1alpha2).

`launch/pod.py --emit=jobset` writes it. Two replicated jobs, the hosts of
`pod.plan` with the same commands the Ray path runs:

  * `trainer`: one Indexed Job of `pod.trainer_hosts` pods on the training
    slice (`pod.tpu_type`, `pod.trainer_topology`, `pod.chips_per_host`
    chips a pod); a pod's completion index is its jax.distributed process
    id, and process 0's stable JobSet hostname the coordinator;
  * `rollout`: `pod.rollout_hosts` one-pod Jobs, each on a slice of
    `pod.rollout_topology`; a Job's index in the JobSet is its rollout id.

Supervision maps onto Kubernetes' own: a rollout pod that fails is
replaced within its Job up to `pod.max_rollout_restarts` times (it resumes
its shard sequence under the same rollout id); a trainer pod that fails
fails its Job (backoffLimit 0) and the JobSet restarts every job, up to
`pod.max_trainer_restarts` times (the trainer resumes from its last
checkpoint, the rollouts from their shard sequences); the JobSet succeeds
when the trainer job does. Every pod carries what sao_jax/pod/kube.py adds
(volumes, the sandbox's privilege, requests, the service account, the
grace period); the JobSet the Kueue queue label. Not applied to a cluster
here: the tests load each Job template through the `kubernetes` client's
models, check the whole manifest against the JobSet CRD's published schema
(tests/pod/crd_schemas/), and compare every host's command with the Ray
path's.
"""

from __future__ import annotations

from typing import Sequence

from sao_jax.config import sections
from sao_jax.pod import hosts as pod_lib
from sao_jax.pod import kube

API_VERSION = "jobset.x-k8s.io/v1alpha2"
DEFAULT_PORT = 8476  # jax.distributed's usual coordinator port
# Kubernetes expands $(VAR) in a container's command from its env.
PROCESS_ID = "$(PROCESS_ID)"
COORDINATOR_ENV = "$(COORDINATOR_ADDRESS)"


def coordinator_address(name: str, pod: sections.Pod) -> str:
  """Trainer process 0's JobSet hostname (<jobset>-<job>-<job index>-<pod index>.<subdomain>)."""
  return f"{name}-{pod_lib.TRAINER}-0-0.{name}:{pod.coordinator_port or DEFAULT_PORT}"


def _env(pod: sections.Pod, index_annotation: str, extra: dict) -> list[dict]:
  env = [
    {
      "name": "PROCESS_ID",
      "valueFrom": {"fieldRef": {"fieldPath": f"metadata.annotations['{index_annotation}']"}},
    }
  ]
  env += [{"name": k, "value": v} for k, v in {**extra, **pod.host_env}.items()]
  return env


def _job(
  role: str,
  pod: sections.Pod,
  argv: list[str],
  *,
  pods: int,
  topology: str,
  index_annotation: str,
  backoff: int,
  extra_env: dict,
) -> dict:
  container = {
    "name": role,
    "image": pod.image,
    "workingDir": kube.APP_DIR,
    "command": argv,
    "env": _env(pod, index_annotation, extra_env),
  }
  template = kube.pod_template(
    pod,
    container,
    requests=kube.role_requests(pod, role),
    tpu_chips=pod.chips_per_host,
    node_selector=kube.tpu_node_selector(pod, topology),
    spec={"restartPolicy": "Never"},
  )
  return {
    "spec": {
      "parallelism": pods,
      "completions": pods,
      "completionMode": "Indexed",
      "backoffLimit": backoff,
      "template": template,
    }
  }


def jobset(
  name: str, config_file: str, workdir: str, overrides: Sequence[str], pod: sections.Pod
) -> dict:
  """The JobSet manifest (a dict, for yaml or json) of the pod job `name`
  (`kube.check_storage` first: this builds whatever it is given)."""
  kube.check_sandbox(pod, {pod_lib.TRAINER: pod.trainer_hosts, pod_lib.ROLLOUT: 1})
  trainer_argv = pod_lib.host_argv(
    pod_lib.TRAINER, PROCESS_ID, config_file, workdir, overrides, pod, COORDINATOR_ENV
  )
  jobs = [
    {
      "name": pod_lib.TRAINER,
      "replicas": 1,
      "template": _job(
        pod_lib.TRAINER,
        pod,
        trainer_argv,
        pods=pod.trainer_hosts,
        topology=pod.trainer_topology,
        index_annotation="batch.kubernetes.io/job-completion-index",
        backoff=0,
        extra_env={"COORDINATOR_ADDRESS": coordinator_address(name, pod)},
      ),
    }
  ]
  if pod.rollout_hosts:
    rollout_argv = pod_lib.host_argv(
      pod_lib.ROLLOUT, PROCESS_ID, config_file, workdir, overrides, pod, ""
    )
    jobs.append(
      {
        "name": pod_lib.ROLLOUT,
        "replicas": pod.rollout_hosts,
        "template": _job(
          pod_lib.ROLLOUT,
          pod,
          rollout_argv,
          pods=1,
          topology=pod.rollout_topology,
          index_annotation="jobset.sigs.k8s.io/job-index",
          backoff=pod.max_rollout_restarts,
          extra_env={},
        ),
      }
    )
  metadata = {
    "name": name,
    "annotations": {
      # One job a node pool: a slice's hosts are not shared between jobs.
      "alpha.jobset.sigs.k8s.io/exclusive-topology": "cloud.google.com/gke-nodepool"
    },
  }
  if kube.labels(pod):
    metadata["labels"] = kube.labels(pod)
  return {
    "apiVersion": API_VERSION,
    "kind": "JobSet",
    "metadata": metadata,
    "spec": {
      "network": {"enableDNSHostnames": True},
      "failurePolicy": {"maxRestarts": pod.max_trainer_restarts},
      "successPolicy": {"operator": "All", "targetReplicatedJobs": [pod_lib.TRAINER]},
      "replicatedJobs": jobs,
    },
  }


def expand(argv: Sequence[str], env: dict) -> list[str]:
  """A container command as Kubernetes runs it: $(VAR) replaced from `env`."""
  out = []
  for a in argv:
    for k, v in env.items():
      a = a.replace(f"$({k})", v)
    out.append(a)
  return out
