"""What every Kubernetes pod of an emitted job carries, so that it starts on GKE.

`launch/pod.py --emit=jobset` (sao_jax/pod/jobset.py) and `--emit=raycluster`
(sao_jax/pod/raycluster.py) build their pod templates from here:

  * storage: `pod.volumes` (a PersistentVolumeClaim, e.g. Filestore, or a
    bucket through the gcsfuse CSI driver) mounted at the same path in
    every pod. `check_storage` refuses to emit a job whose workdir,
    fleet.root or any absolute path of the config (a dataset, an HF
    checkpoint, a tokenizer) is on no volume: each pod would write its own
    disk. Relative paths resolve in the image (`APP_DIR`);
  * identity: `pod.service_account` (Workload Identity), required when
    anything is on GCS;
  * privilege: the code sandbox (sao_jax/envs/sandbox.py) runs as root and
    makes network, IPC, PID and mount namespaces, which takes CAP_SYS_ADMIN.
    `pod.sandbox = "sys_admin"` adds that one capability to the runtime's
    defaults (not `privileged`: no devices, no other capabilities), with
    seccomp RuntimeDefault (its profile admits unshare and mount to a holder
    of CAP_SYS_ADMIN) and AppArmor unconfined (the runtime's default profile
    denies mount(2), which a shell's read-only bind mounts need). "gvisor"
    runs the pod under GKE Sandbox instead: the capability then belongs to
    gVisor's user-space kernel, not the node's; gVisor serves single-host
    TPU slices only. "none": environments that run no code;
  * size: cpu and memory requests (memory also the limit: a host over it is
    OOM-killed alone instead of starving its node; no CPU limit, so the
    input pipeline and the compiler are never throttled);
  * stopping: terminationGracePeriodSeconds = ceil(pod.checkpoint_seconds x
    pod.grace_margin), the time a stopped trainer gets to finish the save
    in flight;
  * queueing: the Kueue label `kueue.x-k8s.io/queue-name` (`pod.queue`);
  * a name unique to the workdir (`job_name`).

None of it has run on a cluster: the tests check the manifests against the
kubernetes client's models and the CRDs' published schemas.
"""

from __future__ import annotations

import hashlib
import math
import os
from typing import Iterator

from sao_jax.config import sections
from sao_jax.pod import hosts as pod_lib

APP_DIR = "/app"  # the image's checkout (Dockerfile WORKDIR)
QUEUE_LABEL = "kueue.x-k8s.io/queue-name"
GCSFUSE_DRIVER = "gcsfuse.csi.storage.gke.io"
GCSFUSE_ANNOTATION = "gke-gcsfuse/volumes"
GVISOR = "gvisor"
NAME_LENGTH = 40  # <name>-<replicated job>-<job index>-<pod index> stays a DNS label


# ------------------------------------------------------------------ names
def job_name(base: str, workdir: str) -> str:
  """`base` as a Kubernetes name, suffixed with a hash of the workdir: two
  runs whose workdirs share a last component get different names, and the
  same workdir always the same one (Kubernetes then refuses a second job
  writing into a run that already has one)."""
  text = "".join(c if c.isalnum() else "-" for c in base.lower()).strip("-")
  suffix = hashlib.sha256(workdir.rstrip("/").encode()).hexdigest()[:6]
  head = (text or "sao-jax")[: NAME_LENGTH - len(suffix) - 1].strip("-") or "sao-jax"
  return f"{head}-{suffix}"


def labels(pod: sections.Pod) -> dict:
  return {QUEUE_LABEL: pod.queue} if pod.queue else {}


# ---------------------------------------------------------------- storage
# Strings with these are patterns (e.g. parameter-path rules "/attn/(q|k)$"), not files.
_REGEX_CHARS = set("()|$^*+?[]{}\\")


def config_paths(config, workdir: str) -> Iterator[tuple[str, str, bool]]:
  """(where, path, written) for every place the job reads or writes: the
  workdir and the fleet root (written), then every absolute or gs:// path
  among the config's strings outside the pod section (read; a string with
  regex metacharacters is a pattern, not a path). `config`: the run's
  Sections (a ConfigDict is loaded)."""
  config = sections.load(config)
  yield "--workdir", workdir, True
  root = config.fleet.root
  if root:
    yield "fleet.root", root, True
  for where, value in _strings(config.to_dict()):
    if where.startswith("pod.") or where == "fleet.root":
      continue
    if where.startswith("eval.sets"):  # "NAME=SPEC"
      value = value.partition("=")[2] or value
    if (value.startswith("/") or value.startswith("gs://")) and not _REGEX_CHARS & set(value):
      yield where, value, False


def _strings(node, where: str = "") -> Iterator[tuple[str, str]]:
  if isinstance(node, dict):
    for k, v in node.items():
      yield from _strings(v, f"{where}.{k}" if where else str(k))
  elif isinstance(node, (list, tuple)):
    for i, v in enumerate(node):
      yield from _strings(v, f"{where}[{i}]")
  elif isinstance(node, str):
    yield where, node


def _volume_of(path: str, volumes) -> tuple | None:
  for volume in volumes:
    mount = volume[0]
    if path == mount or path.startswith(mount + "/"):
      return volume
  return None


def check_storage(config, workdir: str, pod: sections.Pod) -> None:
  """Refuses (ConfigError, one line) a job whose pods would not share its files."""
  volumes = sections.parse_pod_volumes(pod.volumes)
  on_gcs = [v for v in volumes if v[1] == "gcs"]
  for where, path, written in config_paths(config, workdir):
    if path.startswith("gs://"):
      on_gcs.append(path)
      continue
    path = os.path.normpath(path)
    volume = _volume_of(path, volumes)
    if volume is None and path.startswith(APP_DIR + "/") and not written:
      continue  # in the image
    if volume is None:
      raise sections.ConfigError(
        f"{where} = {path!r}: on no volume of pod.volumes = {pod.volumes!r}, so each pod "
        f"would {'write' if written else 'read'} its own disk; mount shared storage there "
        "(e.g. --config.pod.volumes=\"('/mnt/run=pvc:CLAIM',)\") or use a gs:// path"
      )
    if written and volume[3]:
      raise sections.ConfigError(
        f"{where} = {path!r}: the job writes there, but its volume {volume[0]} is "
        'mounted read-only (":ro" in pod.volumes)'
      )
  if on_gcs and not pod.service_account:
    raise sections.ConfigError(
      "pod.service_account = '': the job uses GCS; name the Kubernetes service account "
      "bound to a Google service account that may use the bucket (Workload Identity)"
    )


def volumes(pod: sections.Pod) -> tuple[list[dict], list[dict]]:
  """(the pod's volumes, the container's volumeMounts) of `pod.volumes`."""
  pod_volumes, mounts = [], []
  for i, (mount, kind, name, read_only) in enumerate(sections.parse_pod_volumes(pod.volumes)):
    vname = f"{kind}-{i}"
    if kind == "pvc":
      pod_volumes.append(
        {"name": vname, "persistentVolumeClaim": {"claimName": name, "readOnly": read_only}}
      )
    else:
      pod_volumes.append(
        {
          "name": vname,
          "csi": {
            "driver": GCSFUSE_DRIVER,
            "readOnly": read_only,
            "volumeAttributes": {"bucketName": name, "mountOptions": "implicit-dirs"},
          },
        }
      )
    mounts.append({"name": vname, "mountPath": mount, "readOnly": read_only})
  return pod_volumes, mounts


# ------------------------------------------------------- the pod template
def grace_seconds(pod: sections.Pod) -> int:
  return int(math.ceil(pod.checkpoint_seconds * pod.grace_margin))


def security_context(pod: sections.Pod) -> dict | None:
  if pod.sandbox == "none":
    return None
  context = {"capabilities": {"add": ["SYS_ADMIN"]}, "seccompProfile": {"type": "RuntimeDefault"}}
  if pod.sandbox == "sys_admin":
    context["appArmorProfile"] = {"type": "Unconfined"}
  return context


def tpu_node_selector(pod: sections.Pod, topology: str) -> dict:
  """GKE's labels of a TPU slice of `topology`."""
  return {
    "cloud.google.com/gke-tpu-accelerator": pod.tpu_type,
    "cloud.google.com/gke-tpu-topology": topology,
  }


def role_requests(pod: sections.Pod, role: str) -> dict:
  return pod.trainer_requests if role == pod_lib.TRAINER else pod.rollout_requests


def resources(requests: dict, tpu_chips: int = 0) -> dict:
  """Requests as given, memory also the limit, TPU chips both (no CPU limit)."""
  tpu = {"google.com/tpu": str(tpu_chips)} if tpu_chips else {}
  return {"requests": {**requests, **tpu}, "limits": {"memory": requests["memory"], **tpu}}


def pod_template(
  pod: sections.Pod,
  container: dict,
  *,
  requests: dict,
  tpu_chips: int = 0,
  node_selector: dict | None = None,
  spec: dict | None = None,
) -> dict:
  """A PodTemplateSpec around `container` with every piece above (`spec`:
  more pod spec fields, e.g. the restart policy)."""
  pod_volumes, mounts = volumes(pod)
  container = {**container, "resources": resources(requests, tpu_chips)}
  if mounts:
    container["volumeMounts"] = mounts
  context = security_context(pod)
  if context:
    container["securityContext"] = context
  body = {
    **(spec or {}),
    "terminationGracePeriodSeconds": grace_seconds(pod),
    "containers": [container],
  }
  if node_selector:
    body["nodeSelector"] = node_selector
  if pod.service_account:
    body["serviceAccountName"] = pod.service_account
  if pod.sandbox == "gvisor":
    body["runtimeClassName"] = GVISOR
  if pod_volumes:
    body["volumes"] = pod_volumes
  template = {"spec": body}
  if any("csi" in v for v in pod_volumes):  # the gcsfuse sidecar is injected where asked
    template["metadata"] = {"annotations": {GCSFUSE_ANNOTATION: "true"}}
  return template


def check_sandbox(pod: sections.Pod, hosts_per_slice: dict) -> None:
  """gVisor serves single-host TPU slices only: refuse it for a multi-host group."""
  if pod.sandbox != "gvisor":
    return
  for role, n in hosts_per_slice.items():
    if n > 1:
      raise sections.ConfigError(
        f"pod.sandbox = 'gvisor': the {role} slice has {n} hosts, and GKE Sandbox serves "
        "single-host TPU slices only; use pod.sandbox = 'sys_admin'"
      )
